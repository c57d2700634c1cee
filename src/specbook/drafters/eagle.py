"""EAGLE (Li et al. 2024, arXiv 2401.15077) and EAGLE-2's dynamic draft trees (arXiv 2406.16858).

EAGLE drafts at the *feature* level. The target's final hidden state f_j (what its LM head reads)
is far more predictable than the next token; a light head learns f_{j+1} from (f_j, x_{j+1}), where
the token x_{j+1} removes the sampling uncertainty the feature alone cannot know:

    in_j   = fc([e(x_{j+1}) ; f_j])               e = the target's (frozen) token embedding, fc: 2H -> H
    f^_j+1 = Decoder(in_<=j)                       ONE decoder layer of the target's architecture, own KV cache
    q      = softmax(f^_j+1 @ W_lm^T)              the target's own (frozen) LM head

Drafting runs the head autoregressively on its *own* predicted features, growing a token tree:
EAGLE-1 expands a fixed tree spec (static); EAGLE-2 expands, at each depth, the ``top_k`` nodes of
highest cumulative draft log-probability into their ``top_k`` best children, then keeps the global top
``total_tokens`` nodes (the draft's confidence approximates the acceptance rate, so this is the
tree with the highest expected accepted length). The target verifies the tree in one forward with
tree attention and the shared verification core (children are deterministic top-k picks: one-hot q,
so verification is lossless at any temperature).

Draft KV cache: committed positions only, computed from the target's TRUE features. Tree nodes are
appended while drafting and cropped away afterwards; the accepted tokens are re-run with the
target's features at the next step (as the EAGLE reference does), so after every step the draft
cache equals one recomputed from the committed tokens (tests check this).

Deviations from the papers, and why:
- The decoder layer is transformers' own layer of the target's family, with its input norm and a
  final RMSNorm (EAGLE-1 drops the first input norm and has no final norm; EAGLE-3 adds the final
  norm). Our regression target is the target's post-norm feature, which the final norm matches.
- q and the soft cross-entropy use only the ``vocab`` most frequent corpus tokens of the LM head
  (default 8,192, as for Medusa): a 49k-row LM head per draft forward costs as much as several
  decoder layers on a CPU. Proposals stay top-k picks, so verification stays exact.
- Feature noise: uniform U(-noise, noise) on the input features (EAGLE: U(-0.1, 0.1)); our features
  have an RMS of ~1.9, comparable to the paper's scale.
- Auto tree size (``total_tokens="auto"``): not in the papers. Per step, the tree keeps the k nodes
  maximising (1 + sum of the k best path confidences) / (drafting time + latency(k + 1)), with
  latency(k) the target's measured forward latency curve (roofline.profile_latency_vs_k, notebook
  00's cost model) and the drafting time = draft forwards this step x the measured ``draft_cost``.
  With ``draft_cost`` the expansion also stops before ``depth`` once one more draft forward cannot
  raise that rate even if all the frontier's probability were accepted (``worth_expanding``): on hard
  text (low confidence) the head stops after a depth or two instead of spending ``depth`` forwards.
  The paper takes the draft's confidence as the acceptance rate; our head is underconfident (held-out:
  top-1 right 67% of the time at a mean top-1 confidence of 57%), so the cost model reads confidences
  times ``calibration`` = held-out acceptance / confidence (``confidence_calibration``, from the card).
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..decoding import Drafter, SpecState
from ..roofline import auto_size, interp_latency, step_rates
from ..verify import DraftTree
from . import head_rows


# --------------------------------------------------------------------------- the head


def _head_config(target_config):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[-1:]
    cfg.vocab_size = 1  # the head never embeds ids itself (inputs_embeds only): no 49k x H table
    cfg.pad_token_id = None
    cfg.tie_word_embeddings = False
    return cfg


class EagleHead(nn.Module):
    """fc(2H -> H) + one decoder layer (+ final norm) of the target's family. ~4.2M parameters for SmolLM2."""

    def __init__(self, target_config):
        super().__init__()
        from transformers import AutoModel

        H = target_config.hidden_size
        self.hidden = H
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.model = AutoModel.from_config(_head_config(target_config))
        # drafting (a cache is given) on a Llama-family head skips transformers' model wrapper: see _cached_llama
        self.fast_path = target_config.model_type == "llama" and getattr(target_config, "hidden_act", "") == "silu"

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """emb, feat [B, S, H] (e(x_{j+1}), f_j) -> predicted features f^_{j+1} [B, S, H]."""
        x = self.fc(torch.cat([emb, feat], dim=-1))
        if cache is not None and self.fast_path and position_ids is not None:
            return self._cached_llama(x, position_ids, attention_mask, cache)
        out = self.model(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def _cached_llama(self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> torch.Tensor:
        """The same decoder layer, called module by module (its own norms, projections, rotary embedding, MLP
        and the cache's update; torch's sdpa), without transformers' model wrapper — mask building,
        output capture, deprecation and kwargs plumbing cost ~0.5 ms of a ~1.7 ms draft forward on a 2-core CPU
        and the head runs several times per step. Same operations in the same order: the output equals the
        wrapper's (tests/test_eagle.py checks it bit for bit). x [B, S, H] -> [B, S, H]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.model.layers[0]
        att = layer.self_attn
        B, S, _ = x.shape
        past = cache.get_seq_length()
        if attention_mask is None and S > 1:  # causal over the cache + the new block
            allowed = torch.ones(S, past + S, dtype=torch.bool, device=x.device).tril(past)
            attention_mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~allowed, torch.finfo(x.dtype).min)[None, None]
        cos, sin = self.model.rotary_emb(x, position_ids=position_ids)
        h = layer.input_layernorm(x)
        shape = (B, S, -1, att.head_dim)
        q = att.q_proj(h).view(shape).transpose(1, 2)  # [B, nh, S, hd]
        k = att.k_proj(h).view(shape).transpose(1, 2)  # [B, nkv, S, hd]
        v = att.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, 0)  # [B, nkv, past + S, hd]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=att.scaling,
                                                       enable_gqa=k.shape[1] != q.shape[1])
        x = x + att.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def trainable_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.embed_tokens")}


# --------------------------------------------------------------------------- training objective


class EagleObjective:
    """EAGLE-1 training with the frozen target: 1.0 * SmoothL1(f^, f) + 0.1 * soft-CE(p_target, q).

    Batch positions j = 0..S-2: input (e(x_{j+1}), f_j + noise), regression target f_{j+1}, teacher
    p = softmax(f_{j+1} @ W^T) over the head vocabulary. Loss where f_{j+1} predicts a response token.
    """

    kind = "eagle"

    INPUTS = ("both", "token", "feature")

    def __init__(self, target, vocab: torch.Tensor | None = None, noise: float = 0.1, w_feat: float = 1.0,
                 w_token: float = 0.1, feature_index: int = 0, seed: int = 0, inputs: str = "both"):
        """``inputs``: "both" (EAGLE), or an ablation that zeroes one input — "token" (no feature: a one-layer
        draft LM over token embeddings) or "feature" (no shifted token: EAGLE's feature-only variant)."""
        if inputs not in self.INPUTS:
            raise ValueError(f"inputs must be one of {self.INPUTS}, got {inputs!r}")
        self.inputs = inputs
        W, vocab = head_rows(target.get_output_embeddings().weight, vocab)
        self.vocab = None if vocab is None else vocab.cpu()
        self.W = W.detach().float()  # [Vd, H] frozen
        self.W_full = target.get_output_embeddings().weight.detach().float()
        self.E = target.get_input_embeddings()  # frozen; called as a module (keeps any embedding scale)
        self.head = EagleHead(target.config).to(self.W.device).float()
        self.module = self.head
        self.noise, self.w_feat, self.w_token, self.fi = noise, w_feat, w_token, feature_index
        self.config = target.config
        self._g = torch.Generator(device=self.W.device).manual_seed(seed)

    def _emb(self, ids):
        with torch.no_grad():
            return self.E(ids).float()

    def _predict(self, batch, noise: float, feats=None):
        f = batch.feats[:, :, self.fi, :].float() if feats is None else feats  # [B, S, H]
        f_in = f[:, :-1]
        if noise:
            f_in = f_in + (torch.rand(f_in.shape, generator=self._g, device=f_in.device) * 2 - 1) * noise
        e = self._emb(batch.tokens[:, 1:])
        if self.inputs == "token":
            f_in = torch.zeros_like(f_in)
        elif self.inputs == "feature":
            e = torch.zeros_like(e)
        return self.head(e, f_in)  # [B, S-1, H]

    def loss(self, batch):
        pred = self._predict(batch, self.noise)
        tgt = batch.feats[:, 1:, self.fi, :].float()
        m = batch.mask[:, 1:]
        pred, tgt = pred[m], tgt[m]  # [M, H]
        feat_loss = nn.functional.smooth_l1_loss(pred.float(), tgt)
        q_logits = pred @ self.W.T.to(pred.dtype)
        with torch.no_grad():
            p = torch.softmax(tgt @ self.W.T, -1)
        ce = -(p * torch.log_softmax(q_logits.float(), -1)).sum(-1).mean()
        top1 = float((q_logits.argmax(-1) == p.argmax(-1)).float().mean())
        return self.w_feat * feat_loss + self.w_token * ce, {"feat_l1": float(feat_loss.detach()), "ce": float(ce.detach()),
                                                             "top1": top1}

    def _hits(self, pred, tgt, topk: int):
        """-> hit [M, topk] (the head's c-th guess is the target's greedy token), p_top [M, topk] (the target's
        T = 1 probability of the c-th guess: the chance a one-hot pick of it is accepted when sampling) and
        conf [M] (the draft's own probability of its top guess, softmax over the head vocabulary as drafting
        computes it)."""
        logits = tgt @ self.W_full.T  # [M, V] the target's logits (full vocabulary)
        q_logits = pred @ self.W.T  # [M, Vd] the draft's logits (head vocabulary)
        v, top = q_logits.topk(topk, -1)
        conf = (v[:, 0].float() - q_logits.float().logsumexp(-1)).exp()
        if self.vocab is not None:
            top = self.vocab.to(top.device)[top]
        return top == logits.argmax(-1)[:, None], torch.softmax(logits, -1).gather(-1, top), conf

    @torch.no_grad()
    def evaluate(self, batch, topk: int = 10):
        """Held-out: rank accuracies of the drafted token against the target's greedy token.

        step 1: the head reads the target's true features (the first draft token of every step).
        step 2: every input feature replaced by the head's own step-1 prediction (what deeper draft
        tokens see): how much error compounds when the head drafts on its own features.
        """
        res = {}
        f = batch.feats[:, :, self.fi, :].float()
        m = batch.mask[:, 1:]
        pred1 = self._predict(batch, 0.0)  # [B, S-1, H]: f^_{j+1}
        hit, p_top, conf = self._hits(pred1[m], f[:, 1:][m], topk)
        res["top1"] = float(hit[:, 0].float().mean())
        res[f"top{topk}"] = float(hit.any(-1).float().mean())
        for c in range(topk):
            res[f"acc_r{c}"] = float(hit[:, c].float().mean())
        for c in range(topk):  # what a static tree's rank-c child is worth when the loop samples at T = 1
            res[f"soft_r{c}"] = float(p_top[:, c].mean())
        # the draft's confidence in its top-1 guess: against top1 it says how far EAGLE-2's confidence-as-acceptance
        # estimate is off (confidence_calibration)
        res["conf_r0"] = float(conf.mean())
        res["feat_l1"] = float(nn.functional.smooth_l1_loss(pred1[m], f[:, 1:][m]))
        # step 2: inputs (e(x_{j+2}), f^_{j+1}) -> f^_{j+2}, scored against f_{j+2}
        f2 = torch.cat([f[:, :1], pred1], dim=1)  # position j holds f^_j (j >= 1)
        pred2 = self._predict(batch, 0.0, feats=f2)
        m2 = m.clone()
        m2[:, 0] = False  # position 0 has no predicted input
        hit2, _, _ = self._hits(pred2[m2], f[:, 1:][m2], 1)
        res["top1_step2"] = float(hit2[:, 0].float().mean())
        res["mean_top1"] = 0.5 * (res["top1"] + res["top1_step2"])
        return res

    def card_config(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "num_hidden_layers_target": self.config.num_hidden_layers,
                "model_type": self.config.model_type, "noise": self.noise, "w_feat": self.w_feat,
                "w_token": self.w_token, "inputs": self.inputs, "vocab_size": None if self.vocab is None else int(len(self.vocab))}

    def state(self) -> dict:
        st = dict(self.head.trainable_state())
        if self.vocab is not None:
            st["vocab"] = self.vocab.to(torch.int64)
        return st


@torch.inference_mode()
def teacher_forced_top1(target, head: EagleHead, vocab: torch.Tensor | None, tokens: list[int]) -> torch.Tensor:
    """hit [len(tokens)] bool: hit[t] = the head's top-1 guess for token t — reading the target's true features
    f_0..f_{t-2} and tokens up to t-1, as the first draft token of a step that starts with t-1 committed —
    equals the target's greedy token at t (hit[0] = hit[1] = False: no guess there).

    Averaged over every position this is the held-out top-1 of training; averaged over the positions where
    speculation steps actually started it is the first draft token's acceptance in the loop (T = 0)."""
    W, vocab = head_rows(target.get_output_embeddings().weight, vocab)
    dev = W.device
    ids = torch.tensor([tokens], device=dev)
    f = target(ids, output_hidden_states=True).hidden_states[-1]  # [1, T, H]
    want = target.get_output_embeddings()(f[0]).argmax(-1)  # want[j] = the target's greedy token after position j
    pred = head(target.get_input_embeddings()(ids[:, 1:]).to(W.dtype), f[:, :-1].to(W.dtype))[0]  # f^_{j+1}, j < T-1
    guess = (pred @ W.T).argmax(-1)  # guess for token j + 2
    if vocab is not None:
        guess = vocab[guess]
    hit = torch.zeros(len(tokens), dtype=torch.bool)
    hit[2:] = (guess[:-1] == want[1:-1]).cpu()  # token t = j + 2 against the target's greedy token after t - 1
    return hit


def load_eagle(target, path) -> tuple[EagleHead, torch.Tensor | None, dict]:
    """Head (on the target's device and dtype), its vocabulary and the card; refuses a checkpoint made
    for another target (fingerprint), another architecture / layer count, or a corrupt file."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="eagle")
    c = card["config"]
    want = {"hidden_size": target.config.hidden_size, "num_hidden_layers_target": target.config.num_hidden_layers,
            "model_type": target.config.model_type}
    got = {k: c.get(k) for k in want}
    if got != want:
        raise CheckpointError(f"{path} is an EAGLE head for {got}, but this target is {want}; train one with "
                              "`python -m specbook.train eagle`")
    if c.get("inputs", "both") != "both":
        raise CheckpointError(f"{path} is a {c['inputs']!r}-only ablation head; drafting needs a head trained on "
                              "both inputs (inputs='both')")
    vocab = state.pop("vocab", None)
    head = EagleHead(target.config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("model.embed_tokens")]:
        raise CheckpointError(f"{path}: weights do not match an EAGLE head for this target "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    W = target.get_output_embeddings().weight
    head.to(device=W.device, dtype=W.dtype).eval()
    return head, (None if vocab is None else vocab.to(W.device)), card


# --------------------------------------------------------------------------- dynamic tree (EAGLE-2)


def select_nodes(scores: list[float], parents: list[int], total: int) -> list[int]:
    """EAGLE-2 reranking: the ``total`` candidates of highest score whose ancestors are all kept.

    Scores are cumulative log-probabilities, so a child never beats its parent; ties go to the
    shallower / earlier node, which keeps the selection closed under ancestors. Returned in
    topological (input) order.
    """
    if total < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total}")
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= total:
            break
        if parents[i] < 0 or parents[i] in keep:
            keep.add(i)
    return sorted(keep)


def worth_expanding(values: list[float], frontier_mass: float, latency: dict[int, float], max_nodes: int,
                    overhead: float, draft_cost: float) -> bool:
    """Early stop of EAGLE-2's expansion (not in the paper): is one more draft forward worth its time?

    The children of the frontier hold at most ``frontier_mass`` (the frontier's summed path confidence:
    a node's children share its probability). Even if all of it joined the best tree and verification
    cost nothing extra, the rate is at most max_k (1 + S_k + mass) / (overhead + draft_cost + latency(k + 1)).
    Expand only if that beats the best rate of the tree already in hand; later depths hold no more mass
    per forward, so (up to the small growth of latency with the tree) a depth that cannot pay means none
    after it can."""
    now = max(step_rates(values, latency, max_nodes, overhead), default=0.0)
    best, acc = 0.0, 1.0 + frontier_mass
    for k in range(1, max_nodes + 1):
        acc += values[k - 1] if k <= len(values) else 0.0
        best = max(best, acc / (overhead + draft_cost + interp_latency(latency, k + 1)))
    return best > now


@dataclass
class Pool:
    """Candidate nodes of a dynamic tree, in creation order (parents before children)."""

    tok: list[int] = field(default_factory=list)
    par: list[int] = field(default_factory=list)  # pool index of the parent, -1 = root
    score: list[float] = field(default_factory=list)  # cumulative draft log-probability of the path
    dep: list[int] = field(default_factory=list)  # 0 = child of the root

    def add(self, tok: int, par: int, score: float, dep: int) -> int:
        self.tok.append(tok), self.par.append(par), self.score.append(score), self.dep.append(dep)
        return len(self.tok) - 1

    def tree(self, total: int) -> DraftTree:
        """EAGLE-2's rerank: keep the ``total`` best nodes (select_nodes), topologically ordered by depth."""
        keep = sorted(select_nodes(self.score, self.par, total), key=lambda j: (self.dep[j], j))
        new = {j: i for i, j in enumerate(keep)}
        parents = torch.tensor([new[self.par[j]] if self.par[j] >= 0 else -1 for j in keep], dtype=torch.long)
        return DraftTree(torch.tensor([self.tok[j] for j in keep], dtype=torch.long), parents,
                         confidence=torch.tensor([self.score[j] for j in keep]).exp())


def grow_dynamic(lp_root: torch.Tensor, expand, depth: int, top_k: int, to_tokens=None, keep_going=None) -> Pool:
    """EAGLE-2's expansion phase.

    lp_root [V]: draft log-probabilities of the root's children. ``expand(pool, frontier)`` runs the
    draft on the frontier nodes and returns their children's log-probabilities [F, V].
    depth 1: the root's top_k children. Each further depth: every frontier node gets its top_k
    children (all join the pool); the top_k of those by cumulative score form the next frontier.
    ``to_tokens`` maps head-vocabulary indices to token ids (reduced vocabularies).
    ``keep_going(pool, frontier)``, if given, is asked before each expansion; False stops growing early.
    """
    to_tokens = to_tokens or (lambda idx: idx.tolist())
    pool = Pool()
    v, i = lp_root.topk(top_k)
    frontier = [pool.add(t, -1, float(s), 0) for t, s in zip(to_tokens(i), v.tolist())]
    for d in range(1, depth):
        if keep_going is not None and not keep_going(pool, frontier):
            break
        lp = expand(pool, frontier)  # [F, V]
        cv, ci = lp.topk(top_k, dim=-1)  # [F, k]
        cum = (cv + torch.tensor([pool.score[j] for j in frontier], device=cv.device)[:, None]).tolist()
        toks = to_tokens(ci.reshape(-1))
        children = [pool.add(toks[r * top_k + c], j, cum[r][c], d) for r, j in enumerate(frontier) for c in range(top_k)]
        frontier = sorted(heapq.nlargest(top_k, children, key=lambda j: (pool.score[j], -j)))
    return pool


def static_tree(card: dict, n_nodes: int, depth: int = 5, temperature: float = 0.0) -> list[tuple[int, ...]]:
    """An EAGLE-1 static tree for this head: Medusa's sparse-tree construction (medusa.sparse_tree) with
    the head's held-out rank accuracies (static_accuracy) used at every depth — EAGLE's features keep
    per-depth acceptance roughly flat, unlike Medusa's heads."""
    from .medusa import sparse_tree

    return sparse_tree(static_accuracy(card, depth, temperature), n_nodes)


def static_accuracy(card: dict, depth: int, temperature: float = 0.0) -> list[list[float]]:
    """acc[d][c] for the static tree, the same at every depth: the head's held-out step-1 rank accuracies.

    Greedy (temperature 0): P(the c-th guess is the target's argmax), card ``acc_r{c}``. Sampling: a one-hot
    pick x is accepted with probability p(x), so the c-th guess is worth E[p(x_c)], card ``soft_r{c}``
    (measured at T = 1, used for every T > 0 as an approximation; cards from before it fall back to acc_r)."""
    ev = card["heldout"]
    key = "soft_r" if temperature > 0 and "soft_r0" in ev else "acc_r"
    acc = [ev[f"{key}{c}"] for c in range(sum(1 for k in ev if k.startswith(key)))]
    return [acc] * depth


def confidence_calibration(card: dict, temperature: float = 0.0) -> float:
    """How many accepted tokens one unit of draft confidence is worth, from the head's held-out card: the
    acceptance of the top-1 guess (greedy: ``top1``; sampling: ``soft_r0`` = E[p_target(guess)]) over the
    draft's mean top-1 confidence ``conf_r0``. 1.0 (the paper's confidence = acceptance) for cards without it."""
    ev = card.get("heldout", {})
    key = "soft_r0" if temperature > 0 and "soft_r0" in ev else "top1"
    if not ev.get("conf_r0") or key not in ev:
        return 1.0
    return float(ev[key] / ev["conf_r0"])


# --------------------------------------------------------------------------- drafter


class EagleDrafter(Drafter):
    """EAGLE drafting on the target's features.

    head          EagleHead on the target's device / dtype
    vocab         [Vd] token ids the head may propose (None = full vocabulary)
    choices       a static tree (Medusa-style rank paths, EAGLE-1) — or None for EAGLE-2's dynamic tree:
    depth, top_k  dynamic tree: drafting steps and children per expanded node
    total_tokens  dynamic tree: nodes kept after reranking, or "auto" (per step, from ``latency``)
    latency       {k: seconds} target forward latency curve (roofline.profile_latency_vs_k), for "auto"
    draft_cost    seconds per draft forward (``measure_draft_cost``), for "auto": the step's drafting time joins
                  the cost model, and the expansion stops early once another depth cannot pay (``worth_expanding``)
    calibration   for "auto": accepted tokens per unit of draft confidence (``confidence_calibration(card, T)``);
                  the cost model values a node at min(1, calibration x its path confidence). 1.0 = the paper's
                  confidence-as-acceptance. Only the tree's size and depth move: proposals stay top-k picks.
    """

    needs_hidden = True

    def __init__(self, target, head: EagleHead, vocab: torch.Tensor | None = None, *,
                 choices: list[tuple[int, ...]] | None = None, depth: int = 5, top_k: int = 4,
                 total_tokens: int | str = 16, latency: dict[int, float] | None = None, max_auto: int = 64,
                 draft_cost: float | None = None, calibration: float = 1.0):
        W, self.vocab = head_rows(target.get_output_embeddings().weight, vocab)
        if next(head.parameters()).device != W.device:
            raise ValueError(f"the EAGLE head is on {next(head.parameters()).device} but the target is on {W.device}; "
                             "move both to one device")
        if head.hidden != target.config.hidden_size:
            raise ValueError(f"the EAGLE head has width {head.hidden}, the target {target.config.hidden_size}: "
                             "it was built for another target")
        self.target, self.head, self.W = target, head.eval(), W.contiguous()
        self.E = target.get_input_embeddings()
        self.static = None
        if choices is not None:
            from .medusa import tree_from_choices

            nodes, parents = tree_from_choices(choices)
            self.static = (nodes, parents)
            self.depth = max(len(c) for c in nodes)
            self.top_k = max(c[-1] for c in nodes) + 1
        else:
            if not isinstance(depth, int) or depth < 1:
                raise ValueError(f"depth must be an int >= 1, got {depth!r}")
            if not isinstance(top_k, int) or top_k < 1:
                raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
            if total_tokens == "auto":
                if not latency:
                    raise ValueError("total_tokens='auto' needs the target's latency curve: "
                                     "latency=roofline.profile_latency_vs_k(target)")
            elif not isinstance(total_tokens, int) or total_tokens < depth:
                raise ValueError(f"total_tokens ({total_tokens!r}) must be an int >= depth ({depth}) or 'auto': "
                                 "a smaller tree cannot hold one path of every drafted depth")
            self.depth, self.top_k = depth, top_k
        if self.top_k > W.shape[0]:
            raise ValueError(f"top_k {self.top_k} is above the head vocabulary ({W.shape[0]} tokens)")
        if draft_cost is not None and not (isinstance(draft_cost, (int, float)) and draft_cost >= 0):
            raise ValueError(f"draft_cost must be seconds >= 0 (measure_draft_cost), got {draft_cost!r}")
        if not (isinstance(calibration, (int, float)) and calibration > 0):
            raise ValueError(f"calibration must be > 0 (confidence_calibration(card)), got {calibration!r}")
        self.total_tokens, self.latency, self.max_auto, self.draft_cost = total_tokens, latency, max_auto, draft_cost
        self.calibration = float(calibration)
        self.forwards = 0
        self.cache, self.n_cached = None, 0

    # -- the draft KV cache over committed positions

    def begin(self, state: SpecState) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.head.model.config)
        self.n_cached = 0

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.E(torch.tensor([ids], device=self.W.device)).to(self.W.dtype)

    def _logp(self, f: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((f @ self.W.T).float(), -1)  # draft confidence at T = 1 (EAGLE-2)

    def _catch_up(self, state: SpecState) -> torch.Tensor:
        """Feed the committed positions the head has not seen, with the target's true features;
        returns f^ for the newest token's successor position [H]."""
        n = len(state.tokens) - 1  # positions 0..n-1 have target features; token n is the newest
        hid = state.target_hidden
        first = n - hid.shape[0]
        if first != self.n_cached:
            raise RuntimeError(f"EAGLE draft cache holds {self.n_cached} positions but the new target features start "
                               f"at {first}: call begin() for a new sequence")
        pos = torch.arange(first, n, device=self.W.device)[None]
        f = self.head(self._embed(state.tokens[first + 1:n + 1]), hid[None].to(self.W.dtype), position_ids=pos,
                      cache=self.cache)
        self.forwards += 1
        self.n_cached = n
        return f[0, -1]

    def _expand(self, toks: list[int], feats: torch.Tensor, depth0: int, anc: list[list[int]], n_tree: int):
        """One draft forward over a block of tree nodes (tree attention inside the draft's own cache).

        toks [F] node tokens; feats [F, H] their parents' predicted features; depth0: the block's depth
        (0 = children of the root); anc[i]: indices (in append order) of node i's ancestors already in
        the draft cache after the committed prefix; n_tree: tree nodes already appended.
        -> predicted features [F, H] (inputs of the nodes' children)
        """
        F = len(toks)
        n = self.n_cached
        allowed = torch.zeros(F, n + n_tree + F, dtype=torch.bool)
        allowed[:, :n] = True
        for i, a in enumerate(anc):
            allowed[i, [n + j for j in a]] = True
            allowed[i, n + n_tree + i] = True
        dt = self.W.dtype
        mask = torch.zeros(allowed.shape, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min)[None, None]
        pos = torch.full((1, F), n + depth0, dtype=torch.long, device=self.W.device)
        out = self.head(self._embed(toks), feats[None], position_ids=pos, attention_mask=mask.to(self.W.device),
                        cache=self.cache)
        self.forwards += 1
        return out[0]

    @torch.inference_mode()
    def measure_draft_cost(self, context: int = 256, repeats: int = 5) -> float:
        """Median seconds of one draft forward over ``top_k`` tree nodes (head + log-softmax over the head
        vocabulary) after ``context`` cached positions: the ``draft_cost`` of the auto tree size."""
        import time

        from transformers import DynamicCache

        from ..cache import crop_to

        saved = (self.cache, self.n_cached, self.forwards)  # profiling is not drafting: all restored below
        H, k = self.W.shape[1], self.top_k
        try:
            self.cache = DynamicCache(config=self.head.model.config)
            feats = torch.zeros(1, context, H, dtype=self.W.dtype, device=self.W.device)
            self.head(self._embed([0] * context), feats, position_ids=torch.arange(context, device=self.W.device)[None],
                      cache=self.cache)
            self.n_cached = context
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                self._logp(self._expand([0] * k, feats[0, :k], 0, [[] for _ in range(k)], 0))
                times.append(time.perf_counter() - t0)
                crop_to(self.cache, context)
        finally:
            self.cache, self.n_cached, self.forwards = saved
        return sorted(times[1:])[repeats // 2]

    def _ids(self, idx: torch.Tensor) -> list[int]:
        return (self.vocab[idx] if self.vocab is not None else idx).tolist()

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        from ..cache import crop_to

        start = self.forwards  # this step's draft forwards = self.forwards - start
        f_root = self._catch_up(state)
        lp = self._logp(f_root)  # [Vd]
        tree = self._static(lp, f_root) if self.static is not None else self._dynamic(lp, f_root, start)
        crop_to(self.cache, self.n_cached)  # drop the tree: only committed positions stay
        return tree

    def _dynamic(self, lp_root: torch.Tensor, f_root: torch.Tensor, start: int) -> DraftTree:
        out_feat: dict[int, torch.Tensor] = {-1: f_root}  # pool index -> its predicted feature (children's input)
        slot: dict[int, int] = {}  # pool index -> append order in the draft cache
        n_tree = [0]

        def expand(pool: Pool, frontier: list[int]) -> torch.Tensor:
            anc = []
            for j in frontier:
                a, x = [], pool.par[j]
                while x >= 0:
                    a.append(slot[x])
                    x = pool.par[x]
                anc.append(a)
            f = self._expand([pool.tok[j] for j in frontier], torch.stack([out_feat[pool.par[j]] for j in frontier]),
                             pool.dep[frontier[0]], anc, n_tree[0])
            for r, j in enumerate(frontier):
                slot[j], out_feat[j] = n_tree[0], f[r]
                n_tree[0] += 1
            return self._logp(f)

        auto = self.total_tokens == "auto"
        c = self.draft_cost or 0.0

        cal = self.calibration

        def confidences(pool: Pool) -> list[float]:  # the cost model's acceptance estimate per node, best first
            return sorted((min(1.0, cal * math.exp(s)) for s in pool.score), reverse=True)

        def keep_going(pool: Pool, frontier: list[int]) -> bool:
            mass = cal * sum(math.exp(pool.score[j]) for j in frontier)
            return worth_expanding(confidences(pool), mass, self.latency, self.max_auto,
                                   (self.forwards - start) * c, c)

        pool = grow_dynamic(lp_root, expand, self.depth, self.top_k, to_tokens=self._ids,
                            keep_going=keep_going if auto and self.draft_cost is not None else None)
        if auto:
            total = auto_size(confidences(pool), self.latency, self.max_auto, (self.forwards - start) * c)
        else:
            total = self.total_tokens
        return pool.tree(total)

    def _static(self, lp_root: torch.Tensor, f_root: torch.Tensor) -> DraftTree:
        nodes, parents = self.static
        index = {c: i for i, c in enumerate(nodes)}
        tok = [0] * len(nodes)
        score = [0.0] * len(nodes)
        v, i = lp_root.topk(self.top_k)
        ids = self._ids(i)
        for c in nodes:
            if len(c) == 1:
                tok[index[c]], score[index[c]] = ids[c[0]], float(v[c[0]])
        slot, n_tree = {}, 0
        feat_of = {(): f_root}
        for d in range(1, self.depth):
            # nodes at depth d that have children in the spec
            block = [c for c in nodes if len(c) == d and any(len(x) == d + 1 and x[:d] == c for x in nodes)]
            if not block:
                break
            anc = [[slot[c[:m]] for m in range(1, d)] for c in block]
            f = self._expand([tok[index[c]] for c in block], torch.stack([feat_of[c[:-1]] for c in block]), d - 1,
                             anc, n_tree)
            for r, c in enumerate(block):
                slot[c] = n_tree
                n_tree += 1
                feat_of[c] = f[r]
            lp = self._logp(f)
            cv, ci = lp.topk(self.top_k, dim=-1)
            for r, c in enumerate(block):
                ids = self._ids(ci[r])
                for x in nodes:
                    if len(x) == d + 1 and x[:d] == c:
                        tok[index[x]] = ids[x[-1]]
                        score[index[x]] = score[index[c]] + float(cv[r, x[-1]])
        return DraftTree(torch.tensor(tok, dtype=torch.long), parents.clone(), confidence=torch.tensor(score).exp())
