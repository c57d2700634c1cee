"""The block drafter's step compiled for fixed shapes: DFlash / DSpark on the compiled fast path.

Eagerly, a DSpark step on 2 CPU cores spends its time in two places: small bf16 matmuls reading weights the
target's forward has just pushed out of the caches, and the per-op overhead of some hundred small kernels. The
target's compiled forward (``fastpath._compiled``) answers both: weights frozen into the graph and prepacked once
for oneDNN, linears that read one input concatenated, calls made from C++. The drafter's step reuses exactly those
settings, as ONE graph:

    1. the newly committed positions' context K/V: hidden_norm(fc(taps)), k_proj / v_proj per draft layer, written
       into the drafter's ``GrowingKV`` at their slots (padded to ``gamma + 1`` rows; a pad row's K/V land in slots
       step 2 overwrites)
    2. the block forward over [anchor, mask x gamma], each layer's block K/V written after the context
    3. base_k = the LM-head logits over the draft vocabulary
    4. at T = 0 (``step_greedy``, a graph of its own) the greedy chain, ``BlockNet.greedy_chain``: every position's
       argmax after the Markov head and its confidence logit; the cut is applied after, as eagerly

Shapes are fixed by the context buffer's capacity (``GrowingKV`` grows in powers of two: one graph per capacity)
and attention reads the whole buffer with the slots past the block masked out. Positions arrive as rotary rows
(``BlockNet.rope``) and slot indices, tensors, so a new step never recompiles. A first step whose new context is
longer than ``gamma + 1`` rows (the prompt) appends it eagerly first. Tokens are then drawn exactly as eagerly
(``BlockDrafter._draw``): the Markov head, the confidence head and the cut are unchanged, so the drafter stays
lossless; its q is the distribution computed here (at T = 0 a pick, which carries none).

``compile=False`` runs the same fixed-shape step eagerly: what the tests compare with the plain block forward.
"""

from __future__ import annotations

import torch

from ..cache import GrowingKV


class _BufferSlot:
    """A draft layer's K/V buffers [1, nkv, cap, hd]: ``join`` writes the block's K/V at ``idx`` [Q] and returns the
    whole buffers (the caller's mask hides the slots past the block)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor):
        self.k, self.v, self.idx = k, v, idx

    def join(self, k, v):
        return self.k.index_copy_(2, self.idx, k), self.v.index_copy_(2, self.idx, v)


class CompiledBlock:
    """One net's compiled step for blocks of ``gamma`` (default the trained block), shared by every drafter of that
    net and gamma (the graphs are built on the first call at each buffer capacity). ``W`` [Vd, H]: the LM-head rows
    of the draft vocabulary."""

    def __init__(self, net, W: torch.Tensor, gamma: int | None = None, compile: bool = True):
        from ..fastpath import _compiled

        self.gamma = net.gamma if gamma is None else gamma
        self.net, self.W, self.rows = net, W, self.gamma + 1
        self.fn = _compiled(self.step) if compile else self.step
        self.fn_greedy = _compiled(self.step_greedy) if compile else self.step_greedy  # T = 0: the chain in the graph
        self.calls = 0
        self.warmup_s: dict[str, float] = {}  # "capacity[+greedy]" -> seconds of its first (compiling) call

    def _dummy(self, capacity: int, context: int):
        """The step's inputs for ``context`` committed slots in buffers of ``capacity`` (zeros): fn(*inputs)."""
        net, W, R, Q = self.net, self.W, self.rows, self.rows
        a = net.layers[0].self_attn
        dev, dt = W.device, W.dtype
        bufs = [torch.zeros(1, a.nkv, capacity, a.hd, dtype=dt, device=dev) for _ in range(2 * len(net.layers))]
        ctx_idx = torch.arange(context, context + R, device=dev)
        blk_idx = torch.arange(context, context + Q, device=dev)
        return (torch.zeros(1, R, len(net.taps) * net.hidden, dtype=dt, device=dev), *net.rope(ctx_idx[None], dt),
                ctx_idx, torch.zeros(1, Q, net.hidden, dtype=dt, device=dev), *net.rope(blk_idx[None], dt), blk_idx,
                torch.tensor(context + Q, device=dev), *bufs)

    @torch.inference_mode()
    def warm_up(self, tokens: int, greedy: bool = False, smallest: int = GrowingKV.CAPACITY) -> dict:
        """Build the graph of every buffer capacity a sequence of up to ``tokens`` tokens can meet (the powers of
        two from ``smallest``, GrowingKV's sizes; ``greedy``: the T = 0 step's), so none compiles inside a timed run
        -> {graph: seconds}."""
        need, cap = tokens + 2 * self.rows, smallest
        while True:
            self._build(cap, greedy)
            if cap >= need:
                return dict(self.warmup_s)
            cap *= 2

    def _build(self, capacity: int, greedy: bool = False) -> None:
        """The graph for buffers of ``capacity`` slots (the greedy step's with ``greedy``), built (by a call on zeros,
        timed) unless it is already."""
        import time

        key = f"{capacity}{'+greedy' if greedy else ''}"
        if key not in self.warmup_s:
            t0 = time.perf_counter()
            inputs = self._dummy(capacity, 0)
            self.fn_greedy(torch.zeros(1, dtype=torch.long, device=self.W.device), *inputs) if greedy else \
                self.fn(*inputs)
            self.warmup_s[key] = time.perf_counter() - t0

    @torch.inference_mode()
    def measure_cost(self, context: int = 256, repeats: int = 5) -> float:
        """Median seconds of one compiled step over ``context`` committed positions, its draft-vocabulary softmax
        included: the drafting cost the "auto" cut prices (as ``dflash.measure_draft_cost`` eagerly)."""
        from ..roofline import median_seconds

        cap = max(GrowingKV.CAPACITY, 1 << (context + 2 * self.rows - 1).bit_length())
        self._build(cap)
        inputs = self._dummy(cap, context)
        return median_seconds(lambda: torch.softmax(self.fn(*inputs)[1].float(), -1), repeats)

    def stats_json(self) -> dict:
        return {"compiled_calls": self.calls, "warmup_s": {k: round(v, 2) for k, v in self.warmup_s.items()},
                "warmup_total_s": round(sum(self.warmup_s.values()), 2)}

    def step(self, hid, ctx_cos, ctx_sin, ctx_idx, emb, cos, sin, blk_idx, live, *bufs):
        """hid [1, R, mH] new context states (pad rows after the real ones), ctx_cos / ctx_sin [1, R, hd] their
        rotary rows, ctx_idx [R] their slots; emb [1, Q, H] the block, cos / sin [1, Q, hd], blk_idx [Q] its slots;
        live [] the slots in use after the block; bufs: per layer k, v [1, nkv, cap, hd] (written in place)
        -> h [1, Q - 1, H] the normed block states, base [1, Q - 1, Vd] their logits."""
        net = self.net
        for i, (k, v) in enumerate(net.context_kv(net.context(hid), None, rope=(ctx_cos, ctx_sin))):
            bufs[2 * i].index_copy_(2, ctx_idx, k)
            bufs[2 * i + 1].index_copy_(2, ctx_idx, v)
        mask = (torch.arange(bufs[0].shape[2], device=hid.device) < live)[None, None, None]  # [1, 1, 1, cap]
        slots = [_BufferSlot(bufs[2 * i], bufs[2 * i + 1], blk_idx) for i in range(len(net.layers))]
        h = net.block(emb, None, slots, mask, rope=(cos, sin))[:, 1:]
        return h, h @ self.W.T

    def step_greedy(self, anchor, *inputs):
        """``step``, then the greedy chain drawn in the same graph (``BlockNet.greedy_chain``; anchor [1] the target
        id of the block's first position) -> h, base, tokens [1, g], z [1, g] (None without a confidence head)."""
        h, base = self.step(*inputs)
        return h, base, *self.net.greedy_chain(h, base, anchor)

    def __call__(self, drafter, hid: torch.Tensor, emb: torch.Tensor, anchor: torch.Tensor | None = None):
        """``drafter``'s step for a sequence whose new context states are ``hid`` [m, mH] -> (h, base), plus the
        greedy chain (tokens, z) when the block's anchor [1] is given (T = 0); the drafter's context then holds
        those m positions too."""
        net, kv, R, Q = self.net, drafter.ctx, self.rows, emb.shape[1]
        dev, dt = emb.device, emb.dtype
        if hid.shape[0] > R:  # the prompt: appended eagerly, then a step with no new rows
            drafter._extend_context_eager(hid)
            hid = hid[:0]
        m, n0 = hid.shape[0], kv.n
        kv.reserve(torch.empty(1, net.layers[0].self_attn.nkv, 0, net.layers[0].self_attn.hd, dtype=dt, device=dev),
                   len(net.layers), n0 + R + Q)
        pad = torch.zeros(1, R, hid.shape[1], dtype=dt, device=dev)
        pad[0, :m] = hid
        ctx_idx = torch.arange(n0, n0 + R, device=dev)
        ctx_cos, ctx_sin = net.rope(ctx_idx[None], dt)
        blk_idx = torch.arange(n0 + m, n0 + m + Q, device=dev)
        cos, sin = net.rope(blk_idx[None], dt)
        bufs = [t for pair in zip(kv.k, kv.v) for t in pair]
        self._build(bufs[0].shape[2], greedy=anchor is not None)  # a capacity no warm-up built compiles here
        inputs = (pad, ctx_cos, ctx_sin, ctx_idx, emb, cos, sin, blk_idx, torch.tensor(n0 + m + Q, device=dev), *bufs)
        out = self.fn(*inputs) if anchor is None else self.fn_greedy(anchor, *inputs)
        self.calls += 1
        kv.n = n0 + m  # = n - 1: the drafter's context now holds positions 0..n-2
        return out
