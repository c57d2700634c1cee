"""DFlash (2602.06036): a block of gamma tokens drafted in ONE forward; DSpark (Cheng et al. 2026, 2607.05147):
a Markov head that makes the block semi-autoregressive and a confidence head whose calibrated cumulative product
is each prefix's survival probability.

Drafter network (``BlockNet``), names as in z-lab/dflash and vLLM's speculators:

    ctx_j   = hidden_norm(fc([a^{l1}_j ; ... ; a^{lm}_j]))        fc: mH -> H, no bias; the target's states at the
                                                                  committed positions j <= n - 2
    block   = [Emb(x_0), m, m, ..., m]  at positions n-1 .. n-1+gamma   x_0 = the newest committed token (the anchor);
                                                                  m = a learned mask embedding (SmolLM2 has no
                                                                  mask token, so the draft owns one vector)
    layer i:  K = [k_proj(ctx) ; k_proj(x)], V likewise; queries from the block only; NO causal mask inside the
              block (every block position sees every context position and every other block position)
    base_k  = lm_head(norm(h_k))                                  the target's LM head rows, frozen (shared)

Block position k = 1..gamma predicts the token AT position n - 1 + k (the anchor's own output is unused), as in
z-lab's drafting code. Taps follow DFlash's rule (``default_taps``): m layers evenly spaced from layer 1 to L - 3,
each the output of that layer (``output_hidden_states`` index layer + 1).

DSpark's heads on top (``markov_rank`` > 0, ``confidence``):

    logits_k = base_k + W2 W1[x_{k-1}]        Markov head, rank r: tokens are drawn left to right, each reading
                                              the previous block token (x_0 the anchor); teacher-forced in training
    c_k      = sigmoid(w . [norm(h_k) ; W1[x_{k-1}]])   confidence head: the chance x_k survives verification given
                                              its prefix did; trained (BCE) toward c*_k = 1 - TV(q_k, p_k), the
                                              acceptance probability of a token drawn from q_k at temperature 1
    a_k      = prod_{i<=k} sigmoid(z_i / t_i) calibrated prefix survival; t_i from sequential temperature scaling
                                              on held-out blocks (DSpark's rule; the card's ``calibration``).
                                              ``block_calibration`` refits it on the loop's own blocks with a
                                              shift b_i as well (sigmoid(z_i / t_i + b_i)), what drafters use

Training (``DFlashObjective`` / ``DSparkObjective``, through the one loop): ``anchors`` random anchors per
window; a block's queries see the window's context before its anchor and their own block. Position weights
w_k = exp(-(k - 1) / 4) — DeepSpec's and speculators' code (exp(-pos / 4)); the DFlash paper writes gamma in
place of 4. DFlash: cross-entropy on the corpus tokens. DSpark: 0.1 CE + 0.9 TV(q_k, p_k) + 1.0 BCE(c_k, c*_k),
each position-weighted, as DeepSpec.

Where we simplify (sizes for a 135M target on 2 CPU cores):
- 2 draft layers (the papers use 5 on 4-8B targets) and 3 taps (``train --taps`` picks others; a tap at L is the final
  state EAGLE reads, which DFlash's rule leaves out: at equal steps it scored lower here, docs/train/dspark_taps_*.json);
- the draft proposes from a reduced vocabulary (the N most frequent corpus tokens, the target's own LM-head rows,
  frozen), as our other heads; positions whose true token is outside it leave the CE (TV and c* use the target's
  full distribution, so tokens the draft cannot propose count as lost);
- Markov rank r = 64 (DSpark: 256), and W1 is indexed by the draft vocabulary plus one row for any other token
  (only the anchor can be outside it);
- the confidence head reads the final-normed block state (what the LM head reads).

Drafting (``BlockDrafter``): the context K/V of every committed position is computed once per draft layer and
kept; a step appends the newly committed positions and runs ONE forward over the gamma + 1 block positions.
Truncation by the draft's own survival stays lossless because the decision to keep position k reads only
a_k, which depends on x_{<k}, never on x_k itself (``threshold``: a number = DeepSpec's static rule, "auto" =
keep position k while it raises the expected tokens per second of the measured latency curve).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..cache import GrowingKV, right_padded
from ..calibration import auroc, brier, ece
from ..decoding import Drafter, SpecState, shared_sampling
from ..features import teacher_stats
from ..sampling import probs_from, sample
from ..verify import DraftTree
from . import RMSNorm32, head_rows
from .eagle.head import _head_config
from .eagle3 import Eagle3Attention, _rotate_half

POSITION_DECAY = 4.0  # w_k = exp(-(k - 1) / 4)


def default_taps(num_layers: int, m: int = 3) -> tuple[int, ...]:
    """DFlash's layer choice as ``output_hidden_states`` indices: m layers evenly spaced over [1, L - 3]
    (one tap: the middle layer), each read at its output (index layer + 1). SmolLM2 (30 layers), m = 3: (2, 15, 28)."""
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"the number of feature taps must be an int >= 1, got {m!r}")
    if m == 1:
        return (num_layers // 2 + 1,)
    start, end = 1, num_layers - 3
    return tuple(start + i * (end - start) // (m - 1) + 1 for i in range(m))


def check_gamma(gamma) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (the block's draft length) must be an int >= 1, got {gamma!r}")
    return gamma


def check_threshold(threshold):
    if threshold is None or threshold == "auto":
        return threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be a survival probability in [0, 1], 'auto' or None, got {threshold!r}")
    return float(threshold)


class BlockAttention(Eagle3Attention):
    """Llama attention (GQA, rotary) whose keys / values are [context ; block] and whose queries are the block's."""

    def __init__(self, cfg):
        super().__init__(cfg, in_width=cfg.hidden_size)

    def _heads(self, x, n):  # [B, S, n * hd] -> [B, n, S, hd]
        B, S, _ = x.shape
        return x.view(B, S, n, self.hd).transpose(1, 2)

    def kv(self, x, cos, sin):
        """x [B, S, H] (context features or normed block states) -> k, v [B, nkv, S, hd] (rotary on k)."""
        k, v = self._heads(self.k_proj(x), self.nkv), self._heads(self.v_proj(x), self.nkv)
        cos, sin = cos[:, None], sin[:, None]
        return k * cos + _rotate_half(k) * sin, v

    def forward(self, x, cos, sin, ctx_kv, mask=None):
        """x [B, Q, H] normed block states; ctx_kv (k, v) [B, nkv, C, hd], or a drafter's ``GrowingKV`` slot (its
        ``join`` writes the block's K/V after the context instead of concatenating); mask None (all visible) or
        bool [B, 1, Q, C + Q] (True = may attend) -> [B, Q, H]."""
        q = self._heads(self.q_proj(x), self.nh)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k, v = self.kv(x, cos, sin)
        if isinstance(ctx_kv, tuple):
            k, v = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)
        else:
            k, v = ctx_kv.join(k, v)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                       enable_gqa=self.nkv != self.nh)
        return self.out(o)


class BlockLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm32(H, eps=eps)
        self.post_attention_layernorm = RMSNorm32(H, eps=eps)
        self.self_attn = BlockAttention(cfg)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, cos, sin, ctx_kv, mask=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockNet(nn.Module):
    """DFlash's draft network (+ DSpark's Markov and confidence heads when ``markov_rank`` > 0 / ``confidence``).
    The LM head is not a parameter: the caller passes the target's (frozen) rows for ``vocab``."""

    def __init__(self, target_config, vocab: torch.Tensor, *, gamma: int = 7, layers: int = 2,
                 taps: tuple[int, ...] | None = None, markov_rank: int = 0, confidence: bool = False):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        L, V = target_config.num_hidden_layers, target_config.vocab_size
        self.gamma = check_gamma(gamma)
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"the draft needs an int >= 1 of layers, got {layers!r}")
        taps = tuple(default_taps(L) if taps is None else taps)
        if not taps or any(not 1 <= t <= L for t in taps):
            raise ValueError(f"feature taps must be output_hidden_states indices in [1, {L}], got {taps}")
        if not isinstance(markov_rank, int) or markov_rank < 0:
            raise ValueError(f"markov_rank must be an int >= 0 (0 = no Markov head), got {markov_rank!r}")
        if confidence and markov_rank == 0:
            raise ValueError("DSpark's confidence head reads W1[x_{k-1}]: it needs a Markov head (markov_rank > 0)")
        vocab = torch.as_tensor(vocab, dtype=torch.long)
        if vocab.ndim != 1 or len(vocab) < 1 or int(vocab.min()) < 0 or int(vocab.max()) >= V or \
                (vocab[1:] <= vocab[:-1]).any():
            raise ValueError(f"the draft vocabulary must be sorted, distinct target ids in [0, {V})")
        self.config = _head_config(target_config)
        self.config.num_hidden_layers = layers
        H, eps = target_config.hidden_size, target_config.rms_norm_eps
        self.hidden, self.taps, self.rank = H, taps, markov_rank
        self.fc = nn.Linear(len(taps) * H, H, bias=False)
        self.hidden_norm = RMSNorm32(H, eps=eps)
        self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)
        self.layers = nn.ModuleList(BlockLayer(self.config) for _ in range(layers))
        self.norm = RMSNorm32(H, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        self.register_buffer("vocab", vocab)
        t2d = torch.full((V,), len(vocab), dtype=torch.long)  # target id -> draft index; len(vocab) = any other token
        t2d[vocab] = torch.arange(len(vocab))
        self.register_buffer("t2d", t2d)
        if markov_rank:
            self.markov_w1 = nn.Embedding(len(vocab) + 1, markov_rank)
            self.markov_w2 = nn.Linear(markov_rank, len(vocab), bias=False)
            nn.init.zeros_(self.markov_w2.weight)  # starts as plain DFlash
        self.confidence = nn.Linear(H + markov_rank, 1) if confidence else None

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, C, m * H] the taps' states -> ctx [B, C, H] = hidden_norm(fc(feats))."""
        return self.hidden_norm(self.fc(feats))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> rotary (cos, sin) [B, S, hd] in ``dtype``: rows of a table ``rotary_emb`` computed
        once (each position's row does not depend on the others, so the values are the same), regrown when a
        position passes it."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        table = getattr(self, "_rope", None)
        if table is None or table[0].shape[1] < need or table[0].device != positions.device:
            n = max(need, 2 * table[0].shape[1] if table is not None else 1024)
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor: training reads it too
                pos = torch.arange(n, device=positions.device)[None]
                table = self.rotary_emb(torch.zeros(1, device=positions.device), position_ids=pos)
            self._rope = table
        cos, sin = table
        return cos[0][positions].to(dtype), sin[0][positions].to(dtype)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor | None,
                   rope: tuple | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's keys / values of the context: [(k, v) [B, nkv, C, hd]] (rotary at ``positions``, or
        the rows ``rope`` = (cos, sin) given)."""
        cos, sin = self.rope(positions, ctx.dtype) if rope is None else rope
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block(self, emb: torch.Tensor, positions: torch.Tensor | None, ctx_kv, mask=None,
              rope: tuple | None = None) -> torch.Tensor:
        """emb [B, Q, H] (anchor embedding / mask embedding), positions [B, Q] (or their rotary rows ``rope``),
        ctx_kv per layer (k, v) or a slot with ``join`` -> normed states [B, Q, H]."""
        cos, sin = self.rope(positions, emb.dtype) if rope is None else rope
        h = emb
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    def markov(self, prev: torch.Tensor) -> torch.Tensor | None:
        """Previous block tokens (target ids) [...] -> W1 rows [..., r] (None without a Markov head)."""
        return self.markov_w1(self.t2d[prev]) if self.rank else None

    def greedy_chain(self, h: torch.Tensor, base: torch.Tensor, prev: torch.Tensor):
        """Greedy drafting of whole blocks: h [R, g, H] normed states, base [R, g, Vd] their logits, prev [R] the
        anchors (target ids) -> tokens [R, g] (target ids) and the confidence logits z [R, g] (None without the
        head), x_k = argmax(base_k + W2 W1[x_{k-1}]) left to right. Every position is drawn; the caller cuts the
        block (a_k reads z_k, which reads x_{k-1}, never x_k), so the chain is the same wherever the cut falls."""
        toks, zs = [], []
        for k in range(h.shape[1]):
            logits = base[:, k]
            if self.rank:
                w1 = self.markov(prev)  # [R, r]
                logits = logits + self.markov_w2(w1)
                if self.confidence is not None:
                    zs.append(self.confidence_logit(h[:, k], w1))
            prev = self.vocab[logits.argmax(-1)]
            toks.append(prev)
        return torch.stack(toks, 1), torch.stack(zs, 1) if zs else None

    def confidence_logit(self, h: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        """[..., H] normed state, [..., r] W1[x_{k-1}] -> z [...] (c = sigmoid(z / t))."""
        return self.confidence(torch.cat([h, w1], -1))[..., 0]


def block_mask(anchors: torch.Tensor, S: int, gamma: int) -> torch.Tensor:
    """Training's attention for A blocks drafted in one window of S positions: anchors [A] -> bool [A(gamma+1),
    S + A(gamma+1)] (True = may attend): block b's queries see the context positions before its anchor and every
    position of their own block (non-causal), never a later context position or another block."""
    A, n = len(anchors), gamma + 1
    ctx_ok = (torch.arange(S)[None, :] < anchors[:, None]).repeat_interleave(n, 0)  # [A n, S]
    return torch.cat([ctx_ok, torch.block_diag(*[torch.ones(n, n, dtype=torch.bool)] * A)], 1)


def static_cut(survival: list[float], threshold: float) -> int:
    """DeepSpec's static rule: how many block positions are verified = the index of the first position whose
    survival a_k falls below ``threshold`` (the whole block when none does)."""
    return next((k for k, a in enumerate(survival) if a < threshold), len(survival))


def _weights(gamma: int, device=None) -> torch.Tensor:
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / POSITION_DECAY)


def tv_distance(q_d: torch.Tensor, p_v: torch.Tensor) -> torch.Tensor:
    """TV between a draft distribution over the draft vocabulary q_d [..., Vd] (zero elsewhere) and the target's
    p [..., V] given as its mass on the draft vocabulary p_v [..., Vd]: 1/2 (sum |q_d - p_v| + (1 - sum p_v))."""
    return 0.5 * ((q_d - p_v).abs().sum(-1) + (1 - p_v.sum(-1)).clamp_min(0))


class DFlashObjective:
    """DFlash training: ``anchors`` random anchors per window, CE per block position weighted exp(-(k-1)/4).

    Batch feats: the taps then the final hidden state (the teacher: p_k = softmax(lm_head(final)))."""

    kind = "dflash"
    reads_teacher = True  # train.teacher_for hands its data features.load_or_build_teacher's per-token (lse, argmax)
    training_only = ("anchors_per_window",)  # how many blocks a step trains, not the weights' shape
    markov_rank, use_confidence, loss_weights = 0, False, {"ce": 1.0}

    def __init__(self, target, vocab: torch.Tensor | None = None, gamma: int = 7, layers: int = 2,
                 taps: tuple[int, ...] | None = None, anchors: int = 8, seed: int = 0, markov_rank: int | None = None):
        if markov_rank is not None:
            self.markov_rank = markov_rank
        W_full = target.get_output_embeddings().weight.detach().float()
        V = W_full.shape[0]
        vocab = torch.arange(V) if vocab is None else torch.as_tensor(vocab, dtype=torch.long).cpu()
        self.net = BlockNet(target.config, vocab, gamma=gamma, layers=layers, taps=taps,
                            markov_rank=self.markov_rank, confidence=self.use_confidence).to(W_full.device).float()
        self.module = self.net
        self.W_full, self.W = W_full, head_rows(W_full, self.net.vocab)[0]
        self.E, self.config = target.get_input_embeddings(), target.config
        if not isinstance(anchors, int) or anchors < 1:
            raise ValueError(f"anchors per window must be an int >= 1, got {anchors!r}")
        self.anchors, self.g = anchors, torch.Generator().manual_seed(seed)
        self.full_vocab = len(vocab) == V

    # -- the block forward over chosen anchors ------------------------------------------------------------------
    def _anchors(self, batch, heldout: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> anchors [B, A] and which are real [B, A]: window positions a >= 1 whose first predicted token a + 1 is a
        response token (held out: A evenly spaced ones with all gamma predictions inside the window and the response)."""
        B, S = batch.tokens.shape
        g = self.net.gamma
        ok = batch.mask.clone()
        ok[:, 0] = False  # a block needs at least one context position before its anchor
        if heldout:
            full = ok.clone()
            for k in range(1, g):
                full[:, :S - k] &= batch.mask[:, k:]
            full[:, S - g:] = False
            ok = full
        out = torch.zeros(B, self.anchors, dtype=torch.long)
        valid = torch.zeros(B, self.anchors, dtype=torch.bool)
        for b in range(B):
            idx = ok[b].nonzero()[:, 0]
            if len(idx) == 0:
                continue
            if heldout:
                pick = idx[torch.linspace(0, len(idx) - 1, min(self.anchors, len(idx))).round().long()]
            else:
                pick = idx[torch.randperm(len(idx), generator=self.g)[:self.anchors]]
            out[b, :len(pick)], valid[b, :len(pick)] = pick, True
        return out, valid

    def _forward(self, batch, heldout: bool = False):
        """-> dict of [M, gamma] tensors over the M used anchors: logits [M, g, Vd], labels (draft index, -1
        outside the draft vocabulary), ok (a response token inside the window), p_v (target mass on the draft
        vocabulary), t_arg_in (the target's argmax as a draft index, -1 outside), h (normed states), prev tokens."""
        net, g = self.net, self.net.gamma
        B, S = batch.tokens.shape
        m = len(net.taps)
        dev = self.W.device
        anchors, avalid = self._anchors(batch, heldout)
        A = anchors.shape[1]
        feats = batch.feats[:, :, :m, :].float().flatten(2).to(dev)  # [B, S, mH]
        ctx_kv = net.context_kv(net.context(feats), torch.arange(S, device=dev)[None].expand(B, -1))
        offs = torch.arange(g + 1)
        with torch.no_grad():
            anchor_emb = self.E(batch.tokens.gather(1, anchors).to(dev)).float()  # [B, A, H]
        emb = net.mask_embedding.expand(B, A, g + 1, -1).clone()
        emb[:, :, 0] = anchor_emb
        Q = A * (g + 1)
        mask = torch.stack([block_mask(anchors[b], S, g) for b in range(B)])[:, None].to(dev)
        h = net.block(emb.reshape(B, Q, -1), (anchors[:, :, None] + offs).reshape(B, Q).to(dev), ctx_kv, mask)
        h = h.reshape(B, A, g + 1, -1)[:, :, 1:]  # [B, A, g, H]: block position k predicts the token at a + k
        tgt_pos = anchors[:, :, None] + offs[1:]  # [B, A, g]
        inside = tgt_pos <= S - 1
        tp = tgt_pos.clamp_max(S - 1)
        labels_tok = batch.tokens.gather(1, tp.flatten(1)).view(B, A, g)
        prev_tok = batch.tokens.gather(1, (tp - 1).flatten(1)).view(B, A, g)  # x_{k-1}: the true previous token
        ok = inside & batch.mask.gather(1, (tp - 1).flatten(1)).view(B, A, g) & avalid[:, :, None]
        keep = avalid.reshape(-1)
        sel = lambda x: x.reshape(B * A, *x.shape[2:])[keep]  # noqa: E731 - [B, A, ...] -> [M, ...]
        h, labels_tok, prev_tok, ok, tp_sel = sel(h), sel(labels_tok), sel(prev_tok), sel(ok), sel(tp)
        b_idx = torch.arange(B)[:, None].expand(B, A).reshape(-1)[keep]
        with torch.no_grad():  # the teacher p_k reads the final state at a + k - 1: once per window row, not per block
            rows, inv = torch.unique(b_idx[:, None] * S + tp_sel - 1, return_inverse=True)  # [U], [M, g]
            inv = inv.to(dev)
            fin = batch.feats[:, :, m].reshape(B * S, -1)[rows].float().to(dev)  # [U, H]
            if batch.lse is not None:  # the target's full-vocabulary log-sum-exp and argmax, cached per token
                lse, t_arg = batch.lse.reshape(-1)[rows].to(dev), batch.t_arg.reshape(-1)[rows].to(dev)
            else:
                lse, t_arg = teacher_stats(fin, self.W_full)
            t_arg = t_arg[inv]  # [M, g]
            p_v = torch.exp(fin @ self.W.T - lse[:, None])[inv]  # [M, g, Vd]: p_k (all V) read on the draft tokens
        logits = h @ self.W.T
        w1 = net.markov(prev_tok.to(dev))
        if w1 is not None:
            logits = logits + net.markov_w2(w1)
        labels = net.t2d[labels_tok.to(dev)]
        labels = torch.where(labels == len(net.vocab), -1, labels)
        t_in = net.t2d[t_arg]
        t_in = torch.where(t_in == len(net.vocab), -1, t_in)
        return {"logits": logits, "labels": labels, "ok": ok.to(dev), "p_v": p_v, "t_arg_in": t_in, "h": h,
                "w1": w1}

    def _terms(self, f, tv: bool = False):
        """Per-position loss terms [M, g] (CE on the corpus token, TV to the target when a loss term needs it or
        ``tv``, and for DSpark the BCE)."""
        lp = torch.log_softmax(f["logits"].float(), -1)
        has = f["labels"] >= 0
        ce = -lp.gather(-1, f["labels"].clamp_min(0)[..., None])[..., 0] * has
        terms = {"ce": ce, "ce_ok": f["ok"] & has}
        if tv or self.use_confidence or "tv" in self.loss_weights:
            tv = tv_distance(lp.exp(), f["p_v"])
            terms["tv"] = tv
            if self.use_confidence:
                z = self.net.confidence_logit(f["h"], f["w1"])
                terms["z"] = z
                terms["bce"] = nn.functional.binary_cross_entropy_with_logits(z, (1 - tv).detach(),
                                                                              reduction="none")
        return terms

    def loss(self, batch):
        f = self._forward(batch)
        t = self._terms(f)
        w = _weights(self.net.gamma, f["ok"].device)[None]
        total, info = 0.0, {}
        for name, lam in self.loss_weights.items():
            ok = t["ce_ok"] if name == "ce" else f["ok"]
            wk = w * ok
            val = (t[name] * wk).sum() / wk.sum().clamp_min(1e-9)
            total = total + lam * val
            info[name] = float(val.detach())
        return total, info

    @torch.no_grad()
    def collect(self, batch) -> dict:
        """Held-out anchors (all gamma predictions inside the response), teacher-forced: per anchor and position
        hit (the draft's argmax is the target's argmax: acceptance at T = 0 given the prefix was accepted),
        soft = 1 - TV(q_k, p_k) (acceptance at T = 1), and the confidence logits z when the drafter has them."""
        f = self._forward(batch, heldout=True)
        t = self._terms(f, tv=True)
        hit = (f["logits"].argmax(-1) == f["t_arg_in"]) & (f["t_arg_in"] >= 0)
        out = {"hit": hit.float(), "soft": 1 - t["tv"], "ok": f["ok"]}
        if "z" in t:
            out["z"] = t["z"]
        return out

    @torch.no_grad()
    def evaluate(self, batch):
        """acc_k / soft_k: per-position conditional acceptance at T = 0 / T = 1 (teacher-forced); surv_k: the share
        of blocks whose first k tokens all match the target's argmax; tau0 = 1 + sum_k surv_k (tokens per step at
        T = 0 with the full block, the bonus token included)."""
        c = self.collect(batch)
        g = self.net.gamma
        res = {}
        if c["hit"].shape[0] == 0:
            return {"tau0": 1.0, "mean_acc": 0.0}
        surv = c["hit"].cumprod(-1).mean(0)
        for k in range(g):
            res[f"acc_{k + 1}"] = float(c["hit"][:, k].mean())
            res[f"soft_{k + 1}"] = float(c["soft"][:, k].mean())
            res[f"surv_{k + 1}"] = float(surv[k])
        res["tau0"] = 1 + float(surv.sum())
        res["tau1_est"] = 1 + float(c["soft"].cumprod(-1).mean(0).sum())
        res["mean_acc"] = float(c["hit"].mean())
        return res

    def card_config(self) -> dict:
        c, n = self.config, self.net
        return {"hidden_size": c.hidden_size, "num_hidden_layers_target": c.num_hidden_layers,
                "model_type": c.model_type, "vocab_size_target": c.vocab_size, "taps": list(n.taps),
                "gamma": n.gamma, "draft_layers": len(n.layers), "markov_rank": n.rank,
                "confidence": n.confidence is not None, "draft_vocab_size": int(len(n.vocab)),
                "anchors_per_window": self.anchors, "position_weights": "exp(-(k-1)/4)",
                "loss": " + ".join(f"{v} {k.upper()}" for k, v in self.loss_weights.items()),
                "mask_token": "a learned embedding (mask_embedding)"}

    def state(self) -> dict:
        return {k: v for k, v in self.net.state_dict().items() if not k.startswith("rotary_emb") and k != "t2d"}

    def finalize(self, data, batches: int = 40, batch_size: int = 8) -> dict:
        """After training: the held-out per-position statistics the card keeps (and, for DSpark, the sequential
        temperature scaling of the confidence head)."""
        stats = heldout_stats(self, data, batches, batch_size)
        out = {"heldout_positions": {k: stats[k].mean(0).tolist() for k in ("hit", "soft")},
               "heldout_blocks": int(stats["hit"].shape[0])}
        out["heldout_positions"]["surv_greedy"] = stats["hit"].cumprod(-1).mean(0).tolist()
        out["heldout_positions"]["surv_sampled"] = stats["soft"].cumprod(-1).mean(0).tolist()
        if "z" in stats:
            out["calibration"] = calibrate(stats)
        return out


class DSparkObjective(DFlashObjective):
    """DSpark: DFlash + Markov head (rank 64) + confidence head; loss 0.1 CE + 0.9 TV + 1.0 BCE."""

    kind = "dspark"
    markov_rank, use_confidence = 64, True
    loss_weights = {"ce": 0.1, "tv": 0.9, "bce": 1.0}


@torch.no_grad()
def heldout_stats(obj: DFlashObjective, data, batches: int = 40, batch_size: int = 8) -> dict:
    """``collect`` over ``batches`` held-out batches (a fixed generator: the same blocks every call)."""
    g = torch.Generator().manual_seed(1234)
    parts: dict[str, list] = {}
    obj.net.eval()
    for _ in range(batches):
        c = obj.collect(data.batch(batch_size, g, heldout=True))
        for k, v in c.items():
            parts.setdefault(k, []).append(v.cpu())
    obj.net.train()
    return {k: torch.cat(v) for k, v in parts.items()}


# -- calibration ------------------------------------------------------------------------------------------------
TEMPERATURE_GRID = torch.exp(torch.linspace(math.log(0.05), math.log(20.0), 161))


SHIFT_GRID = torch.linspace(-3.0, 3.0, 61)


def survival(z: torch.Tensor, temps, shifts=None) -> torch.Tensor:
    """Confidence logits z [N, g], per-position temperatures [g] (and shifts [g], default 0) -> prefix survival
    a [N, g] = cumprod sigmoid(z / t + b)."""
    t = torch.as_tensor(temps, dtype=z.dtype)
    b = torch.zeros_like(t) if shifts is None else torch.as_tensor(shifts, dtype=z.dtype)
    return torch.sigmoid(z / t + b).cumprod(-1)


def sequential_temperature_scaling(z: torch.Tensor, outcome: torch.Tensor, grid: torch.Tensor = TEMPERATURE_GRID,
                                   bins: int = 10) -> list[float]:
    """DSpark's calibration: per position k, left to right, the temperature t_k minimising the ECE of the
    cumulative product prod_{i<=k} sigmoid(z_i / t_i) against the cumulative outcome prod_{i<=k} o_i, the earlier
    temperatures fixed. z, outcome [N, g] (outcome hard 0/1 or a soft acceptance probability)."""
    target = outcome.double().cumprod(-1)
    temps: list[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.double)
    for k in range(z.shape[1]):
        zk = z[:, k].double()
        errs = [ece(prefix * torch.sigmoid(zk / t), target[:, k], bins) for t in grid.tolist()]
        best = min(range(len(errs)), key=lambda i: (errs[i], abs(math.log(grid[i]))))  # ties: nearest to t = 1
        temps.append(float(grid[best]))
        prefix = prefix * torch.sigmoid(zk / temps[-1])
    return temps


def sequential_platt_scaling(z: torch.Tensor, outcome: torch.Tensor, grid: torch.Tensor = TEMPERATURE_GRID,
                             shift_grid: torch.Tensor = SHIFT_GRID) -> tuple[list[float], list[float]]:
    """Our in-loop calibration (``block_calibration``), where DSpark's temperature alone cannot reach: per
    position k, left to right, the temperature t_k AND shift b_k minimising the log loss of the cumulative product
    prod_{i<=k} sigmoid(z_i / t_i + b_i) against the cumulative outcome, the earlier positions fixed. A shift moves
    the mean survival, which a temperature cannot (the loop's blocks start after a rejection: harder than the
    average position); the objective is the log loss, not the ECE, because a shift can also reach ECE ~ 0 with a
    constant (the base rate), which would tell the scheduler nothing. z, outcome [N, g] -> (temps [g], shifts [g])."""
    target = outcome.double().cumprod(-1)
    temps: list[float] = []
    shifts: list[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.double)
    b = shift_grid.double()[:, None]  # [nb, 1]
    for k in range(z.shape[1]):
        zk, yk = z[:, k].double(), target[:, k]
        best = (math.inf, 1.0, 0.0)
        for t in grid.tolist():
            a = (prefix * torch.sigmoid(zk / t + b)).clamp(1e-9, 1 - 1e-9)  # [nb, N]
            nll = -(yk * a.log() + (1 - yk) * (1 - a).log()).mean(-1)  # [nb]
            i = int(nll.argmin())
            if float(nll[i]) < best[0] - 1e-12:
                best = (float(nll[i]), t, float(shift_grid[i]))
        temps.append(best[1])
        shifts.append(best[2])
        prefix = prefix * torch.sigmoid(zk / best[1] + best[2])
    return temps, shifts


def calibration_report(z: torch.Tensor, outcome: torch.Tensor, temps, shifts=None) -> dict:
    """Per position: ECE / Brier (and AUROC for hard outcomes) of the cumulative survival against the cumulative
    outcome, for the given temperatures (and shifts)."""
    a, target = survival(z.double(), temps, shifts), outcome.double().cumprod(-1)
    hard = bool(((outcome == 0) | (outcome == 1)).all())
    rep = {"ece": [], "brier": [], "auroc": [] if hard else None, "mean_survival": a.mean(0).tolist(),
           "mean_outcome": target.mean(0).tolist()}
    for k in range(z.shape[1]):
        rep["ece"].append(ece(a[:, k], target[:, k]))
        rep["brier"].append(brier(a[:, k], target[:, k]))
        if hard:
            rep["auroc"].append(auroc(a[:, k], target[:, k]))
    return rep


def calibrate(stats: dict, split: float = 0.5) -> dict:
    """Fit per-position temperatures on one half of the held-out blocks, report before / after on the other half;
    two modes: "greedy" (outcome = the draft's argmax is the target's: T = 0) and "sampled" (outcome = 1 - TV, the
    acceptance probability of a token drawn at T = 1). The drafter uses the temperatures fitted on all blocks."""
    z = stats["z"].double()
    n = z.shape[0]
    cut = int(n * split)
    out = {"fit_blocks": cut, "report_blocks": n - cut, "temperatures": {}, "before": {}, "after": {}}
    for mode, o in (("greedy", stats["hit"]), ("sampled", stats["soft"])):
        o = o.double()
        t_fit = sequential_temperature_scaling(z[:cut], o[:cut])
        out["before"][mode] = calibration_report(z[cut:], o[cut:], [1.0] * z.shape[1])
        out["after"][mode] = calibration_report(z[cut:], o[cut:], t_fit)
        out["temperatures"][mode] = sequential_temperature_scaling(z, o)
    return out


# -- loading and drafting ---------------------------------------------------------------------------------------
def load_block(target, path, kind: str) -> tuple[BlockNet, dict]:
    """A DFlash / DSpark network (on the target's device and dtype) and its card; refuses a checkpoint for another
    target, taps the target does not have, or a corrupt file."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind=kind)
    c = card["config"]
    L, H = target.config.num_hidden_layers, target.config.hidden_size
    if (c.get("hidden_size"), c.get("num_hidden_layers_target"), c.get("vocab_size_target")) != \
            (H, L, target.config.vocab_size):
        raise CheckpointError(f"{path} is a {kind} drafter for hidden {c.get('hidden_size')} / "
                              f"{c.get('num_hidden_layers_target')} layers / vocabulary {c.get('vocab_size_target')}, "
                              f"not this target's {H} / {L} / {target.config.vocab_size}; train one with "
                              f"`python -m specbook.train {kind}`")
    if any(not 1 <= t <= L for t in c["taps"]):
        raise CheckpointError(f"{path} taps layers {c['taps']} but the target has {L}")
    net = BlockNet(target.config, state["vocab"], gamma=int(c["gamma"]), layers=int(c["draft_layers"]),
                   taps=tuple(c["taps"]), markov_rank=int(c["markov_rank"]), confidence=bool(c["confidence"]))
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("rotary_emb") and k != "t2d"]:
        raise CheckpointError(f"{path}: weights do not match a {kind} drafter (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    W = target.get_output_embeddings().weight
    return net.to(device=W.device, dtype=W.dtype).eval(), card


class BlockDrafter(Drafter):
    """DFlash / DSpark: ONE draft forward per step proposes a chain of up to ``gamma`` tokens.

    ``threshold`` (DSpark only): None = the full block (DFlash); a number h = cut before the first position whose
    calibrated survival a_k < h (DeepSpec's static rule); "auto" = keep position k while it raises the expected rate
    (1 + sum_{i<=k} a_i) / (draft_cost + latency(k + 1)) of the measured ``latency`` curve (stop at the first position
    that does not). Both read a_k before x_k is drawn: lossless. ``temperatures`` / ``shifts``: the card's calibration
    per sampling mode ({"greedy": [...], "sampled": [...]}; ``block_calibration.card_calibration`` picks them),
    a_k = prod_{i<=k} sigmoid(z_i / t_i + b_i); None = uncalibrated (t = 1, b = 0). ``compiled``: the net's
    ``block_compiled.CompiledBlock``, which runs the context update, the block forward and the LM head (at T = 0 the
    greedy chain too) as one compiled graph (None = eagerly)."""

    needs_hidden = True

    def __init__(self, target, net: BlockNet, *, gamma: int | None = None, threshold=None,
                 temperatures: dict | None = None, shifts: dict | None = None, latency: dict | None = None,
                 draft_cost: float = 0.0, compiled=None):
        gamma = net.gamma if gamma is None else check_gamma(gamma)
        if gamma > net.gamma:
            raise ValueError(f"gamma {gamma} is longer than the block of {net.gamma} this drafter was trained for")
        self.threshold = check_threshold(threshold)
        if self.threshold is not None and net.confidence is None:
            raise ValueError("a survival threshold needs DSpark's confidence head; this checkpoint has none (DFlash "
                             "drafts the full block: threshold=None)")
        if self.threshold == "auto" and not latency:
            raise ValueError("threshold='auto' needs the measured latency curve (roofline.profile_latency)")
        if net.hidden != target.config.hidden_size:
            raise ValueError(f"the drafter has width {net.hidden}, the target {target.config.hidden_size}: "
                             "it was built for another target")
        self.W, _ = head_rows(target.get_output_embeddings().weight, net.vocab)
        if next(net.parameters()).device != self.W.device:
            raise ValueError("the drafter and the target are on different devices; move both to one device")
        self.target, self.net, self.gamma = target, net.eval(), gamma
        self.hidden_layers = net.taps
        self.confidences = net.confidence is not None
        self.temperatures, self.shifts = temperatures or {}, shifts or {}
        self.latency, self.draft_cost = latency, float(draft_cost)
        if compiled is not None and (compiled.net is not net or compiled.gamma != gamma):
            raise ValueError(f"compiled= is the compiled step of another network or block (gamma {compiled.gamma}, "
                             f"this drafter's {gamma}): block_compiled.CompiledBlock(net, W, gamma)")
        self.compiled = compiled
        self.E = target.get_input_embeddings()
        self.V = target.get_output_embeddings().weight.shape[0]
        self.forwards = 0
        self.survival: list[list[float]] = []  # per step: a_k of the proposed positions (and the first one cut)
        self.confidence_logits: list[list[float]] = []  # per step: the confidence head's z_k, same positions

    def begin(self, state: SpecState) -> None:
        self.ctx = GrowingKV()  # per draft layer the committed context's K/V
        self.survival, self.confidence_logits = [], []

    def _calibration(self, sampling) -> tuple[list[float], list[float]]:
        """Per-position (temperatures, shifts) for this sampling mode (uncalibrated: t = 1, b = 0)."""
        mode = "greedy" if sampling.greedy else "sampled"
        t, b = self.temperatures.get(mode), self.shifts.get(mode)
        return [1.0] * self.net.gamma if t is None else t, [0.0] * self.net.gamma if b is None else b

    def _keep(self, k: int, a: list[float]) -> bool:
        """Whether position k (1-based) enters the draft, from the survivals a_1..a_k (never from x_k)."""
        if self.threshold is None:
            return True
        if self.threshold != "auto":
            return static_cut(a, self.threshold) >= k
        from ..roofline import interp_latency

        def rate(n):
            return (1 + sum(a[:n])) / (self.draft_cost + interp_latency(self.latency, n + 1))

        return rate(k) > rate(k - 1)

    @property
    def n_ctx(self) -> int:
        """Committed context positions the drafter holds K/V for (0..n_ctx-1)."""
        return self.ctx.n

    def _new_states(self, state: SpecState) -> tuple[int, torch.Tensor]:
        """n = len(tokens) and the target's states [m, mH] of the newly committed positions n-1-m..n-2."""
        n = len(state.tokens)  # the target has states for positions 0..n-2
        hid = state.target_hidden.to(self.W.dtype)
        if n - 1 - hid.shape[0] != self.n_ctx:
            raise RuntimeError(f"block drafter has context up to {self.n_ctx} but new states start at "
                               f"{n - 1 - hid.shape[0]}: call begin() for a new sequence")
        return n, hid

    def _extend_context_eager(self, hid: torch.Tensor) -> None:
        """The context K/V of new positions (states hid [m, mH]), per draft layer, appended to ``ctx``."""
        net, pos = self.net, torch.arange(self.n_ctx, self.n_ctx + hid.shape[0], device=self.W.device)[None]
        self.ctx.append(net.context_kv(net.context(hid[None]), pos))

    def _extend_context(self, state: SpecState) -> int:
        """Step 1: the context K/V of the newly committed positions, per draft layer. Returns n = len(tokens)."""
        n, hid = self._new_states(state)
        self._extend_context_eager(hid)
        return n

    def _block_inputs(self, state: SpecState, n: int):
        """[anchor, mask x gamma] embeddings [1, g + 1, H] and their positions [1, g + 1]."""
        dev, dt, g = self.W.device, self.W.dtype, self.gamma
        emb = torch.cat([self.E(torch.tensor([[state.tokens[-1]]], device=dev)).to(dt),
                         self.net.mask_embedding.to(dt).expand(1, g, -1)], 1)
        return emb, torch.arange(n - 1, n + g, device=dev)[None]

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        chain = None
        if self.compiled is not None:  # steps 1 and 2, the LM head (and at T = 0 the greedy chain) as one graph
            n, hid = self._new_states(state)
            emb = self._block_inputs(state, n)[0]
            if state.sampling.greedy:
                h, base, *chain = self.compiled(self, hid, emb, torch.tensor([state.tokens[-1]], device=emb.device))
            else:
                h, base = self.compiled(self, hid, emb)
        else:
            n = self._extend_context(state)
            emb, pos = self._block_inputs(state, n)
            slots = [self.ctx.slot(i) for i in range(len(self.net.layers))]
            h, base = self.net.block(emb, pos, slots)[:, 1:], None  # 2. ONE forward over [anchor, mask x gamma]
        self.forwards += 1
        return BlockDrafter._draw([self], [state], h, base, chain)[0]

    @staticmethod
    @torch.inference_mode()
    def propose_batch(drafters: list["BlockDrafter"], states: list[SpecState]) -> list[DraftTree]:
        """``propose`` for several sequences sharing one network: ONE block forward over all of them (context K/V
        padded to the longest, padding masked out), then their tokens drawn together, position by position."""
        if len({id(d.net) for d in drafters}) > 1 or len({d.gamma for d in drafters}) > 1:
            return [d.propose(s) for d, s in zip(drafters, states)]
        ns = [d._extend_context(s) for d, s in zip(drafters, states)]
        inputs = [d._block_inputs(s, n) for d, s, n in zip(drafters, states, ns)]
        emb, pos = torch.cat([e for e, _ in inputs]), torch.cat([p for _, p in inputs])
        C, Q = max(d.n_ctx for d in drafters), emb.shape[1]
        views = [d.ctx.views() for d in drafters]
        kv = [(right_padded([v[layer][0] for v in views]), right_padded([v[layer][1] for v in views]))
              for layer in range(len(drafters[0].net.layers))]
        ctx_ok = torch.arange(C)[None] < torch.tensor([d.n_ctx for d in drafters])[:, None]  # [R, C]
        mask = torch.cat([ctx_ok, torch.ones(len(drafters), Q, dtype=torch.bool)], 1)[:, None, None]
        h = drafters[0].net.block(emb, pos, kv, mask.expand(-1, 1, Q, -1).to(emb.device))[:, 1:]  # [R, g, H]
        for d in drafters:
            d.forwards += 1
        if not shared_sampling(states):  # rows that sample differently are drawn one at a time
            return [BlockDrafter._draw([d], [s], h[i:i + 1])[0] for i, (d, s) in enumerate(zip(drafters, states))]
        return BlockDrafter._draw(drafters, states, h)

    @staticmethod
    def _draw(drafters: list["BlockDrafter"], states: list[SpecState], h: torch.Tensor,
              base: torch.Tensor | None = None, chain: tuple | None = None) -> list[DraftTree]:
        """Step 3 for R rows sharing one network and one sampling config / generator: h [R, g, H] the blocks'
        normed states -> per row its tokens, drawn left to right (the Markov head reads x_{k-1}; the survival a_k
        is known before x_k is drawn). Greedy: ``BlockNet.greedy_chain`` (or its result ``chain``, computed in the
        compiled step), then each row cut by its own rule. Sampled: all rows advance together, one position at a
        time; a row whose own cut rule stops it draws nothing more (so one uniform per live row per position, in row
        order: a single row draws exactly what it would alone)."""
        d0, state, R = drafters[0], states[0], len(drafters)
        net, dev, sampling = d0.net, d0.W.device, state.sampling
        base = h @ d0.W.T if base is None else base  # [R, g, Vd]
        prev = torch.tensor([s.tokens[-1] for s in states], device=dev)  # [R] target ids
        temps, shifts = d0._calibration(sampling)
        live = list(range(R))
        toks, qs, a, zs = [[] for _ in range(R)], [[] for _ in range(R)], [[] for _ in range(R)], [[] for _ in range(R)]
        if sampling.greedy:  # argmax picks: one-hot, so they carry no q (verify.DraftTree)
            x_all, z_all = chain if chain is not None else net.greedy_chain(h, base, prev)
            x_all, z_all = x_all.tolist(), None if z_all is None else z_all.float().tolist()
        for k in range(1, d0.gamma + 1):
            w1 = net.markov(prev) if net.rank and not sampling.greedy else None  # [R, r]
            if net.confidence is not None:
                z = [row[k - 1] for row in z_all] if sampling.greedy else \
                    net.confidence_logit(h[:, k - 1], w1).float().tolist()  # [R]
                for r in live:
                    zs[r].append(z[r])
                    a[r].append((a[r][-1] if a[r] else 1.0) / (1 + math.exp(-z[r] / temps[k - 1] - shifts[k - 1])))
                live = [r for r in live if drafters[r]._keep(k, a[r])]
            if not live:
                break
            if sampling.greedy:
                for r in live:
                    toks[r].append(x_all[r][k - 1])
                continue
            logits = base[:, k - 1] if w1 is None else base[:, k - 1] + net.markov_w2(w1)  # [R, Vd]
            q = probs_from(logits[live].float(), sampling)  # [live, Vd]
            x = net.vocab[sample(q, state.generator)]  # [live] target ids
            prev[live] = x
            for j, r in enumerate(live):
                toks[r].append(int(x[j]))
                qs[r].append(q[j])
        return [d._drawn(t, qq, aa, zz) for d, t, qq, aa, zz in zip(drafters, toks, qs, a, zs)]

    def _drawn(self, toks: list[int], qs: list[torch.Tensor], a: list[float], zs: list[float]) -> DraftTree:
        """One row's draw -> its DraftTree (q over the target vocabulary; None for greedy picks, ``qs`` empty); the
        survivals and confidence logits of the proposed positions (and the first one cut) are kept in ``survival`` /
        ``confidence_logits``."""
        self.survival.append(a)
        self.confidence_logits.append(zs)
        if not toks:
            return DraftTree.chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, self.V))
        t = torch.tensor(toks, dtype=torch.long)
        if not qs:
            return DraftTree(t, torch.arange(-1, len(toks) - 1), None,
                             confidence=torch.tensor(a[:len(toks)]) if a else None)
        q_full = torch.zeros(len(qs), self.V, device=self.W.device).index_copy_(1, self.net.vocab, torch.stack(qs))
        return DraftTree(t, torch.arange(-1, len(toks) - 1), q_full,
                         confidence=torch.tensor(a[:len(toks)]) if a else None)


@torch.inference_mode()
def measure_draft_cost(target, net: BlockNet, context: int = 256, repeats: int = 5) -> float:
    """Median seconds of one block forward (gamma + 1 queries over ``context`` cached context positions) with
    its logits over the draft vocabulary: the drafting cost the "auto" cut prices."""
    from ..roofline import median_seconds

    W, _ = head_rows(target.get_output_embeddings().weight, net.vocab)
    dev, dt, g = W.device, W.dtype, net.gamma
    ctx = torch.zeros(1, context, len(net.taps) * net.hidden, dtype=dt, device=dev)
    kv = net.context_kv(net.context(ctx), torch.arange(context, device=dev)[None])
    emb = net.mask_embedding.to(dt).expand(1, g + 1, -1)
    pos = torch.arange(context, context + g + 1, device=dev)[None]
    return median_seconds(lambda: torch.softmax((net.block(emb, pos, kv)[0, 1:] @ W.T).float(), -1), repeats)


def trace_blocks(target, drafter: BlockDrafter, input_ids: torch.Tensor, *, max_new_tokens: int = 64, sampling=None,
                 generator=None, eos_token_id=None) -> tuple[list[dict], object]:
    """Decode once and return every step's block: {"tokens" (the drafted chain), "accepted" (how many the target
    kept), "survival" (a_k, DSpark only) and "z" (the confidence logits)} plus the GenerateResult."""
    from ..decoding import speculative_generate
    from ..sampling import SamplingConfig

    trace: list = []
    res = speculative_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens,
                               sampling=sampling or SamplingConfig(), generator=generator, eos_token_id=eos_token_id,
                               trace=trace)
    steps = []
    for i, t in enumerate(trace):
        n = len(t["draft"])
        steps.append({"tokens": t["draft"], "accepted": len(t["path"]),
                      "survival": drafter.survival[i][:n], "z": drafter.confidence_logits[i][:n]})
    return steps, res
