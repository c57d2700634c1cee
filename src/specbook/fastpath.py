"""A static KV cache and compiled forwards for the target: decoding near the roofline.

Notebook 00 shows decoding is memory-bandwidth bound, yet an eager transformers forward on a small model carries
per-call overhead on top of the weight reads: a cache grown by concatenation, masks rebuilt every call, Python and
small kernels between the matmuls, matmul weights repacked on every call. gpt-fast's recipe removes it: a KV cache
preallocated once and written in place at explicit slots, and forwards compiled for a few fixed shapes.

    StaticKVCache     keys / values [B, Hkv, capacity, D] per layer, a committed ``length``;
                      rollback = moving the length (chains), tree compaction = copying the accepted path's
                      entries into place (``keep_positions``); the cache API the loops already use
                      (get_seq_length, crop, batch_select_indices) so cache.py and decoding.py stay as they are
    FastTarget        wraps a transformers Llama-family causal LM (its decoder layer written out from its own weights,
                      op for op as transformers runs it; nothing copied)
                      and takes the same call the loops make (input_ids, attention_mask 2D or 4D, position_ids,
                      cache, output_hidden_states, logits_to_keep). With a StaticKVCache:
                        eager (compile=False): attends over the written slots only — the reference
                        compiled: a block of n tokens is padded to the next bucket (1, 2, 4, ... 64), attends over
                        the whole capacity with a mask, and runs one torch.compile'd graph per bucket (and per
                        with / without hidden states); prefills (a prompt, or one joining a packed row) run eagerly
                      With any other cache (a DynamicCache), the call goes to the wrapped model unchanged.

The loops get a static cache from ``decoding.new_cache(model, capacity=...)`` when ``model`` is a FastTarget: plain
decoding, the batch-1 speculative loop, and the batched speculative loop, whose rejected slots are holes that grow
the cache: when the next block would not fit, ``compact_rows`` drops every row's holes (a row's kept slots move into
place, left-padded). The serving loop keeps transformers' dynamic cache.

Padding slots of a bucket write K/V past the committed length, where nothing reads them (masked) and the next
forward overwrites them. A block longer than the largest bucket runs the eager path (counted in ``stats``), a
sequence beyond the capacity is an error naming the capacity (a padded bucket that would pass the end runs eagerly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .tree import additive_mask

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # verification blocks are padded up to one of these (compiled mode): one graph
# each (~25 s to compile for SmolLM2 on 2 cores); a bf16 forward over 32 slots costs little more than over 17
SUPPORTED = ("llama",)  # the decoder layer fastpath._layer writes out (SmolLM2 is one)


class StaticKVCache:
    """Preallocated K/V for every layer: [B, Hkv, capacity, D]; positions [0, length) are committed."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        shape = (batch, kv_heads, capacity, head_dim)
        with torch.inference_mode(False):  # ordinary tensors wherever the cache is made: one kind of graph input
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.capacity = capacity
        self.length = 0

    # --- the part of transformers' Cache API the loops use (cache.py, decoding.py)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """transformers' convention: a negative ``max_length`` removes that many positions from the end."""
        n = self.length + max_length if max_length < 0 else max_length
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a static cache of {self.length} positions to {n}")
        self.length = n  # rollback = moving the length; the slots behind it are overwritten later

    def keep_positions(self, start: int, keep: torch.Tensor) -> None:
        """Keep [0, start) + ``start + keep`` (ascending offsets): the accepted path is copied into place."""
        keep = keep.to(torch.long)
        n = int(keep.numel())
        if start + n > self.capacity:
            raise ValueError(f"positions up to {start + n} do not fit a static cache of {self.capacity}")
        if n:
            idx = (start + keep).to(self.keys[0].device)
            for k, v in zip(self.keys, self.values):
                k[:, :, start:start + n] = k.index_select(2, idx)  # index_select copies first: overlap is safe
                v[:, :, start:start + n] = v.index_select(2, idx)
        self.length = start + n

    def compact_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """Drop every row's holes: keep [B, length] bool (True = a slot the row still reads). Row r's kept slots move,
        in order, to the right end of [0, L) with L = the most any row keeps (left padding before them, as a
        left-padded prompt has); positions were applied when the K/V were written, so nothing else changes.
        Returns the new 2D attention mask [B, L] (1 = a real slot)."""
        B = self.batch
        if keep.shape != (B, self.length):
            raise ValueError(f"keep must be [batch, length] = [{B}, {self.length}], got {list(keep.shape)}")
        dev, keep = keep.device, keep.cpu()
        counts = keep.sum(1).tolist()
        L = max(counts)
        idx = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for r in range(B):
            idx[r, L - counts[r]:] = keep[r].nonzero().flatten()
            mask[r, L - counts[r]:] = 1
        k0 = self.keys[0]
        g = idx.to(k0.device)[:, None, :, None].expand(B, k0.shape[1], L, k0.shape[3])  # every layer's shape
        for k, v in zip(self.keys, self.values):
            k[:, :, :L] = k.gather(2, g)  # gather copies first: overlap is safe
            v[:, :, :L] = v.gather(2, g)
        self.length = L
        return mask.to(dev)

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, the weight applied in the input dtype). Written out
    rather than called: the module's class is wrapped for kernels fetched from the hub, which a fullgraph compile
    must not trace into."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _layer(layer, h, cos, sin, mask, slots, k_cache, v_cache, width: int, grouped: bool = False):
    """One Llama decoder layer over h [B, n, H], written out from its own weights (transformers' op order: the eager
    path is bit-for-bit its forward). K/V of the n new tokens are written at ``slots`` and attention reads the first
    ``width`` cache positions under the additive ``mask`` [B, 1, n, width].

    ``grouped`` (the compiled path): grouped-query attention without copying K/V per query head — the rep query
    heads sharing a K/V head are stacked as rep * n query rows of that head. Same attention, another summation order
    (not bit-for-bit); transformers' repeat_kv instead writes and reads a [B, Hq, width, D] copy of the cache per
    layer, which over a 1k-slot cache moves more bytes than the layer's weights."""
    att = layer.self_attn
    B, n, _ = h.shape
    x = _rms(h, layer.input_layernorm)
    q = att.q_proj(x).view(B, n, -1, att.head_dim).transpose(1, 2)  # [B, Hq, n, D]
    k = att.k_proj(x).view(B, n, -1, att.head_dim).transpose(1, 2)  # [B, Hkv, n, D]
    v = att.v_proj(x).view(B, n, -1, att.head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    if grouped:  # q heads [i * rep, (i + 1) * rep) read K/V head i: rows (r, query) of head i
        qg = q.reshape(B, hkv, rep * n, att.head_dim)  # [B, Hkv, rep * n, D]
        mg = mask.repeat(1, 1, rep, 1)  # [B, 1, rep * n, width]
        o = torch.nn.functional.scaled_dot_product_attention(qg, k_cache[:, :, :width], v_cache[:, :, :width],
                                                             attn_mask=mg, dropout_p=0.0, scale=att.scaling)
        o = o.reshape(B, hkv * rep, n, att.head_dim)  # [B, Hq, n, D]
    else:
        keys = k_cache[:, :, :width].repeat_interleave(rep, dim=1)  # [B, Hq, width, D] (transformers' repeat_kv)
        vals = v_cache[:, :, :width].repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, dropout_p=0.0,
                                                             scale=att.scaling)
    h = h + att.o_proj(o.transpose(1, 2).reshape(B, n, -1))
    return h + layer.mlp(_rms(h, layer.post_attention_layernorm))


def _forward(model, input_ids, position_ids, mask, slots, keys, values, width: int, hidden: bool, keep: int,
             grouped: bool = False, head: torch.Tensor | None = None):
    """One forward over ``input_ids`` [B, n] with the wrapped model's weights. ``mask``: additive [B, 1, n, width].
    ``head``: [V', H] rows of the output layer to use instead of ``lm_head`` (a reduced vocabulary).
    Returns (logits of the last ``keep`` positions, or all when 0; hidden states or None)."""
    base = model.model
    h = base.embed_tokens(input_ids)  # [B, n, H]
    cos, sin = base.rotary_emb(h, position_ids=position_ids)  # [B, n, D]
    hs = [h] if hidden else None
    for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
        h = _layer(layer, h, cos, sin, mask, slots, keys[i], values[i], width, grouped)
        if hidden:
            hs.append(h)
    h = _rms(h, base.norm)
    if hidden:
        hs[-1] = h  # transformers' last hidden state is after the final norm
    h = h if keep == 0 else h[:, -keep:]
    logits = model.lm_head(h) if head is None else h @ head.T  # [B, n or keep, V or V']
    return logits, (tuple(hs) if hidden else None)


@dataclass
class FastOutput:
    logits: torch.Tensor
    hidden_states: tuple | None = None
    cache: object = None

    @property
    def past_key_values(self):
        return self.cache


@dataclass
class FastStats:
    compiled_calls: int = 0
    eager_calls: int = 0  # prefills, blocks above the largest bucket, compile=False
    fallbacks: int = 0  # blocks longer than the largest bucket in compiled mode
    recompiles: int = 0  # graphs built again for a bucket and capacity that had one (should stay 0)
    warmup_s: dict = field(default_factory=dict)  # "bucket[+hidden][+keepN]" -> seconds of its compiling calls
    built: set = field(default_factory=set)  # (graph key, cache capacity) pairs compiled so far

    @property
    def warmup_total_s(self) -> float:
        """Seconds spent compiling so far, all graphs."""
        return sum(self.warmup_s.values())

    def as_json(self) -> dict:
        return {"compiled_calls": self.compiled_calls, "eager_calls": self.eager_calls, "fallbacks": self.fallbacks,
                "recompiles": self.recompiles,
                "warmup_s": {k: round(v, 2) for k, v in self.warmup_s.items()},
                "warmup_total_s": round(self.warmup_total_s, 2), "capacities": sorted({w for _, w in self.built})}


def allowed_mask(n: int, past: int, width: int, batch: int, attention_mask: torch.Tensor | None,
                 rows: int | None = None) -> torch.Tensor:
    """Bool [B, 1, rows, width]: which cache slots each of the block's queries may read.

    ``attention_mask`` as the loops pass it: None (causal), 2D [B, past + n] (1 = a real slot: left padding,
    the batch loop's holes) or 4D [B, 1, n, past + n] (tree / packed masks; additive float or bool). Rows past
    ``n`` (bucket padding) and rows that could read nothing see only their own slot, so no softmax is empty.
    """
    rows = rows or n
    i = torch.arange(rows)[:, None]
    j = torch.arange(width)[None, :]
    causal = (j <= past + i) & (j < past + n)  # [rows, width]
    if attention_mask is None:
        allowed = causal[None, None].expand(batch, 1, rows, width).clone()
    elif attention_mask.dim() == 2:
        m = attention_mask.bool().cpu()
        keymask = torch.zeros(batch, width, dtype=torch.bool)
        keymask[:, :m.shape[1]] = m
        allowed = (causal[None] & keymask[:, None, :])[:, None]
    elif attention_mask.dim() == 4:
        m4 = attention_mask.cpu()
        m4 = m4 if m4.dtype == torch.bool else (m4 == 0)
        allowed = torch.zeros(batch, 1, rows, width, dtype=torch.bool)
        allowed[:, :, :n, :m4.shape[-1]] = m4[..., -n:, :]
    else:
        raise ValueError(f"attention_mask must be 2D or 4D, got {attention_mask.dim()}D")
    allowed[:, :, n:] = False  # bucket padding: no query of the block reads it, and it reads nothing real
    empty = ~allowed.any(-1)  # [B, 1, rows]
    own = torch.zeros(rows, width, dtype=torch.bool)
    own[torch.arange(rows), (past + torch.arange(rows)).clamp_max(width - 1)] = True
    return torch.where(empty[..., None], own[None, None], allowed)


class FastTarget:
    """A transformers causal LM with a static-cache forward, eager or compiled (module docstring).

    ``lm`` is the wrapped model; every other attribute read goes to it (``config``, ``device``, ``dtype``,
    ``generate``, ``model.norm``, ``lm_head``), so drafters and the bench use a FastTarget as they use the model.
    ``vocab``: [V'] token ids whose logits a static-cache forward computes (a reduced output layer, as a draft
    model uses: logits [..., V'] in that order); None = the whole vocabulary.
    """

    def __init__(self, model, *, compile: bool = True, buckets: tuple[int, ...] = BUCKETS,
                 vocab: torch.Tensor | None = None):
        mt = getattr(model.config, "model_type", None)
        if mt not in SUPPORTED:
            raise ValueError(f"the static-cache fast path supports {SUPPORTED} decoder layers, not {mt!r}; "
                             "run this model without it (compile=False in the bench: --no-compile)")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending distinct sizes >= 1, got {buckets}")
        self.lm = model
        self.compiled = bool(compile)
        self.buckets = tuple(buckets)
        self.stats = FastStats()
        self.min_capacity = 0  # reserve(): every cache of a run gets one capacity, so one set of graphs serves it
        self._fn = _compiled(_forward) if self.compiled else None
        self.vocab, self._head = None, None
        if vocab is not None:
            from .drafters import head_rows

            self._head, self.vocab = head_rows(model.get_output_embeddings().weight, vocab)
            self._head = self._head.contiguous()

    def reserve(self, capacity: int) -> None:
        """Make every later cache at least this large (the bench reserves its longest request)."""
        self.min_capacity = max(self.min_capacity, int(capacity))

    def __getattr__(self, name):
        return getattr(self.__dict__["lm"], name)

    def new_cache(self, capacity: int, batch: int = 1) -> StaticKVCache:
        """A static cache holding ``capacity`` positions (plus room for the largest bucket's padding), rounded up
        to a power of two from 256 so that requests of similar length share compiled graphs."""
        c = self.lm.config
        need = max(capacity, self.min_capacity) + (self.buckets[-1] if self.compiled else 0)
        cap = 256
        while cap < need:
            cap *= 2
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return StaticKVCache(c.num_hidden_layers, batch, c.num_key_value_heads, head_dim, cap, self.lm.dtype,
                             self.lm.device)

    @torch.inference_mode()
    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                 use_cache=True, output_hidden_states=False, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        if not isinstance(cache, StaticKVCache):
            from .models import cache_kw

            return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              **({} if cache is None else cache_kw(cache)), use_cache=use_cache,
                              output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep, **kwargs)
        if kwargs or input_ids is None or not isinstance(logits_to_keep, int):
            raise TypeError("the static-cache forward takes input_ids, attention_mask, position_ids, cache, "
                            f"output_hidden_states and an int logits_to_keep; got {sorted(kwargs) or 'other types'}")
        B, n = input_ids.shape
        past = cache.length
        if past + n > cache.capacity:
            raise ValueError(f"the static cache holds {cache.capacity} positions; this forward needs {past + n}. "
                             "Create it with a larger capacity (decoding.new_cache(model, capacity=...)).")
        if B != cache.batch:
            raise ValueError(f"input batch {B} does not match the static cache's batch {cache.batch}")
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=dev)[None].expand(B, n)
        bucket = next((b for b in self.buckets if b >= n), None) if self.compiled else None
        if bucket is not None and past + bucket > cache.capacity:
            bucket = None  # the padded bucket would run past the cache's end (a cache made elsewhere): eager
        prefill = n > 1 and (past == 0 or 0 < logits_to_keep < n)  # a prompt, or one joining a packed row
        if bucket is None or prefill:  # eager: compile=False, prefills, blocks above the buckets
            self.stats.eager_calls += 1
            self.stats.fallbacks += int(self.compiled and not prefill)
            width = past + n
            mask = additive_mask(allowed_mask(n, past, width, B, attention_mask), self.lm.dtype).to(dev)
            slots = torch.arange(past, past + n, device=dev)
            logits, hs = _forward(self.lm, input_ids, position_ids, mask, slots, cache.keys, cache.values, width,
                                  output_hidden_states, logits_to_keep, head=self._head)
        else:
            width, pad = cache.capacity, bucket - n
            mask = additive_mask(allowed_mask(n, past, width, B, attention_mask, rows=bucket), self.lm.dtype).to(dev)
            if pad:
                input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, pad)], dim=1)
                position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(B, pad)], dim=1)
            # canonical inputs: dynamo guards on strides and on inference-ness, so a caller's expanded view or a
            # tensor made outside inference mode would build a second graph (copies of a few integers)
            input_ids, position_ids = input_ids.clone(memory_format=torch.contiguous_format), \
                position_ids.to(torch.long).clone(memory_format=torch.contiguous_format)
            slots = torch.arange(past, past + bucket, device=dev)
            keep = 0 if logits_to_keep == 0 else logits_to_keep + pad
            key = f"{bucket}" + ("+hidden" if output_hidden_states else "") + (f"+keep{keep}" if keep else "")
            graphs = _graphs_built()
            t0 = time.perf_counter()
            logits, hs = self._fn(self.lm, input_ids, position_ids, mask, slots, cache.keys, cache.values, width,
                                  bool(output_hidden_states), keep, True, self._head)
            if _graphs_built() > graphs:  # this call compiled: warm-up, reported, never hidden in a figure
                self.stats.recompiles += int((key, width) in self.stats.built)
                self.stats.warmup_s[key] = self.stats.warmup_s.get(key, 0.0) + time.perf_counter() - t0
                self.stats.built.add((key, width))
            self.stats.compiled_calls += 1
            if pad:
                logits = logits[:, : logits.shape[1] - pad]
                hs = tuple(h[:, :n] for h in hs) if hs is not None else None
        cache.length = past + n
        return FastOutput(logits=logits, hidden_states=hs, cache=cache)

    def warm_up(self, capacity: int = 0, buckets: tuple[int, ...] | None = None,
                hidden: tuple[bool, ...] = (False,), progress: bool = False) -> dict:
        """Compile every bucket (with and / or without hidden states) once on a dummy cache of the capacity later
        caches will get; returns ``stats.warmup_s`` (seconds per graph)."""
        if not self.compiled:
            return {}
        from tqdm.auto import tqdm

        dev = self.lm.device
        todo = [(b, h) for h in hidden for b in (buckets or self.buckets)]
        for b, h in tqdm(todo, desc="compiling", disable=not progress):
            cache = self.new_cache(capacity)
            self(input_ids=torch.zeros((1, 2), dtype=torch.long, device=dev), cache=cache)
            self(input_ids=torch.zeros((1, b), dtype=torch.long, device=dev), cache=cache, output_hidden_states=h)
        return dict(self.stats.warmup_s)


# The inductor settings every compiled forward here shares (``_compiled``; draft_compile's "frozen" side):
# freezing: the weights become constants of the graph, prepacked once for oneDNN's linear kernels (measured here:
# a bf16 1-token forward 31 -> 26 ms; inference only: weights changed after the first call are not seen by the
# compiled graphs); linears reading one input (q/k/v, gate/up) fused into one matmul, and the graph's calls made
# from C++ instead of Python (measured here together: a bf16 1-token forward 24 -> 18 ms, compile +30%).
COMPILE_CONFIG = {"freezing": True, "cpp.enable_concat_linear": True, "cpp_wrapper": True}


def _compiled(fn):
    """``fn`` compiled for fixed shapes, one graph per bucket, with ``COMPILE_CONFIG`` (set process-wide)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    # one graph per bucket, with and without hidden states, per cache capacity: more than dynamo's
    # default of 8 recompiles of one function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for key, val in COMPILE_CONFIG.items():
        group, _, name = key.rpartition(".")
        setattr(getattr(inductor, group) if group else inductor, name, val)
    # fullgraph: a graph break would compile each decoder layer as its own frame, guarded on its weights
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _graphs_built() -> int:
    """How many graphs torch.compile has built in this process (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def fast_target(model, compile: bool = True, **kw) -> FastTarget:
    """``model`` wrapped with the static-cache fast path (a FastTarget is returned as is)."""
    return model if isinstance(model, FastTarget) else FastTarget(model, compile=compile, **kw)
