"""Medusa (Cai et al. 2024, arXiv 2401.10774): extra decoding heads on the target's last hidden state.

Head k (k = 1..K) reads the target's final hidden state h_t at position t — the same vector the
target's LM head turns into p(x_{t+1}) — and guesses x_{t+1+k}. In our loop the newest committed
token x_{t+1} was just sampled from the target, so at each step:

    h = state.target_hidden[-1]                 the target's hidden state that produced the newest token
    z_k = h + SiLU(W_k h)                       one ResBlock per head, W_k zero-initialised (so z_k = h at start)
    logits_k = z_k @ E_sub^T                    the target's LM head rows for the head vocabulary
    tree: node at depth d takes the c-th best token of head d + 1 (a Medusa "choice" path)

All candidates are verified at once with tree attention (tree.py) and the shared verification core
(verify.py): lossless recursive rejection, or Medusa's *lossy* typical acceptance.

Deviations from the paper, and why:
- The LM head is the target's, shared by all heads and frozen (Medusa-1 gives every head its own
  LM head, initialised from the target's). A per-head LM head for SmolLM2 is 49,152 x 576 = 28M
  parameters (57 MB in bf16), over the project's 25 MB checkpoint budget per drafter; the ResBlocks
  alone are 0.33M parameters per head.
- Heads compute only the rows of the ``vocab`` most frequent corpus tokens (default 8,192, ~97% of
  response tokens, see corpus.top_tokens): K full 49k-row matmuls per step would cost almost as much
  as the 135M target itself on a CPU. Proposals are deterministic top-k picks (one-hot q), so
  verification stays exact whatever the vocabulary.
- Training is self-distillation (the paper's recipe for models whose SFT data is unavailable): soft
  cross-entropy to the target's own distribution at position t + k over the head vocabulary, head
  k weighted by ``decay ** (k - 1)`` (the paper uses 0.8 ** k).
"""

from __future__ import annotations

import torch
from torch import nn

from ..decoding import Drafter, SpecState
from ..tree import tree_from_choices
from ..verify import DraftTree
from . import head_rows, with_vocab

# --------------------------------------------------------------------------- heads


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised: an untrained head starts as the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K ResBlocks; the (frozen, shared) LM head lives outside so the checkpoint holds only these."""

    def __init__(self, hidden: int, n_heads: int = 4):
        super().__init__()
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be an int >= 1, got {n_heads!r}")
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(n_heads))

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    def forward(self, h: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """h [..., H] -> z [n, ..., H]: the first ``n`` heads' inputs to the LM head (default: all K)."""
        return torch.stack([b(h) for b in self.blocks[:n]])


# --------------------------------------------------------------------------- drafter


class MedusaDrafter(Drafter):
    """Proposes the tree ``choices`` from the Medusa heads' top-k tokens (one-hot q: lossless verify).

    heads   MedusaHeads on the target's device/dtype
    vocab   [Vd] target token ids the heads may propose (None = the full vocabulary)
    choices Medusa choice paths (see tree_from_choices); depth <= number of heads
    """

    needs_hidden = True

    def __init__(self, target, heads: MedusaHeads, choices: list[tuple[int, ...]], vocab: torch.Tensor | None = None):
        self.nodes, self.parents = tree_from_choices(choices)
        depth = max(len(c) for c in self.nodes)
        if depth > heads.n_heads:
            raise ValueError(f"the tree is {depth} deep but there are only {heads.n_heads} Medusa heads; "
                             "drop the deeper choices or train more heads")
        W, vocab = head_rows(target.get_output_embeddings().weight, vocab)  # [Vd, H]
        self.topk = max(c[-1] for c in self.nodes) + 1
        if self.topk > W.shape[0]:
            raise ValueError(f"the tree asks for the top-{self.topk} tokens of a head but the head vocabulary has "
                             f"only {W.shape[0]}")
        p = next(heads.parameters())
        if p.device != W.device:
            raise ValueError(f"Medusa heads are on {p.device} but the target is on {W.device}; move both to one device")
        self.heads, self.W, self.vocab, self.depth = heads.eval(), W.contiguous(), vocab, depth
        # for each node: (head index, rank)
        self._head = torch.tensor([len(c) - 1 for c in self.nodes])
        self._rank = torch.tensor([c[-1] for c in self.nodes])
        self.forwards = 0

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        h = state.target_hidden[-1].to(self.W.dtype)  # [H]: produced the newest committed token
        z = self.heads(h, self.depth)  # [D, H]
        logits = z @ self.W.T  # [D, Vd]
        top = logits.topk(self.topk, dim=-1).indices  # [D, topk]
        tok = top[self._head.to(top.device), self._rank.to(top.device)]  # [N]
        if self.vocab is not None:
            tok = self.vocab[tok]
        self.forwards += 1
        return DraftTree(tok.cpu(), self.parents)


# --------------------------------------------------------------------------- training objective


class MedusaObjective:
    """Medusa-1 self-distillation: frozen target, heads learn p_target(x_{t+1+k} | x_{<=t+k}).

    Teacher at position t + k = softmax over the head vocabulary of the target's cached final hidden
    state through its LM head; the student (head k at position t) is trained with soft cross-entropy.
    """

    kind = "medusa"

    def __init__(self, target, n_heads: int = 4, vocab: torch.Tensor | None = None, decay: float = 0.8,
                 feature_index: int = 0):
        W = target.get_output_embeddings().weight.detach()
        W_sub, vocab = head_rows(W, vocab)
        self.vocab = None if vocab is None else vocab.cpu()
        self.W = W_sub.float()  # [Vd, H] frozen
        self.W_full = W.float()
        self.heads = MedusaHeads(W.shape[1], n_heads).to(W.device).float()
        self.module = self.heads
        self.decay, self.fi = decay, feature_index

    def _pairs(self, batch):
        """Per head k: (student input h_t [M, H], teacher feature f_{t+k} [M, H])."""
        f = batch.feats[:, :, self.fi, :]  # [B, S, H]
        out = []
        for k in range(1, self.heads.n_heads + 1):
            m = batch.mask[:, :-k] & batch.mask[:, k:]  # both positions predict response tokens in the window
            out.append((f[:, :-k][m], f[:, k:][m]))
        return out

    def loss(self, batch):
        total, metrics, norm = 0.0, {}, 0.0
        W = self.W
        for k, (h, ft) in enumerate(self._pairs(batch), start=1):
            if h.shape[0] == 0:
                continue
            z = self.heads.blocks[k - 1](h.to(W.dtype))
            q_logits = z @ W.T.to(z.dtype)
            with torch.no_grad():
                p = torch.softmax((ft.to(W.dtype) @ W.T).float(), -1)
            ce = -(p * torch.log_softmax(q_logits.float(), -1)).sum(-1).mean()
            w = self.decay ** (k - 1)
            total = total + w * ce
            norm += w
            metrics[f"top1_h{k}"] = float((q_logits.argmax(-1) == p.argmax(-1)).float().mean())
        return total / max(norm, 1e-9), metrics

    def evaluate(self, batch, topk: int = 10):
        """Per head: top-1 and top-``topk`` accuracy against the target's full-vocabulary argmax, and the
        rank histogram (acc_h{k}_r{c} = P(the c-th best head token is the target's argmax)) the sparse
        tree is built from."""
        res = {}
        for k, (h, ft) in enumerate(self._pairs(batch), start=1):
            if h.shape[0] == 0:
                continue
            z = self.heads.blocks[k - 1](h.to(self.W.dtype))
            q_logits = z @ self.W.T.to(z.dtype)
            want = (ft.to(self.W_full.dtype) @ self.W_full.T).argmax(-1)  # [M] in the full vocabulary
            top = q_logits.topk(topk, -1).indices
            if self.vocab is not None:
                top = self.vocab.to(top.device)[top]
            hit = top == want[:, None]  # [M, topk]
            res[f"top1_h{k}"] = float(hit[:, 0].float().mean())
            res[f"top{topk}_h{k}"] = float(hit.any(-1).float().mean())
            for c in range(topk):
                res[f"acc_h{k}_r{c}"] = float(hit[:, c].float().mean())
        res["mean_top1"] = sum(res[f"top1_h{k}"] for k in range(1, self.heads.n_heads + 1) if f"top1_h{k}" in res) \
            / self.heads.n_heads
        return res

    def card_config(self) -> dict:
        return {"n_heads": self.heads.n_heads, "decay": self.decay,
                "vocab_size": None if self.vocab is None else int(len(self.vocab))}

    def state(self) -> dict:
        return with_vocab(self.heads.state_dict(), self.vocab)


def rank_accuracy(card: dict) -> list[list[float]]:
    """acc[k][c] from a checkpoint card's held-out evaluation (what sparse_tree needs)."""
    ev = card["heldout"]
    K = card["config"]["n_heads"]
    C = max(int(key.rsplit("_r", 1)[1]) for key in ev if key.startswith("acc_h1_r")) + 1
    return [[ev[f"acc_h{k}_r{c}"] for c in range(C)] for k in range(1, K + 1)]


def load_medusa(target, path) -> tuple[MedusaHeads, torch.Tensor | None, dict]:
    """Heads (on the target's device and dtype), their vocabulary and the card; refuses a checkpoint for
    another target or a corrupt file (training.load_checkpoint)."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="medusa")
    vocab = state.pop("vocab", None)
    W = target.get_output_embeddings().weight
    heads = MedusaHeads(W.shape[1], int(card["config"]["n_heads"]))
    try:
        heads.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match {card['config']['n_heads']} Medusa heads of width "
                              f"{W.shape[1]} ({e})") from e
    heads.to(device=W.device, dtype=W.dtype).eval()
    return heads, (None if vocab is None else vocab.to(W.device)), card
