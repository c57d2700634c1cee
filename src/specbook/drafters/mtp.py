"""Multi-token prediction with DeepSeek-V3's sequential MTP modules (2412.19437, Sec. 2.2), on a frozen target.

Module k (k = 1..D) at position i, its own weights:

    h'_i^k = M_k [RMSNorm(h_i^{k-1}) ; RMSNorm(Emb(t_{i+k}))]      M_k: 2H -> H, no bias
    h_i^k  = TRM_k(h'^k)_i                                         one causal decoder layer of the target's family
    P_{i+k+1}^k = softmax(LMHead(FinalNorm(h_i^k)))                 target's final norm + LM head, shared, frozen

h^0 is the target's last hidden state. Module k reads module k-1's output, so the causal chain holds across
depths: module k at position i predicts token i + k + 1 having seen every token up to i + k. The same two
inputs as EAGLE's head (a hidden state and the next token's embedding), but one module per depth, no feature
regression, and in DeepSeek-V3 trained *with* the trunk during pretraining.

Where this differs from the paper:
- the trunk is frozen (post-hoc modules; the paper trains trunk and modules jointly), so the MTP loss
  L = (lambda / D) sum_k CE_k is the only loss and lambda (0.3, then 0.1 in DeepSeek-V3) just rescales it:
  we use per-depth weights 1 / D (lambda = 1) and hard cross-entropy on the corpus' tokens, as the paper;
- h^0 is the target's hidden state *after* its final norm (what our feature cache stores); the module
  normalizes its input again, so this only changes a scale M_k learns;
- the concatenation is [RMSNorm(Emb); RMSNorm(h)] (the EAGLE block's order; a permutation of M_k's columns);
- the LM head may be restricted to the N most frequent corpus tokens (``vocab``), as our EAGLE head is:
  positions whose true token is outside it are left out of the loss.

Drafting (``MTPDrafter``): each module keeps a KV cache of the positions whose inputs are all committed
(module k: i <= n - 1 - k for n committed tokens). A step runs each module once, in order, over its new
committed positions plus the k - 1 positions that read this step's drafted tokens; module k's output at
position n - 2 gives draft token k. The speculative positions are cropped away afterwards.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..cache import crop_to
from ..decoding import Drafter, SpecState
from ..sampling import probs_from, sample
from ..verify import DraftTree
from . import RMSNorm32, head_rows, with_vocab
from .eagle.head import EagleHead


class MTPModule(nn.Module):
    """One MTP module: input norms + M_k (2H -> H, no bias) + TRM_k (the EAGLE block without its final norm)."""

    def __init__(self, target_config):
        super().__init__()
        H, eps = target_config.hidden_size, getattr(target_config, "rms_norm_eps", 1e-6)
        self.hnorm = RMSNorm32(H, eps=eps)
        self.enorm = RMSNorm32(H, eps=eps)
        self.block = EagleHead(target_config, bias=False, final_norm=False)  # block.fc is M_k

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, position_ids=None, attention_mask=None, cache=None):
        """h_prev [B, S, H] (h^{k-1}_i), emb [B, S, H] (Emb(t_{i+k})) -> h^k [B, S, H] (before the final norm)."""
        return self.block(self.enorm(emb), self.hnorm(h_prev), position_ids=position_ids,
                          attention_mask=attention_mask, cache=cache)


class MTPModules(nn.Module):
    """D sequential modules. ``forward_chain`` runs them teacher-forced over whole sequences (training)."""

    def __init__(self, target_config, depth: int):
        super().__init__()
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"the number of MTP modules must be an int >= 1, got {depth!r}")
        self.hidden = target_config.hidden_size
        self.mods = nn.ModuleList(MTPModule(target_config) for _ in range(depth))

    @property
    def depth(self) -> int:
        return len(self.mods)

    def forward_chain(self, h0: torch.Tensor, emb: torch.Tensor) -> list[torch.Tensor]:
        """h0 [B, S, H] the target's hidden states, emb [B, S, H] the tokens' embeddings ->
        [h^1 [B, S-1, H], h^2 [B, S-2, H], ...]: h^k[:, i] predicts token i + k + 1."""
        outs, h = [], h0
        for k, mod in enumerate(self.mods, start=1):
            S = h0.shape[1] - k
            h = mod(h[:, :S], emb[:, k:k + S])
            outs.append(h)
        return outs

    def trainable_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if ".model.embed_tokens" not in k}


def final_norm(target) -> nn.Module:
    """The target's own final norm (shared and frozen, as DeepSeek-V3 shares the output head)."""
    norm = getattr(getattr(target, "model", None), "norm", None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(target).__name__} (expected target.model.norm)")
    return norm


class MTPObjective:
    """Teacher-forced MTP training: L = sum_k (1/D) CE(P^k_{i+k+1}, t_{i+k+1}) over response tokens."""

    kind = "mtp"

    def __init__(self, target, depth: int = 3, vocab: torch.Tensor | None = None, feature_index: int = 0):
        W, vocab = head_rows(target.get_output_embeddings().weight, vocab)
        self.vocab = None if vocab is None else vocab.cpu()
        self.W = W.detach().float()  # [Vd, H] frozen
        self.E = target.get_input_embeddings()
        self.norm = copy.deepcopy(final_norm(target)).float().requires_grad_(False)  # shared and frozen
        self.modules = MTPModules(target.config, depth).to(self.W.device).float()
        self.module = self.modules
        self.fi = feature_index
        self.config = target.config
        V = target.get_output_embeddings().weight.shape[0]
        # target id -> row of the (reduced) head, -1 outside it (EAGLE-3's t2d as an index map)
        self.t2d = torch.full((V,), -1, dtype=torch.long, device=self.W.device)
        self.t2d[vocab if vocab is not None else torch.arange(V, device=self.W.device)] = torch.arange(
            self.W.shape[0], device=self.W.device)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.float()) @ self.W.T

    def _per_depth(self, batch):
        """-> [(logits [M, Vd], labels [M] rows of the head, in_vocab [M] bool)] per depth, at loss positions."""
        with torch.no_grad():
            emb = self.E(batch.tokens).float()
        outs = self.modules.forward_chain(batch.feats[:, :, self.fi, :].float(), emb)
        res = []
        for k, h in enumerate(outs, start=1):
            S = h.shape[1]
            m = batch.mask[:, k:k + S - 1]  # position i predicts token i + k + 1: in the window and a response token
            labels = self.t2d[batch.tokens[:, k + 1:k + S]][m]
            res.append((self._logits(h[:, :S - 1][m]), labels))
        return res

    def loss(self, batch):
        total, info = 0.0, {}
        D = self.modules.depth
        for k, (logits, labels) in enumerate(self._per_depth(batch), start=1):
            ok = labels >= 0
            ce = nn.functional.cross_entropy(logits[ok].float(), labels[ok]) if ok.any() else logits.sum() * 0
            total = total + ce / D
            info[f"ce{k}"] = float(ce.detach())
            info[f"top1_{k}"] = float((logits[ok].argmax(-1) == labels[ok]).float().mean()) if ok.any() else 0.0
        return total, info

    @torch.no_grad()
    def evaluate(self, batch):
        """Held-out, teacher-forced: acc_k = module k's top-1 equals the corpus token (pass 0 = the target's
        greedy token; tokens outside the head vocabulary count as misses), ce_k its cross-entropy."""
        res = {}
        for k, (logits, labels) in enumerate(self._per_depth(batch), start=1):
            hit = logits.argmax(-1) == labels
            res[f"acc_{k}"] = float(hit.float().mean())
            res[f"ce_{k}"] = float(nn.functional.cross_entropy(logits[labels >= 0].float(), labels[labels >= 0]))
        res["mean_acc"] = sum(res[f"acc_{k}"] for k in range(1, self.modules.depth + 1)) / self.modules.depth
        return res

    def card_config(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "num_hidden_layers_target": self.config.num_hidden_layers,
                "model_type": self.config.model_type, "modules": self.modules.depth,
                "loss": "sum_k (1/D) CE_k, hard labels (DeepSeek-V3 lambda/D with lambda = 1: frozen trunk)",
                "vocab_size": None if self.vocab is None else int(len(self.vocab))}

    def state(self) -> dict:
        return with_vocab(self.modules.trainable_state(), self.vocab)


def load_mtp(target, path) -> tuple[MTPModules, torch.Tensor | None, dict]:
    """Modules (on the target's device and dtype), their vocabulary and the card; refuses a checkpoint made
    for another target, another architecture, or a corrupt file."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="mtp")
    c = card["config"]
    want = {"hidden_size": target.config.hidden_size, "num_hidden_layers_target": target.config.num_hidden_layers,
            "model_type": target.config.model_type}
    got = {k: c.get(k) for k in want}
    if got != want:
        raise CheckpointError(f"{path} holds MTP modules for {got}, but this target is {want}; train them with "
                              "`python -m specbook.train mtp`")
    vocab = state.pop("vocab", None)
    mods = MTPModules(target.config, int(c["modules"]))
    missing, unexpected = mods.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if ".model.embed_tokens" not in k]:
        raise CheckpointError(f"{path}: weights do not match {c['modules']} MTP modules for this target "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    W = target.get_output_embeddings().weight
    mods.to(device=W.device, dtype=W.dtype).eval()
    return mods, (None if vocab is None else vocab.to(W.device)), card


class MTPDrafter(Drafter):
    """A chain of ``depth`` tokens per step, token k from module k (depth <= the modules trained).

    At T = 0 each token is module k's argmax; at T > 0 it is sampled from q_k (module k's distribution under
    the loop's SamplingConfig, over the head vocabulary, zero elsewhere) and verified by exact rejection."""

    needs_hidden = True

    def __init__(self, target, modules: MTPModules, vocab: torch.Tensor | None = None, *, depth: int | None = None):
        depth = modules.depth if depth is None else depth
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if depth > modules.depth:
            raise ValueError(f"depth {depth} needs {depth} MTP modules but the checkpoint has {modules.depth}; "
                             f"use depth <= {modules.depth} or train more with `python -m specbook.train mtp "
                             f"--modules {depth}`")
        if modules.hidden != target.config.hidden_size:
            raise ValueError(f"the MTP modules have width {modules.hidden}, the target {target.config.hidden_size}: "
                             "they were built for another target")
        self.W, self.vocab = head_rows(target.get_output_embeddings().weight, vocab)
        if next(modules.parameters()).device != self.W.device:
            raise ValueError("the MTP modules and the target are on different devices; move both to one device")
        self.target, self.mods, self.depth = target, modules.eval(), depth
        self.E, self.norm = target.get_input_embeddings(), final_norm(target)
        self.V = target.get_output_embeddings().weight.shape[0]
        self.forwards = 0

    def begin(self, state: SpecState) -> None:
        from transformers import DynamicCache

        cfg = self.mods.mods[0].block.model.config
        self.caches = [DynamicCache(config=cfg) for _ in range(self.depth)]
        self.done = [0] * (self.depth + 1)  # done[k]: committed positions module k has run (k = 0: the target)
        # tail[k]: committed outputs of module k (k = 0: target hidden states) from position done[k + 1] on
        self.tail = [torch.zeros(0, self.W.shape[1], dtype=self.W.dtype, device=self.W.device)
                     for _ in range(self.depth + 1)]

    def _q(self, h: torch.Tensor, sampling) -> torch.Tensor:
        """Module output [H] -> q over the head vocabulary under the loop's sampling config (float32)."""
        return probs_from(self.norm(h[None])[0] @ self.W.T, sampling)

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        n = len(state.tokens)  # committed tokens; the target has hidden states for positions 0..n-2
        hid = state.target_hidden.to(self.W.dtype)
        if n - 1 - hid.shape[0] != self.done[0]:
            raise RuntimeError(f"MTP drafter has target states up to {self.done[0]} but new ones start at "
                               f"{n - 1 - hid.shape[0]}: call begin() for a new sequence")
        self.tail[0] = torch.cat([self.tail[0], hid])
        self.done[0] = n - 1
        toks, qs, spec = [], [], self.tail[0][:0]  # spec: module k-1's outputs at positions after its committed ones
        for k in range(1, self.depth + 1):
            start, end = self.done[k], max(0, n - k)  # committed positions [start, end); speculative [end, n - 1)
            h_in = torch.cat([self.tail[k - 1], spec])  # positions [start, n - 1)
            if h_in.shape[0] == 0:
                break  # nothing to read yet (a one-token prompt)
            ids = (state.tokens + toks)[start + k:n - 1 + k]  # t_{i + k}
            pos = torch.arange(start, n - 1, device=self.W.device)[None]
            out = self.mods.mods[k - 1](h_in[None], self.E(torch.tensor([ids], device=self.W.device)).to(self.W.dtype),
                                        position_ids=pos, cache=self.caches[k - 1])[0]
            self.forwards += 1
            crop_to(self.caches[k - 1], end)  # keep the committed positions only
            self.tail[k] = torch.cat([self.tail[k], out[:end - start]])
            self.tail[k - 1] = self.tail[k - 1][end - start:]  # module k has consumed these
            self.done[k] = end
            spec = out[end - start:]
            q = self._q(out[-1], state.sampling)
            i = int(q.argmax()) if state.sampling.greedy else int(sample(q, state.generator))
            if self.vocab is not None:
                toks.append(int(self.vocab[i]))
                q = torch.zeros(self.V, device=q.device).index_copy_(0, self.vocab, q)
            else:
                toks.append(i)
            qs.append(q)
        if not toks:
            return DraftTree.chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, self.V))
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long), torch.stack(qs))


def chain_survival(card: dict) -> list[float]:
    """Estimated chance that draft tokens 1..D all survive at T = 0: the cumulative product of the held-out
    teacher-forced accuracies acc_1..acc_D of the card (module k is right given right inputs)."""
    out, s = [], 1.0
    for k in range(1, int(card["config"]["modules"]) + 1):
        s *= float(card["heldout"][f"acc_{k}"])
        out.append(s)
    return out


def auto_depth(card: dict, latency: dict[int, float], module_cost: float, max_depth: int | None = None) -> int:
    """The chain depth D this machine pays for: argmax over D of (1 + sum of the first D survivals) /
    (D x module_cost + latency(D + 1)) — the Leviathan trade-off with the measured latency curve and the
    modules' measured cost (one forward per module per step)."""
    from ..roofline import interp_latency

    surv = chain_survival(card)[:max_depth]

    def rate(d):
        return (1 + sum(surv[:d])) / (d * module_cost + interp_latency(latency, d + 1))

    return max(range(1, len(surv) + 1), key=lambda d: (rate(d), -d))


@torch.inference_mode()
def measure_module_cost(target, modules: MTPModules, vocab: torch.Tensor | None = None, context: int = 256,
                        repeats: int = 5) -> float:
    """Median seconds of one module forward over 2 new positions after ``context`` cached ones, with its
    logits over the head vocabulary: the per-depth drafting cost of ``auto_depth``."""
    from transformers import DynamicCache

    from ..roofline import median_seconds

    W, _ = head_rows(target.get_output_embeddings().weight, vocab)
    mod, H = modules.mods[0], W.shape[1]
    cache = DynamicCache(config=mod.block.model.config)
    x = torch.zeros(1, context, H, dtype=W.dtype, device=W.device)
    mod(x, x, position_ids=torch.arange(context, device=W.device)[None], cache=cache)
    norm = final_norm(target)
    pos = torch.arange(context, context + 2, device=W.device)[None]

    def step():
        out = mod(x[:, :2], x[:, :2], position_ids=pos, cache=cache)
        torch.softmax((norm(out[:, -1]) @ W.T).float(), -1)

    return median_seconds(step, repeats, reset=lambda: crop_to(cache, context))
