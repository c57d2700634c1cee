"""Why decoding is memory-bandwidth bound: measured peaks, a datasheet table, the roofline model.

A decode step must read every weight once (plus the KV cache) to produce B*k tokens. With
bytes = weights + KV and FLOPs ~ 2 * params * B * k, the arithmetic intensity (FLOP/byte) of
batch-1, k=1 decoding is ~1 for fp16 — far left of any accelerator's ridge point (hundreds of
FLOP/byte), so time ~ bytes / bandwidth. Verifying k tokens at once multiplies FLOPs by k but
barely changes bytes: until k*B reaches the ridge, it costs about one step.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .models import cache_kw, sync


@dataclass(frozen=True)
class Accelerator:
    name: str
    bandwidth_gbs: float  # memory bandwidth, GB/s
    tflops_bf16: float  # dense bf16/fp16 tensor throughput, TFLOP/s (no sparsity)
    source: str
    memory_gb: float | None = None  # on-chip memory per chip where weights must live (the SRAM machines)


# Datasheet figures (dense, no structured sparsity). Sources are the vendors' own pages/PDFs.
DATASHEET: dict[str, Accelerator] = {
    "H100 SXM": Accelerator("H100 SXM", 3350, 989, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s HBM3; "
                            "BF16 1,979 TFLOPS with sparsity -> 989 dense)"),
    "H200 SXM": Accelerator("H200 SXM", 4800, 989, "NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s HBM3e; "
                            "BF16 1,979 TFLOPS with sparsity -> 989 dense)"),
    "A100 80GB SXM": Accelerator("A100 80GB SXM", 2039, 312,
                                 "NVIDIA A100 datasheet (80GB SXM: 2,039 GB/s HBM2e; BF16 312 TFLOPS dense)"),
    "L4": Accelerator("L4", 300, 121, "NVIDIA L4 datasheet (300 GB/s GDDR6; BF16 242 TFLOPS with sparsity -> 121 dense)"),
    "RTX 4090": Accelerator("RTX 4090", 1008, 165.2, "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 "
                            "(1,008 GB/s GDDR6X; BF16 tensor 165.2 TFLOPS dense, FP32 accumulate)"),
}

# The other axis: machines that keep the weights in on-chip SRAM instead of HBM. One chip holds little, so a
# model is split over many chips (a pipeline); one token still streams through every chip's weights in turn,
# so the batch-1 bound is total bytes / one chip's bandwidth. Interconnect between chips is ignored.
SRAM_DATASHEET: dict[str, Accelerator] = {
    "Groq LPU": Accelerator("Groq LPU", 80_000, 188, "Groq GroqChip / GroqCard product brief (230 MB on-die SRAM, "
                            "up to 80 TB/s on-die memory bandwidth; 188 TFLOPS FP16, 750 TOPS INT8)", memory_gb=0.23),
    "Cerebras WSE-3": Accelerator("Cerebras WSE-3", 21_000_000, 125_000,
                                  "Cerebras WSE-3 / CS-3 announcement, March 2024 (44 GB on-chip SRAM, 21 PB/s memory "
                                  "bandwidth, 125 PFLOPS peak AI compute as stated: no dense figure is published, so "
                                  "this is an upper bound)", memory_gb=44),
}

# A 70B model's shape for the tables (Llama-3.1-70B's config.json), priced by decode_step_cost like our model.
LLAMA_70B = SimpleNamespace(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64,
                            num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)


# --------------------------------------------------------------------------- measurements


def median_seconds(fn, repeats: int = 5, reset=None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after one warm-up run; ``reset()`` (untimed) after each
    run puts back what ``fn`` changed (e.g. a KV cache cropped to its context). The drafters' draft cost."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if reset is not None:
            reset()
    return sorted(times[1:])[repeats // 2]


def measure_bandwidth(size_mb: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Read bandwidth in GB/s: best of ``repeats`` full reductions over a ``size_mb`` fp32 buffer.

    A sum reads every byte once and writes nothing, the same access pattern as streaming weights
    through a matrix-vector product. Use a buffer much larger than the last-level cache.
    """
    device = torch.device(device)
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32, device=device)
    x.sum()  # warm-up: page-in, thread pool
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def measure_matmul_tflops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5,
                          device: str | torch.device = "cpu") -> float:
    """Dense matmul throughput in TFLOP/s: best of ``repeats`` n x n @ n x n products (2n^3 FLOPs)."""
    device = torch.device(device)
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte read."""
        return self.flops / self.bytes


def param_counts(config) -> dict:
    """Parameters of a Llama-like decoder from its config: per-layer, embedding, LM head."""
    h, L = config.hidden_size, config.num_hidden_layers
    inter = config.intermediate_size
    nh, nkv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    hd = getattr(config, "head_dim", None) or h // nh
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    mlp = 3 * h * inter
    emb = config.vocab_size * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else emb
    return {"layers": L * (attn + mlp + 2 * h), "embedding": emb, "lm_head": head, "final_norm": h,
            "kv_per_token": 2 * L * nkv * hd}


def decode_step_cost(config, batch: int = 1, k: int = 1, context: int = 512, bytes_per_param: float = 2.0,
                     bytes_per_kv: float = 2.0) -> StepCost:
    """FLOPs and bytes of one forward over ``k`` new tokens for each of ``batch`` sequences.

    bytes: every weight once (the tied/untied LM head counted once; the embedding lookup reads only
    B*k rows) + each sequence's KV cache of ``context`` tokens. FLOPs: 2 per weight per token for the
    matmuls (LM head included) + attention scores/values (2 * 2 * context * heads * head_dim per
    token per layer).
    """
    pc = param_counts(config)
    h = config.hidden_size
    nh = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // nh
    n = batch * k
    matmul_params = pc["layers"] + config.vocab_size * h  # the LM head matmul runs even when tied
    flops = 2.0 * matmul_params * n + 4.0 * config.num_hidden_layers * (context + k) * nh * hd * n
    weight_bytes = (pc["layers"] + config.vocab_size * h + pc["final_norm"]) * bytes_per_param
    kv_bytes = batch * (context + k) * pc["kv_per_token"] * bytes_per_kv
    return StepCost(flops=flops, bytes=weight_bytes + kv_bytes)


def bound_tokens_per_s(params: float, bytes_per_param: float, bandwidth_gbs: float) -> float:
    """Upper bound on batch-1 decode speed: one full read of the weights per token."""
    return bandwidth_gbs * 1e9 / (params * bytes_per_param)


def chips_needed(params: float, bytes_per_param: float, acc: Accelerator) -> int:
    """Chips whose on-chip memory holds the weights (1 for an HBM device: ``memory_gb`` unset)."""
    return 1 if acc.memory_gb is None else math.ceil(params * bytes_per_param / (acc.memory_gb * 1e9))


def roofline_latency(config, acc: Accelerator, ks=(1, 2, 4, 8, 16, 32, 64), context: int = 512,
                     bytes_per_param: float = 2.0) -> dict[int, float]:
    """The roofline's price of one forward over k tokens, {k: seconds} = max(bytes / bandwidth, FLOPs / peak):
    flat while k is left of the ridge point (verification almost free), linear in k right of it. The same
    shape ``speedup_with_latency`` takes from a measured curve."""
    out = {}
    for k in ks:
        c = decode_step_cost(config, k=int(k), context=context, bytes_per_param=bytes_per_param,
                             bytes_per_kv=bytes_per_param)
        out[int(k)] = max(c.bytes / (acc.bandwidth_gbs * 1e9), c.flops / (acc.tflops_bf16 * 1e12))
    return out


def attainable_tflops(intensity: float, bandwidth_gbs: float, peak_tflops: float) -> float:
    """The roofline: min(peak compute, intensity * bandwidth)."""
    return min(peak_tflops, intensity * bandwidth_gbs / 1e3)


def ridge_point(bandwidth_gbs: float, peak_tflops: float) -> float:
    """Intensity (FLOP/byte) at which a kernel stops being bandwidth bound."""
    return peak_tflops * 1e3 / bandwidth_gbs


# --------------------------------------------------------------------------- latency(k)


@torch.inference_mode()
def profile_latency_vs_k(model, ks=(1, 2, 4, 8, 16, 32, 64, 128, 256), context: int = 256, repeats: int = 3,
                         batch: int = 1, generator: torch.Generator | None = None, progress: bool = False) -> dict:
    """Forward latency (s, best of ``repeats``) of ``k`` new tokens on top of a ``context``-token cache.

    The cache is prefilled once and cropped back to ``context`` after every timed forward, so each
    measurement sees exactly the same state. The repeats run in rounds over every k (one warm-up round
    first), not k after k: a slow spell of the machine then touches one sample of each k instead of every
    sample of one k, which would bend the curve the "auto" tree sizes read. Returns {k: seconds}.
    """
    from tqdm.auto import tqdm

    from .cache import crop_to
    from .decoding import new_cache

    dev = model.device
    V = model.config.vocab_size
    g = generator or torch.Generator().manual_seed(0)
    ctx_ids = torch.randint(V, (batch, context), generator=g).to(dev)
    cache = new_cache(model, capacity=context + max(ks), batch=batch)
    model(input_ids=ctx_ids, **cache_kw(cache), use_cache=True, logits_to_keep=1)
    inputs = {int(k): (torch.randint(V, (batch, k), generator=g).to(dev),
                       torch.arange(context, context + k, device=dev)[None].expand(batch, k)) for k in ks}
    out = {k: float("inf") for k in inputs}
    bar = tqdm(total=(repeats + 1) * len(inputs), desc="latency(k)", disable=not progress)
    for r in range(repeats + 1):  # round 0 is a warm-up
        for k, (ids, pos) in inputs.items():
            sync(dev)
            t = time.perf_counter()
            model(input_ids=ids, position_ids=pos, **cache_kw(cache), use_cache=True)
            sync(dev)
            if r:
                out[k] = min(out[k], time.perf_counter() - t)
            crop_to(cache, context)
            bar.update()
    bar.close()
    return out


# --------------------------------------------------------------------------- speculative speedup


# --- tree sizing from the measured latency curve (Medusa / EAGLE 'auto' trees)


def monotone_latency(latency: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in k by lowering each point to the smallest latency at as many or more tokens
    (a suffix minimum). Lowering, not raising: a forward over k tokens can always be padded to k' > k, so
    latency(k) <= latency(k') is achievable; and timing noise only ever adds time, so of two points out of order
    the higher one is the noisy one. A running maximum would instead carry one slow measurement at a small k
    into every larger k."""
    out, low = {}, math.inf
    for k in sorted(latency, reverse=True):
        low = min(low, latency[k])
        out[k] = low
    return dict(sorted(out.items()))


def interp_latency(latency: dict[int, float], n: float) -> float:
    """Seconds for a target forward over n tokens: piecewise-linear in the measured curve {k: seconds},
    constant below its first point, proportional to n beyond its last."""
    ks = sorted(latency)
    if n <= ks[0]:
        return latency[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if n <= b:
            return latency[a] + (latency[b] - latency[a]) * (n - a) / (b - a)
    return latency[ks[-1]] * n / ks[-1]


def latency_table(latency: dict[int, float], n_max: int) -> tuple[float, ...]:
    """(interp_latency(latency, n) for n = 0..n_max), computed once per curve and size: the tree-size rules below
    read it for every candidate size, several times per decoding step."""
    return _latency_table(tuple(sorted(latency.items())), n_max)


@functools.lru_cache(maxsize=64)
def _latency_table(items: tuple[tuple[int, float], ...], n_max: int) -> tuple[float, ...]:
    curve = dict(items)
    return tuple(interp_latency(curve, n) for n in range(n_max + 1))


def step_rates(values: list[float], latency: dict[int, float], max_nodes: int, overhead: float = 0.0) -> list[float]:
    """Expected tokens per second of a step keeping the k most confident nodes, for k = 1..max_nodes:
    (1 + sum of the k largest ``values``) / (overhead + latency(k + 1)). ``values`` = path confidences
    (an estimate of each node's acceptance probability), sorted descending; ``overhead`` = seconds the
    step spends besides the target forward (drafting)."""
    rates, acc = [], 1.0
    lat = latency_table(latency, max_nodes + 1)
    for k, v in enumerate(values[:max_nodes], start=1):
        acc += v
        rates.append(acc / (overhead + lat[k + 1]))
    return rates


def auto_size(values: list[float], latency: dict[int, float], max_nodes: int, overhead: float = 0.0) -> int:
    """k maximising step_rates (expected tokens per second), i.e. the tree size this machine pays for."""
    rates = step_rates(values, latency, max_nodes, overhead)
    return 1 + max(range(len(rates)), key=lambda i: (rates[i], -i)) if rates else 1


def nodes_to_add(held: list[float], candidates: list[float], latency: dict[int, float], max_nodes: int,
                 overhead: float = 0.0) -> int:
    """How many of ``candidates`` (values, best first) a tree already holding nodes worth ``held`` should add:
    the m in 0..len(candidates) maximising (1 + sum(held) + the m best) / (overhead + latency(len(held) + m + 1)),
    the tree never above ``max_nodes``. auto_size's rule for a tree grown depth by depth, where the nodes already
    drawn stay (a sampled tree cannot drop a node by what it turned out to be)."""
    acc = 1.0 + sum(held)
    n = len(held)
    lat = latency_table(latency, max(max_nodes, n) + 1)
    best, best_rate = 0, acc / (overhead + lat[n + 1])
    for m, v in enumerate(candidates[:max(0, max_nodes - n)], start=1):
        acc += v
        rate = acc / (overhead + lat[n + m + 1])
        if rate > best_rate:
            best, best_rate = m, rate
    return best


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al. eq. (1): E[tokens per target forward] = (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: walltime improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma*c + 1)).

    c = T_draft / T_target (cost of one draft step relative to one target step). Assumes verifying
    gamma+1 tokens costs one target step — notebook 00's latency(k) measurement checks that.
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + 1)


def speedup_with_latency(alpha: float, gamma: int, c: float, latency: dict[int, float]) -> float:
    """Leviathan's walltime improvement with the verification forward priced by a measured latency curve
    {k: seconds} instead of one target step: E[tokens] / (gamma * c + latency(gamma + 1) / latency(1)).
    A flat curve gives ``expected_speedup`` exactly."""
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    verify = interp_latency(latency, gamma + 1) / interp_latency(latency, 1)
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + verify)


def optimal_gamma(alpha: float, c: float, latency: dict[int, float] | None = None, max_gamma: int = 32) -> int:
    """The gamma in 1..max_gamma with the largest expected speedup (Leviathan's Fig. 3 when ``latency`` is None:
    verification costs one target step; else priced by the measured curve)."""
    f = (lambda g: expected_speedup(alpha, g, c)) if latency is None else \
        (lambda g: speedup_with_latency(alpha, g, c, latency))
    return max(range(1, max_gamma + 1), key=lambda g: (f(g), -g))


# --------------------------------------------------------------------------- plots


def plot_roofline(ax, bandwidth_gbs: float, peak_tflops: float, points: dict | None = None, label: str = "",
                  color=None, imin: float = 0.05, imax: float = 1e4):
    """Draw one roofline on a log-log axis; ``points`` = {name: (intensity, achieved TFLOP/s)}."""
    import numpy as np

    xs = np.logspace(np.log10(imin), np.log10(imax), 200)
    ys = [attainable_tflops(x, bandwidth_gbs, peak_tflops) for x in xs]
    (line,) = ax.loglog(xs, ys, label=label or f"{bandwidth_gbs:.0f} GB/s, {peak_tflops:.3g} TFLOP/s", color=color)
    for name, (x, y) in (points or {}).items():
        ax.scatter([x], [y], color=line.get_color(), zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    return ax
