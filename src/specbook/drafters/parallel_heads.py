"""Gloeckle et al. 2024 (2404.19737), "Better & Faster Large Language Models via Multi-token Prediction", at
toy scale: a trunk trained *from scratch* with n parallel output heads, and self-speculative decoding with
the model's own heads.

    python -m specbook.drafters.parallel_heads train --heads 4 [--steps 1200 ...]   # and --heads 1: baseline

Architecture (the paper's Fig. 1): a shared trunk (L - 1 decoder layers) -> n independent heads (one decoder
layer each) -> a shared final norm and unembedding. Head 1 is the next-token head, so trunk + head 1 is an
ordinary L-layer causal LM (a transformers ``LlamaForCausalLM``: the loop verifies with it like any target);
head i predicts token t + i from the trunk state at t. Loss = sum_i CE_i, and, as the paper does to save
memory, the heads run forward and backward one at a time: each head's gradient is accumulated at the trunk's
output, then the trunk runs backward once.

Self-speculation (Stern et al. 2018's blockwise parallel decoding, the paper's Sec. 3.2): after each step, heads
2..n read the trunk state of the newest committed position and propose the n - 1 following tokens; the
model itself (trunk + head 1) verifies them in its next forward. Lossless at any temperature: each proposal
is drawn from its head's q and verified by exact rejection against the model's own distribution.

Toy-scale choices (say so in results): the model reads and writes a reduced vocabulary — the N most frequent
tokens of the corpus (prompt and response) plus one id for every other token — so the unembedding, not the
trunk, does not eat the CPU budget; it trains on the response tokens of the self-distilled corpus.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from ..decoding import Drafter, SpecState
from ..models import cache_kw
from ..sampling import probs_from, sample
from ..verify import DraftTree


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 8192  # output vocabulary: the N most frequent corpus tokens, + 1 id for every other token
    hidden: int = 256
    layers: int = 4  # trunk = layers - 1 decoder layers; head 1 = the last one (an ordinary L-layer LM)
    heads: int = 4  # n: 1 = the next-token baseline
    attn_heads: int = 4
    max_positions: int = 2048

    def __post_init__(self):
        for k in ("vocab", "hidden", "layers", "heads", "attn_heads", "max_positions"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"{k} must be an int >= 1, got {getattr(self, k)!r}")
        if self.layers < 2:
            raise ValueError("layers must be >= 2: a trunk of at least one layer plus the next-token head")


def toy_vocab(tokens: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent token ids of ``tokens`` (sorted): the toy model's vocabulary."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    return np.sort(np.argsort(-counts, kind="stable")[:n])


class ToyMTP(nn.Module):
    """Trunk + n heads + shared norm / unembedding. ``lm`` (trunk + head 1) is a LlamaForCausalLM."""

    def __init__(self, cfg: ToyConfig, vocab: torch.Tensor, seed: int = 0):
        super().__init__()
        from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

        from .eagle.head import _head_config

        if len(vocab) != cfg.vocab:
            raise ValueError(f"vocab has {len(vocab)} ids, the config says {cfg.vocab}")
        self.cfg = cfg
        self.register_buffer("vocab", torch.as_tensor(vocab, dtype=torch.long), persistent=True)
        other = cfg.vocab  # the id of every token outside the vocabulary
        lc = LlamaConfig(vocab_size=cfg.vocab + 1, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 8 // 3,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.attn_heads,
                         num_key_value_heads=cfg.attn_heads, max_position_embeddings=cfg.max_positions,
                         tie_word_embeddings=True, pad_token_id=other, bos_token_id=None, eos_token_id=None)
        with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG: keep it untouched
            torch.manual_seed(seed)
            self.lm = LlamaForCausalLM(lc)
            self.extra = nn.ModuleList()
            for _ in range(cfg.heads - 1):
                head = AutoModel.from_config(_head_config(lc))
                head.norm = nn.Identity()  # the final norm is the shared one
                self.extra.append(head)

    # ------------------------------------------------------------------ ids
    def to_toy(self, ids: torch.Tensor) -> torch.Tensor:
        """Target-tokenizer ids -> toy ids (every id outside the vocabulary -> the 'other' id)."""
        pos = torch.searchsorted(self.vocab, ids)
        hit = (pos < len(self.vocab)) & (self.vocab[pos.clamp_max(len(self.vocab) - 1)] == ids)
        return torch.where(hit, pos, torch.full_like(pos, self.cfg.vocab))

    # ------------------------------------------------------------------ forward pieces
    def trunk(self, ids: torch.Tensor):
        """toy ids [B, S] -> (trunk states z [B, S, H], rotary embeddings): the first L - 1 layers, causal."""
        m = self.lm.model
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        h = m.embed_tokens(ids)
        pe = m.rotary_emb(h, position_ids=pos)
        for layer in m.layers[:-1]:
            h = layer(h, position_embeddings=pe, position_ids=pos)
        return h, pe

    def head_logits(self, i: int, z: torch.Tensor, pe) -> torch.Tensor:
        """Head i (0 = next token) on trunk states z [B, S, H] -> logits [B, S, V + 1] for token t + i + 1."""
        if i == 0:
            h = self.lm.model.layers[-1](z, position_embeddings=pe)
        else:
            h = self.extra[i - 1](inputs_embeds=z).last_hidden_state
        return self.lm.lm_head(self.lm.model.norm(h))


class ToyObjective:
    """Sum over heads of CE(head i's logits at t, token t + i + 1) at response positions, heads one at a time."""

    kind = "toy_mtp"

    def __init__(self, model: ToyMTP):
        self.model = self.module = model

    def _ce(self, i: int, z, pe, toks, mask):
        S = toks.shape[1]
        m = mask[:, i:S - 1]  # token t + i + 1 is a response token in the window
        logits = self.model.head_logits(i, z, pe)[:, :S - 1 - i]
        return nn.functional.cross_entropy(logits[m].float(), toks[:, i + 1:][m]), logits, m

    def loss(self, batch):
        toks = self.model.to_toy(batch.tokens)
        z, pe = self.model.trunk(toks)
        zd = z.detach().requires_grad_()
        total, info = 0.0, {}
        for i in range(self.model.cfg.heads):  # one head's graph at a time (the paper's memory saving)
            ce, _, _ = self._ce(i, zd, pe, toks, batch.mask)
            ce.backward()
            total += float(ce.detach())
            info[f"ce{i + 1}"] = float(ce.detach())
        surrogate = (z * zd.grad).sum()  # carries the heads' summed gradient into the trunk
        return surrogate - surrogate.detach() + total, info

    @torch.no_grad()
    def evaluate(self, batch):
        """Held-out: ce_i / acc_i per head (head 1 = next-token loss, the number the paper compares)."""
        toks = self.model.to_toy(batch.tokens)
        z, pe = self.model.trunk(toks)
        res = {}
        for i in range(self.model.cfg.heads):
            ce, logits, m = self._ce(i, z, pe, toks, batch.mask)
            res[f"ce_{i + 1}"] = float(ce)
            res[f"acc_{i + 1}"] = float((logits[m].argmax(-1) == toks[:, i + 1:][m]).float().mean())
        res["next_token_loss"] = res["ce_1"]
        return res

    def card_config(self) -> dict:
        return asdict(self.model.cfg)

    def state(self) -> dict:
        # the unembedding is tied to the embedding: stored once
        return {k: v for k, v in self.model.state_dict().items() if k != "lm.lm_head.weight"}


class SelfSpecDrafter(Drafter):
    """Heads 2..n of a ToyMTP propose a chain of n - 1 tokens from the newest trunk state; the model verifies.

    Each extra head keeps a KV cache over the committed trunk states (heads read trunk states only, so nothing
    speculative ever enters it). ``depth`` <= n - 1 uses the first heads only."""

    needs_hidden = True

    def __init__(self, model: ToyMTP, depth: int | None = None):
        n = model.cfg.heads - 1
        depth = n if depth is None else depth
        if n < 1:
            raise ValueError("this model has no extra heads (trained with --heads 1): nothing to self-speculate with")
        if not isinstance(depth, int) or not 1 <= depth <= n:
            raise ValueError(f"depth must be an int in [1, {n}] (the model's extra heads), got {depth!r}")
        self.model, self.depth = model.eval(), depth
        self.hidden_layers = (model.cfg.layers - 1,)  # the trunk's output: hidden_states after L - 1 layers
        self.forwards = 0

    def begin(self, state: SpecState) -> None:
        from transformers import DynamicCache

        self.caches = [DynamicCache(config=h.config) for h in self.model.extra[:self.depth]]
        self.seen = 0

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        z = state.target_hidden  # [new, H] trunk states of the newly committed positions
        first = len(state.tokens) - 1 - z.shape[0]
        if first != self.seen:
            raise RuntimeError(f"heads hold {self.seen} positions but new trunk states start at {first}: call begin()")
        pos = torch.arange(first, first + z.shape[0], device=z.device)[None]
        toks, qs = [], []
        m = self.model
        for head, cache in zip(m.extra[:self.depth], self.caches):
            h = head(inputs_embeds=z[None], position_ids=pos, **cache_kw(cache), use_cache=True).last_hidden_state
            self.forwards += 1
            q = probs_from(m.lm.lm_head(m.lm.model.norm(h[0, -1])), state.sampling)
            toks.append(int(q.argmax()) if state.sampling.greedy else int(sample(q, state.generator)))
            qs.append(q)
        self.seen += z.shape[0]
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long), torch.stack(qs))


class ToyTokenizer:
    """The target tokenizer seen through a toy model's vocabulary (what ``encode`` and the bench need): chat
    template and EOS mapped to toy ids, decode mapped back ('other' ids decode as U+FFFD)."""

    def __init__(self, tokenizer, model: ToyMTP):
        self.tok, self.model = tokenizer, model
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.eos_token_id = self._map([tokenizer.eos_token_id])[0]
        self.pad_token_id = model.cfg.vocab  # the 'other' id: only ever under the attention mask

    def _map(self, ids) -> list[int]:
        return self.model.to_toy(torch.as_tensor(list(ids), dtype=torch.long)).tolist()

    def apply_chat_template(self, messages, **kw):
        ids = self.tok.apply_chat_template(messages, **{**kw, "return_dict": False})
        return self._map(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, ids, **kw) -> str:
        return "".join("\ufffd" if i >= len(self.model.vocab) else self.tok.decode([int(self.model.vocab[i])], **kw)
                       for i in ids)


def load_toy(path) -> tuple[ToyMTP, dict]:
    """A committed toy model and its card (refuses a corrupt file or a config that does not match)."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, kind="toy_mtp")
    cfg = ToyConfig(**card["config"])
    model = ToyMTP(cfg, state["vocab"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.lm.tie_weights()
    if unexpected or set(missing) - {"lm.lm_head.weight"}:
        raise CheckpointError(f"{path}: weights do not match a toy model {cfg} (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    return model.float().eval(), card


def train_toy(cfg: ToyConfig, steps: int, out, batch: int = 8, seq_len: int = 256, lr: float = 2e-3,
              corpus_dir=None, progress: bool = True) -> dict:
    """Train one toy model through the one training loop on the committed corpus; write ``out`` + card."""
    import sys

    from ..corpus import CORPUS_DIR, load_corpus
    from ..models import machine_info
    from ..training import TrainConfig, TrainData, save_checkpoint, train

    corpus = load_corpus(corpus_dir or CORPUS_DIR)
    model = ToyMTP(cfg, torch.from_numpy(toy_vocab(corpus.tokens, cfg.vocab)))
    tc = TrainConfig(steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=min(100, steps // 10 + 1),
                     eval_every=max(1, steps // 6), ckpt_every=steps, eval_batches=8, autocast="off")
    res = train(ToyObjective(model), TrainData(corpus, NoFeatures(), seq_len=seq_len), tc, progress=progress)
    card = {"kind": "toy_mtp", "config": asdict(cfg), "target": None, "corpus_sha": corpus.sha,
            "train_config": asdict(tc), "heldout": res.evals[-1], "evals": res.evals,
            "loss_curve": [h for h in res.history if h["step"] % 10 == 0 or h["step"] == 1],
            "train_seconds": round(res.seconds, 1), "machine": machine_info(),
            "command": "python -m specbook.drafters.parallel_heads " + " ".join(sys.argv[1:])}
    save_checkpoint(out, ToyObjective(model).state(), card)
    return card


class NoFeatures:
    """A feature store for objectives that read tokens only: zero-width features."""

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.zeros(stop - start, 1, 0, dtype=torch.bfloat16)


def main(argv=None):
    import argparse

    from ..prompts import ROOT

    ap = argparse.ArgumentParser(prog="python -m specbook.drafters.parallel_heads", description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["train"])
    d = ToyConfig()
    for f in ("vocab", "hidden", "layers", "heads"):
        ap.add_argument(f"--{f}", type=int, default=getattr(d, f))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default=None, help="default data/checkpoints/toy_mtp_n{heads}")
    a = ap.parse_args(argv)
    cfg = ToyConfig(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads)
    out = a.out or ROOT / "data" / "checkpoints" / f"toy_mtp_n{a.heads}"
    card = train_toy(cfg, a.steps, out, batch=a.batch, seq_len=a.seq_len, lr=a.lr)
    print(f"wrote {out}: held-out " + " ".join(f"{k}={v:.4f}" for k, v in card["heldout"].items()))


if __name__ == "__main__":
    main()
