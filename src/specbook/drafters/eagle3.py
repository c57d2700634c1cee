"""EAGLE-3 (Li et al. 2025, 2503.01840): fused low / mid / high target features, no feature loss, a
training-time test, and a reduced draft vocabulary.

Head (names as in the reference code and the speculators format):

    fused_j = fc([a^{l1}_j ; a^{l2}_j ; a^{l3}_j])       fc: 3H -> H, no bias; a^l = hidden state ENTERING layer l
    layers.0: x = [input_layernorm(Emb(t_{j+1})) ; hidden_norm(h)]  (2H, the attention's input; q/k/v: 2H -> .)
              h' = h + o_proj(attn(x));  h'' = h' + mlp(post_attention_layernorm(h'))   (residual from the
              un-normed hidden part: speculators' norm_before_residual = False)
    logits = lm_head(norm(h''))                           lm_head: H -> draft vocabulary (trained)

h is fused_j at the first draft step and the head's own previous output h'' after it. Taps: layers 2, L/2 and
L - 3 (SmolLM2's 30 layers: 2, 15, 27), as the reference and vLLM; with transformers' ``output_hidden_states``
the state entering layer l is ``hidden_states[l]``. Draft vocabulary: the N most frequent corpus tokens with
the reference's maps ``d2t`` (draft index -> target id OFFSET: target id = index + d2t[index]) and ``t2d``
(bool over the target vocabulary).

Training (``Eagle3Objective``): soft cross-entropy against the target's distribution restricted to the draft
vocabulary (renormalized), positions whose target argmax is outside it masked out; no feature loss. The
training-time test unrolls ``ttt_steps`` (7) draft steps: at step i > 0 the input state is the head's own step
i - 1 output, the input token is the true token i positions later, and a query at position j attends to the
step-0 keys at positions <= j (the committed prefix) plus its own position's keys of steps 1..i (its
ancestors in a draft) — exactly what a draft node at depth i sees at inference. Step weights 0.8^i.

Where we simplify: the draft's lm_head starts from the target's rows for the draft vocabulary (the reference
initializes it fresh), which shortens CPU training.
"""

from __future__ import annotations

import torch
from torch import nn

from ..features import teacher_stats
from . import RMSNorm32
from .eagle.drafter import Eagle2Drafter
from .eagle.head import _head_config


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """The reference's feature taps: layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def vocab_maps(vocab: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary (sorted target ids [Vd]) -> (d2t [Vd] int64 offsets, t2d [V] bool)."""
    vocab = torch.as_tensor(vocab, dtype=torch.long)
    d2t = vocab - torch.arange(len(vocab))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    return d2t, t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """vocab_maps' inverse: d2t offsets [Vd] -> the target id of every draft index (index + d2t[index])."""
    return torch.arange(len(d2t), device=d2t.device) + d2t.long()


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Attention(nn.Module):
    """Llama attention whose q / k / v read 2H features (``in_width``: DFlash's block attention reads H); GQA;
    the training-time-test pattern in ``ttt``."""

    def __init__(self, cfg, in_width: int | None = None):
        super().__init__()
        H, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        W = 2 * H if in_width is None else in_width
        self.hd = getattr(cfg, "head_dim", None) or H // nh
        self.nh, self.nkv, self.scale = nh, nkv, self.hd ** -0.5
        self.q_proj = nn.Linear(W, nh * self.hd, bias=False)
        self.k_proj = nn.Linear(W, nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(W, nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(nh * self.hd, H, bias=False)

    def qkv(self, x, cos, sin):
        """x [B, S, 2H] -> q [B, nh, S, hd], k / v [B, nkv, S, hd] (rotary applied to q and k)."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def out(self, o):  # [B, nh, S, hd] -> [B, S, H]
        B, _, S, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

    def ttt(self, q, k0, v0, diag: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Training-time-test attention. q [B, nh, S, hd]; k0 / v0 [B, nkv, S, hd] step-0 keys (causal);
        diag: (k_s, v_s) of steps 1..i at the same positions (each query sees only its own position's).
        -> [B, nh, S, hd]"""
        rep = self.nh // self.nkv
        k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
        S = q.shape[2]
        s0 = (q @ k0.transpose(-1, -2)) * self.scale  # [B, nh, S, S]
        s0 = s0.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        ds = [(q * k.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * self.scale for k, _ in diag]  # [B, nh, S, 1]
        p = torch.softmax(torch.cat([s0, *ds], dim=-1).float(), dim=-1).to(q.dtype)
        o = p[..., :S] @ v0
        for s, (_, v) in enumerate(diag):
            o = o + p[..., S + s:S + s + 1] * v.repeat_interleave(rep, 1)
        return o


class Eagle3Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm32(H, eps=eps)
        self.hidden_norm = RMSNorm32(H, eps=eps)
        self.post_attention_layernorm = RMSNorm32(H, eps=eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(cfg)

    def inputs(self, emb, h):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)

    def finish(self, h, attn_out):
        h = h + self.self_attn.out(attn_out)  # residual from the un-normed hidden part
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc (3H -> H) + one Eagle3Layer + final norm + lm_head over the draft vocabulary, with d2t / t2d."""

    def __init__(self, target_config, vocab: torch.Tensor, taps: tuple[int, ...] | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        L, V = target_config.num_hidden_layers, target_config.vocab_size
        taps = tuple(default_taps(L) if taps is None else taps)
        if len(taps) != 3 or any(not 0 <= t <= L for t in taps):
            raise ValueError(f"EAGLE-3 fuses 3 layers of the target, each in [0, {L}]; got taps {taps}")
        vocab = torch.as_tensor(vocab, dtype=torch.long)
        if vocab.ndim != 1 or len(vocab) < 1 or int(vocab.min()) < 0 or int(vocab.max()) >= V or \
                (vocab[1:] <= vocab[:-1]).any():
            raise ValueError(f"the draft vocabulary must be sorted, distinct target ids in [0, {V})")
        self.config = _head_config(target_config)
        H = self.hidden = target_config.hidden_size
        self.taps = taps
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(self.config)])
        self.norm = RMSNorm32(H, eps=self.config.rms_norm_eps)
        self.lm_head = nn.Linear(H, len(vocab), bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        d2t, t2d = vocab_maps(vocab, V)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    @property
    def vocab(self) -> torch.Tensor:
        """Draft index -> target id (arange + d2t)."""
        return draft_ids(self.d2t)

    def forward(self, emb, h, position_ids=None, attention_mask=None, cache=None) -> torch.Tensor:
        """One draft step over a block: emb [B, S, H] (Emb of the input tokens), h [B, S, H] (fused features or
        the head's own states) -> the new states [B, S, H] (pre-norm; ``logits`` reads them). With ``cache``:
        keys / values appended to it, ``attention_mask`` additive over cache + block (causal when None)."""
        layer = self.layers[0]
        B, S, _ = h.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=h.device)[None]
        cos, sin = self.rotary_emb(h, position_ids=position_ids)
        q, k, v = layer.self_attn.qkv(layer.inputs(emb, h), cos, sin)
        past = 0
        if cache is not None:
            past = cache.get_seq_length()
            k, v = cache.update(k, v, 0)
        if attention_mask is None and S > 1:
            allowed = torch.ones(S, past + S, dtype=torch.bool, device=h.device).tril(past)
            attention_mask = torch.zeros(allowed.shape, dtype=q.dtype, device=h.device).masked_fill(
                ~allowed, torch.finfo(q.dtype).min)[None, None]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=layer.self_attn.scale,
                                                       enable_gqa=k.shape[1] != q.shape[1])
        return layer.finish(h, o)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def unroll(self, emb_seq: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test. emb_seq [B, S + steps - 1, H] token embeddings (position j of step i reads
        emb_seq[:, j + i]), fused [B, S, 3H] -> the states of steps 0..steps-1, each [B, S, H]; step i at
        position j sits at rotary position j + i and predicts the token i + 1 positions after emb_seq[:, j + i]."""
        layer = self.layers[0]
        B, S, _ = fused.shape
        h, outs, diag, k0 = self.fc(fused), [], [], None
        for i in range(steps):
            pos = torch.arange(i, S + i, device=h.device)[None]
            cos, sin = self.rotary_emb(h, position_ids=pos)
            q, k, v = layer.self_attn.qkv(layer.inputs(emb_seq[:, i:i + S], h), cos, sin)
            if i == 0:
                k0, v0 = k, v
            else:
                diag.append((k, v))
            h = layer.finish(h, layer.self_attn.ttt(q, k0, v0, diag))
            outs.append(h)
        return outs


class Eagle3Objective:
    """Soft CE (target restricted to the draft vocabulary) over ``ttt_steps`` unrolled steps, weights 0.8^i.

    Batch feats: the three taps then the final hidden state (train.METHODS["eagle3"].layers)."""

    kind = "eagle3"
    reads_teacher = True  # train.teacher_for hands its data features.load_or_build_teacher's per-token (lse, argmax)

    def __init__(self, target, vocab: torch.Tensor, taps: tuple[int, ...] | None = None, ttt_steps: int = 7,
                 decay: float = 0.8):
        if not isinstance(ttt_steps, int) or ttt_steps < 1:
            raise ValueError(f"ttt_steps must be an int >= 1, got {ttt_steps!r}")
        W = target.get_output_embeddings().weight.detach().float()
        self.head = Eagle3Head(target.config, vocab, taps).to(W.device).float()
        self.W_d = W[self.head.vocab]  # [Vd, H]: the target's rows of the draft vocabulary (the teacher's logits)
        with torch.no_grad():
            self.head.lm_head.weight.copy_(self.W_d)  # the draft's head starts from them
        self.module = self.head
        self.W_full, self.E, self.config = W, target.get_input_embeddings(), target.config
        self.steps, self.weights = ttt_steps, [decay ** i for i in range(ttt_steps)]

    def _targets(self, batch):
        """Per position p, the target's next-token distribution: restricted to the draft vocabulary and
        renormalized (the teacher), its argmax-in-vocabulary flag, and its unrenormalized mass on each draft
        token (what a one-hot pick is accepted with at T = 1). -> p_d, p_v [B, S, Vd], ok [B, S]."""
        with torch.no_grad():
            final = batch.feats[:, :, 3, :].float()
            lse, t_arg = (batch.lse, batch.t_arg) if batch.lse is not None else teacher_stats(final, self.W_full)
            z = final @ self.W_d.T  # [B, S, Vd]: the target's logits on the draft vocabulary
            ok = self.head.t2d[t_arg]
            p_d = torch.softmax(z, -1)
            p_v = torch.exp(z - lse[..., None])  # softmax over the full vocabulary, read on the draft tokens
        return p_d, ok, p_v

    def _steps(self, batch, steps: int):
        """-> per step i: (logits [M, Vd], teacher p_d [M, Vd], argmax-in-vocab [M], p_v [M, Vd]) at its loss
        positions."""
        S = batch.tokens.shape[1]
        n = S - steps  # positions j = 0..n-1 exist at every step (step i reads token j + 1 + i <= S - 1)
        with torch.no_grad():
            emb = self.E(batch.tokens).float()
        fused = batch.feats[:, :n, :3, :].float().flatten(2)  # [B, n, 3H]
        outs = self.head.unroll(emb[:, 1:], fused, steps)
        p_d, ok, p_v = self._targets(batch)
        res = []
        for i, h in enumerate(outs):
            m = batch.mask[:, i + 1:i + 1 + n]  # step i at j predicts the token after position j + i + 1
            sl = slice(i + 1, i + 1 + n)
            res.append((self.head.logits(h)[m], p_d[:, sl][m], ok[:, sl][m], p_v[:, sl][m]))
        return res

    def loss(self, batch):
        total, info = 0.0, {}
        for i, (logits, p, ok, _) in enumerate(self._steps(batch, self.steps)):
            lp = torch.log_softmax(logits.float(), -1)
            ce = -(p[ok] * lp[ok]).sum(-1).mean() if ok.any() else logits.sum() * 0
            total = total + self.weights[i] * ce
            info[f"ce{i}"] = float(ce.detach())
        return total, info

    @torch.no_grad()
    def evaluate(self, batch, steps: int = 7):
        """acc_i: the draft's argmax at step i equals the target's argmax (a miss where that is outside the draft
        vocabulary), each step reading the head's own previous states: a chain's per-depth acceptance at T = 0
        given the earlier tokens were right. Step 0 also: conf_r0 (the draft's confidence in its top guess) and
        soft_r0 (the target's probability of it), which EAGLE-2's calibration reads."""
        res = {}
        for i, (logits, p, ok, p_v) in enumerate(self._steps(batch, steps)):
            guess = logits.argmax(-1)
            res[f"acc_{i}"] = float(((guess == p.argmax(-1)) & ok).float().mean())
            if i == 0:
                res["conf_r0"] = float(torch.softmax(logits.float(), -1).max(-1).values.mean())
                res["soft_r0"] = float(p_v.gather(-1, guess[:, None]).mean())
        res["top1"] = res["acc_0"]
        res["mean_acc"] = sum(res[f"acc_{i}"] for i in range(steps)) / steps
        return res

    def card_config(self) -> dict:
        c = self.config
        return {"hidden_size": c.hidden_size, "num_hidden_layers_target": c.num_hidden_layers,
                "model_type": c.model_type, "taps": list(self.head.taps), "ttt_steps": self.steps,
                "draft_vocab_size": len(self.head.d2t), "norm_before_residual": False}

    def state(self) -> dict:
        return {k: v for k, v in self.head.state_dict().items() if not k.startswith("rotary_emb")}


def load_eagle3(target, path) -> tuple[Eagle3Head, dict]:
    """Head (on the target's device and dtype) and card; refuses a checkpoint for another target, taps the target
    does not have, or a corrupt file."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="eagle3")
    c = card["config"]
    L = target.config.num_hidden_layers
    if c.get("hidden_size") != target.config.hidden_size or c.get("num_hidden_layers_target") != L:
        raise CheckpointError(f"{path} is an EAGLE-3 head for hidden {c.get('hidden_size')} / "
                              f"{c.get('num_hidden_layers_target')} layers, not this target's {target.config.hidden_size} / {L}")
    if any(not 0 <= t <= L for t in c["taps"]):
        raise CheckpointError(f"{path} taps layers {c['taps']} but the target has {L}")
    return head_from_state(target, state, c["taps"], path, CheckpointError), card


def head_from_state(target, state: dict, taps, where, error: type[Exception]) -> Eagle3Head:
    """An Eagle3Head for ``target`` holding ``state`` (its vocabulary from ``d2t``), on the target's device and
    dtype; ``error`` (naming ``where``) when the tensors are not an EAGLE-3 head's."""
    head = Eagle3Head(target.config, draft_ids(state["d2t"]), tuple(taps))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("rotary_emb")]:
        raise error(f"{where}: weights do not match an EAGLE-3 head (missing {missing[:3]}, unexpected {unexpected[:3]})")
    W = target.get_output_embeddings().weight
    return head.to(device=W.device, dtype=W.dtype).eval()


class Eagle3Drafter(Eagle2Drafter):
    """EAGLE-2's dynamic tree on the EAGLE-3 head: the catch-up reads the three fused taps (through fc), tree
    expansion reads the head's own states, proposals come from its draft vocabulary (mapped by d2t)."""

    def __init__(self, target, head: Eagle3Head, **kw):
        self.hidden_layers = head.taps
        super().__init__(target, head, head.vocab, **kw)
        self.W = head.lm_head.weight  # [Vd, H]: the draft's own head (dtype / device / width for the runner)

    def _features_in(self, hid: torch.Tensor) -> torch.Tensor:
        return self.head.fc(hid)

    def _logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.head.logits(f)


def coverage(counts, sizes) -> dict[int, float]:
    """Share of corpus response tokens covered by the ``n`` most frequent ids, for each n in ``sizes``."""
    import numpy as np

    c = np.sort(np.asarray(counts))[::-1]
    total = max(float(c.sum()), 1.0)
    return {n: float(c[:n].sum() / total) for n in sizes}


def check_eos(vocab: torch.Tensor, eos_ids) -> None:
    """A draft vocabulary must contain every EOS id, or the draft can never propose the end of an answer."""
    missing = [int(e) for e in eos_ids if not bool((torch.as_tensor(vocab) == int(e)).any())]
    if missing:
        raise ValueError(f"the draft vocabulary misses the EOS token(s) {missing}; add them (or choose a larger N)")

