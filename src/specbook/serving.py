"""Serving many requests at once: continuous batching, ONE packed target forward per step, and the policies that
decide how many draft tokens of each request that forward verifies.

    requests arrive (a seeded trace) -> join the running batch (their prefill: one forward each)
    every step:  1. each active request's drafter proposes its block (with per-position survival a_{r,j})
                 2. the policy picks a prefix length l_r per request (none / fixed k / static threshold /
                    DSpark's Algorithm 1 / vLLM's adaptive budget)
                 3. ONE target forward over every request's [newest token] + l_r draft tokens, packed into one row
                    (B = sum_r (1 + l_r) tokens; a block-diagonal causal mask keeps requests apart)
                 4. the shared verify core accepts a prefix per request; rejected slots become holes; commit
    finished requests leave (their cache slots become holes; the cache is compacted when holes dominate)

Packing all requests' tokens into one row (instead of padding rows to the longest draft) is what makes the
forward's cost a function of the total token count B, the quantity Algorithm 1 prices with SPS(B); DSpark's
engine does the same with flattened variable-length kernels (its section 5.2). Here the packed row attends through
a dense 4D mask, so the attention part of the cost grows with the total context of all requests: a simplification
of paged attention that is honest at the short contexts this module is run with.

Lossless: each request is verified by ``verify.verify`` on its own logits, and every policy here except "search"
decides l_r from quantities known before the tokens it admits were drawn (non-anticipation). "search" is Algorithm 1
without its early stop: it reads a_{r,j+1}, which depends on the drafted x_{r,j}, to decide whether x_{r,j} is
verified (DSpark's Appendix A). It exists to show that bias and is refused unless asked for by name.

The packed row is transformers' dynamic cache, or, when the target is a ``fastpath.FastTarget``, its static cache:
allocated once for the running requests (``packed_capacity``), holes compacted away when a forward would not fit,
compiled graphs built before the clock starts (``ServeResult.compile_s``; any built during the run, e.g. after the row
grew, are reported apart in ``compile_in_clock_s``). A compiled forward attends over the whole
row's capacity, so its attention cost follows the row's size rather than the live slots.

Drafting: ``Drafter.propose_batch`` over every running request (the block drafter runs ONE forward for all of
them, an EAGLE chain one catch-up and depth - 1 chain forwards); its time is measured and reported apart from the
target's. Survival sources: DSpark's calibrated confidence head, and an EAGLE chain's calibrated top-1 path
confidence (each factor known before its token is drawn).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from .decoding import (
    Drafter,
    SpecState,
    SpecStats,
    accept,
    check_request,
    commit_step,
    context_length,
    done,
    drafter_hidden,
    eos_set,
    fit_draft,
)
from .models import cache_kw, sync
from .sampling import SamplingConfig, probs_from, sample

POLICIES = ("none", "fixed:K", "threshold:H", "alg1", "vllm", "search")
CONFIDENCE_DRAFTERS = ("DSpark (drafters.dflash.BlockDrafter on a checkpoint with a confidence head, threshold=None) "
                       "and EAGLE chains (drafters.eagle.EagleDrafter with choices=tree.chain_choices(d): "
                       "calibrated path confidence)")
DRAFTERS = ("dspark", "eagle")  # the CLI's drafters: DSpark's block, or an EAGLE chain


# =========================================================================== SPS(B): the target's step curve


@dataclass
class StepCurve:
    """Seconds of one target forward over B packed tokens, profiled once; made non-decreasing in B by
    roofline.monotone_latency (B tokens can be padded to more), piecewise-linear between the measured sizes, proportional
    beyond the last. ``sps(B)`` = steps per second = 1 / seconds(B)."""

    seconds_by_size: dict[int, float]
    context: int = 0

    def __post_init__(self):
        if not self.seconds_by_size:
            raise ValueError("a step curve needs at least one measured size")
        from .roofline import monotone_latency

        self.seconds_by_size = monotone_latency({int(k): float(v) for k, v in self.seconds_by_size.items()})

    def seconds(self, B: float) -> float:
        from .roofline import interp_latency

        return interp_latency(self.seconds_by_size, B)

    def sps(self, B: float) -> float:
        return 1.0 / self.seconds(B)

    def to_json(self) -> dict:
        return {"context": self.context, "seconds_by_size": {str(k): v for k, v in self.seconds_by_size.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "StepCurve":
        return cls({int(k): v for k, v in d["seconds_by_size"].items()}, int(d.get("context", 0)))


DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def profile_step_curve(target, sizes=DEFAULT_SIZES, context: int = 512, repeats: int = 3,
                       progress: bool = False) -> StepCurve:
    """SPS(B) of ``target``: roofline's latency(k) measurement (k new tokens over a ``context``-token cache, best of
    ``repeats`` after a warm-up) at the packed batch sizes B = ``sizes``."""
    from .roofline import profile_latency_vs_k

    return StepCurve(profile_latency_vs_k(target, ks=sizes, context=context, repeats=repeats, progress=progress),
                     context)


# =========================================================================== policies


@dataclass(frozen=True)
class Policy:
    """How many draft tokens of each request one step verifies.

    none          plain decoding: the drafter is not called, every request verifies 0 draft tokens (B = R)
    fixed:K       the first K draft tokens of every request (K >= 1)
    threshold:H   DeepSpec's static rule: cut before the first position whose survival a_{r,j} < H
    alg1          DSpark's Algorithm 1: admit (r, j) in descending a_{r,j} while Theta = tau* x SPS(B) improves;
                  stop at the first admission that does not (the early stop keeps it lossless)
    vllm          vLLM's adaptive verification: a budget K = argmax of Theta along the same greedy path (no early
                  stop) on the previous step's survivals (1.0 for a request without one), then the K candidates of
                  this step with the highest a_{r,j}
    search        Algorithm 1 without the early stop (the global maximum along the greedy path) on this step's
                  survivals: NOT lossless (DSpark Appendix A); kept to measure that bias
    """

    kind: str
    k: int = 0
    h: float = 0.0

    @property
    def needs_confidence(self) -> bool:
        return self.kind in ("threshold", "alg1", "vllm", "search")

    @property
    def drafts(self) -> bool:
        return self.kind != "none"

    @property
    def lossless(self) -> bool:
        return self.kind != "search"

    def __str__(self) -> str:
        return {"fixed": f"fixed:{self.k}", "threshold": f"threshold:{self.h:g}"}.get(self.kind, self.kind)


def parse_policy(name: str) -> Policy:
    """'none' | 'fixed:K' | 'threshold:H' | 'alg1' | 'vllm' | 'search' -> Policy (a clear error otherwise)."""
    if not isinstance(name, str):
        raise TypeError(f"policy must be a string like 'fixed:3', got {name!r}")
    kind, _, arg = name.strip().partition(":")
    if kind in ("none", "alg1", "vllm", "search") and not arg:
        return Policy(kind)
    if kind == "fixed":
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"policy {name!r}: fixed:K needs an integer K >= 1 (e.g. fixed:3)")
        return Policy("fixed", k=k)
    if kind == "threshold":
        try:
            h = float(arg)
        except ValueError:
            h = -1.0
        if not 0.0 <= h <= 1.0:
            raise ValueError(f"policy {name!r}: threshold:H needs a survival H in [0, 1] (e.g. threshold:0.3)")
        return Policy("threshold", h=h)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def greedy_path(survivals: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every candidate (a_{r,j}, r, j) with a > 0, in admission order: descending a, ties by position j (so each
    request's admitted set stays a prefix: a_{r,j} is non-increasing in j)."""
    cand = [(a, r, j) for r, row in enumerate(survivals) for j, a in enumerate(row, 1) if a > 0]
    return sorted(cand, key=lambda t: (-t[0], t[2], t[1]))


def algorithm1(survivals: list[list[float]], curve: StepCurve, early_stop: bool = True) -> list[int]:
    """DSpark's Algorithm 1: per-request prefix lengths l_r from survivals a_{r,j} (row r: a_{r,1..gamma}).

    B = R roots, tau* = R; admit candidates in ``greedy_path`` order, B += 1 and tau* += a_{r,j} each;
    Theta = tau* x SPS(B). ``early_stop`` (the paper's rule): stop at the first admission with Theta <= the best so
    far — each decision then depends only on candidates ranked above it. Without it, the best Theta along the whole
    path is taken: a decision about x_{r,j} may then read a_{r,j+1}, computed from x_{r,j} itself (Appendix A)."""
    R = len(survivals)
    ell, best_ell = [0] * R, [0] * R
    if R == 0:
        return best_ell
    B, tau = R, float(R)
    best = tau * curve.sps(B)
    for a, r, j in greedy_path(survivals):
        ell[r], B, tau = j, B + 1, tau + a
        theta = tau * curve.sps(B)
        if theta > best:
            best, best_ell = theta, list(ell)
        elif early_stop:
            break
    return best_ell


def admission_path(survivals: list[list[float]], curve: StepCurve) -> list[dict]:
    """Algorithm 1's walk written out: one row per candidate in ``greedy_path`` order with the batch tokens B, the
    expected accepts tau* and Theta after admitting it, and whether the early-stop rule admits it (``admitted``) —
    the rows after the first non-improving one are what the full search would still look at."""
    R = len(survivals)
    B, tau, best, stopped, rows = R, float(R), R * curve.sps(R), False, []
    for a, r, j in greedy_path(survivals):
        B, tau = B + 1, tau + a
        theta = tau * curve.sps(B)
        ok = not stopped and theta > best
        stopped = stopped or not ok
        best = theta if ok else best
        rows.append({"request": r, "position": j, "a": a, "B": B, "tau": tau, "theta": theta, "admitted": ok})
    return rows


def top_budget(survivals: list[list[float]], budget: int) -> list[int]:
    """The ``budget`` candidates with the highest a_{r,j} (``greedy_path`` order) -> prefix length per request."""
    ell = [0] * len(survivals)
    for a, r, j in greedy_path(survivals)[:max(budget, 0)]:
        ell[r] = max(ell[r], j)
    return ell


def schedule(policy: Policy, survivals: list[list[float] | None], lengths: list[int], curve: StepCurve | None,
             stale: list[list[float]] | None = None) -> list[int]:
    """Prefix lengths l_r (<= lengths[r], the tokens request r drafted) for one step under ``policy``.
    ``survivals[r]``: a_{r,1..} of this step's draft (None for a drafter without confidences); ``stale``: the
    previous step's survivals, for "vllm"."""
    if policy.kind == "none":
        return [0] * len(lengths)
    if policy.kind == "fixed":
        return [min(policy.k, n) for n in lengths]
    if any(s is None for s in survivals):
        raise ValueError(f"policy {policy} needs per-token survival probabilities; the drafter reports none. "
                         f"Drafters that have them: {CONFIDENCE_DRAFTERS}")
    surv = [list(s[:n]) for s, n in zip(survivals, lengths)]
    if policy.kind == "threshold":
        from .drafters.dflash import static_cut

        return [static_cut(s, policy.h) for s in surv]
    if curve is None:
        raise ValueError(f"policy {policy} needs the target's step curve SPS(B) (serving.profile_step_curve)")
    if policy.kind in ("alg1", "search"):
        return algorithm1(surv, curve, early_stop=policy.kind == "alg1")
    # vllm: the budget from last step's survivals (a request without one: 1.0 at every drafted position)
    old = [(stale[r] if stale is not None and r < len(stale) and stale[r] is not None else [1.0] * n)
           for r, n in enumerate(lengths)]
    return [min(x, n) for x, n in zip(top_budget(surv, sum(algorithm1(old, curve, early_stop=False))), lengths)]


def first_token_distribution(p: torch.Tensor, q: torch.Tensor, admitted: list[bool]) -> torch.Tensor:
    """Exact distribution of the first emitted token when the draft token x ~ q is verified iff ``admitted[x]``,
    else the target samples from p: sum_x q(x) [admitted: min(1, p/q) at x + the rejection mass x residual; else p].
    With ``admitted`` a function of x this is DSpark Appendix A's selection bias; constant, it is p."""
    from .verify import residual

    out = torch.zeros_like(p, dtype=torch.float64)
    p64, q64 = p.double(), q.double()
    for x in range(len(p)):
        if q64[x] == 0:
            continue
        if not admitted[x]:
            out += q64[x] * p64
            continue
        acc = min(1.0, float(p64[x] / q64[x]))
        hit = torch.zeros_like(out)
        hit[x] = acc
        out += q64[x] * (hit + (1 - acc) * residual(p64, q64).double())
    return out


# =========================================================================== requests and the packed cache


@dataclass
class Request:
    """One request: prompt token ids, its budget, its arrival time (seconds on the server's clock)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0


def closed_loop(prompts: list[list[int]], max_new_tokens: int) -> list[Request]:
    """All requests queued at time 0; ``serve(concurrency=c)`` keeps c of them running (a closed loop)."""
    return [Request(i, list(p), max_new_tokens, 0.0) for i, p in enumerate(prompts)]


def poisson_trace(prompts: list[list[int]], max_new_tokens: int, rate: float, seed: int = 0) -> list[Request]:
    """Requests arriving as a Poisson process of ``rate`` per second (seeded exponential gaps), in prompt order."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0 requests per second, got {rate}")
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(len(prompts), dtype=torch.float64).exponential_(1.0, generator=g) / rate
    return [Request(i, list(p), max_new_tokens, float(t)) for i, (p, t) in enumerate(zip(prompts, gaps.cumsum(0)))]


class PackedCache:
    """Every running request's KV in ONE cache row: ``owner[s]`` = the request slot s belongs to (-1 = a hole: a
    rejected draft token or a finished request). Each request keeps its own position count.

    ``capacity``: with a ``fastpath.FastTarget``, the row is a preallocated static cache of that many slots (holes
    compacted away when a forward would not fit; grown, counted in ``grown``, when the live slots alone do not);
    None = transformers' dynamic cache."""

    def __init__(self, target, capacity: int | None = None):
        from .decoding import new_cache

        self.target = target
        self.cache = new_cache(target, capacity)
        self.owner = torch.zeros(0, dtype=torch.long)
        self.dtype, self.device = target.dtype, target.device
        self.grown = 0

    def fit(self, n: int) -> None:
        """Make room for a forward of ``n`` more slots in a static row: drop the holes, else grow (a copy)."""
        cap = getattr(self.cache, "capacity", None)
        pad = max(getattr(self.target, "buckets", (1,))) if getattr(self.target, "compiled", False) else 0
        if cap is None or len(self.owner) + n + pad <= cap:
            return
        if self.holes:
            self.compact()
        if len(self.owner) + n + pad > cap:
            old, self.cache = self.cache, self.target.new_cache(2 * (len(self.owner) + n))
            for k, v, k2, v2 in zip(old.keys, old.values, self.cache.keys, self.cache.values):
                k2[:, :, :old.length] = k[:, :, :old.length]
                v2[:, :, :old.length] = v[:, :, :old.length]
            self.cache.length = old.length
            self.grown += 1

    @property
    def holes(self) -> int:
        return int((self.owner < 0).sum())

    def inputs(self, segments: list[tuple[int, list[int], int]]):
        """segments: (request id, tokens, first position) -> input ids [1, T], position ids [1, T] and the 4D
        additive mask [1, 1, T, S + T]: a token sees its own request's cached slots and its own segment causally."""
        from .tree import additive_mask

        toks = [t for _, ts, _ in segments for t in ts]
        q_owner = torch.tensor([rid for rid, ts, _ in segments for _ in ts], dtype=torch.long)
        pos = torch.tensor([p0 + i for _, ts, p0 in segments for i in range(len(ts))], dtype=torch.long)
        S, T = len(self.owner), len(toks)
        k_owner = torch.cat([self.owner, q_owner])
        new = torch.arange(S + T)[None] - S  # index of a key inside the new block (< 0: cached)
        allowed = (k_owner[None] == q_owner[:, None]) & ((new < 0) | (new <= torch.arange(T)[:, None]))
        mask = additive_mask(allowed, self.dtype)[None, None].to(self.device)
        return torch.tensor([toks], device=self.device), pos[None].to(self.device), mask, q_owner

    def appended(self, q_owner: torch.Tensor) -> int:
        """The forward appended len(q_owner) slots; returns the offset of the first."""
        start = len(self.owner)
        self.owner = torch.cat([self.owner, q_owner])
        return start

    def drop(self, start: int, stop: int) -> None:
        self.owner[start:stop] = -1

    def release(self, rid: int) -> None:
        self.owner[self.owner == rid] = -1

    def compact(self) -> None:
        """Remove every hole from every layer (one gather; positions are unaffected: they were applied at insertion)."""
        from .cache import keep_positions

        keep = (self.owner >= 0).nonzero().flatten()
        keep_positions(self.cache, 0, keep)
        self.owner = self.owner[keep]


# =========================================================================== the serving loop


@dataclass
class Running:
    req: Request
    state: SpecState
    drafter: Drafter | None
    stats: SpecStats
    new: list[int]
    pos: int  # tokens of this request in the cache (= the position of its newest token)
    first_token_at: float
    stale: list[float] | None = None  # last step's survivals (vllm)
    verified: int = 0
    accepted: int = 0
    trace: list[dict] = field(default_factory=list)


@dataclass
class RequestResult:
    rid: int
    tokens: list[int]
    arrival: float
    first_token_at: float
    finished_at: float
    steps: int
    verified: int  # draft tokens sent to the target
    accepted: int  # of which accepted
    trace: list[dict] = field(default_factory=list)  # per step: survivals of the full block, l, accepted

    @property
    def latency(self) -> float:
        return self.finished_at - self.arrival


@dataclass
class StepRecord:
    t: float  # server clock at the end of the step
    requests: int  # R
    batch_tokens: int  # B = R + sum l_r
    drafted: int  # draft tokens proposed
    verified: int  # sum l_r
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float  # the packed forward, acceptance, commit, and a compaction of the row's holes after the step
    prefill_s: float  # joins of this step


@dataclass
class ServeResult:
    policy: str
    concurrency: int
    requests: list[RequestResult]
    steps: list[StepRecord]
    clock: float  # server seconds (busy time; idle gaps of an arrival trace skipped)
    compile_s: float = 0.0  # a compiled FastTarget's graph builds before the clock started
    compile_in_clock_s: float = 0.0  # graph builds during the run (a bucket not warmed, a grown row): inside the clock
    grown: int = 0  # times a static packed row had to be reallocated larger (0 when its start capacity sufficed)
    joined_beside: int = 0  # requests already running, summed over the joins (their caches are in the prefill's row)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def throughput(self) -> float:
        """Total emitted tokens per server second (prefills included)."""
        return self.tokens / max(self.clock, 1e-9)

    def summary(self) -> dict:
        lat = sorted(r.latency for r in self.requests)
        steps = [s for s in self.steps if s.requests]
        ver, acc = sum(s.verified for s in steps), sum(s.accepted for s in steps)
        return {"policy": self.policy, "concurrency": self.concurrency, "requests": len(self.requests),
                "tokens": self.tokens, "seconds": self.clock, "throughput": self.throughput,
                "latency_mean": sum(lat) / max(len(lat), 1), "latency_p90": lat[int(0.9 * (len(lat) - 1))] if lat else 0,
                "steps": len(steps), "request_steps": sum(s.requests for s in steps),
                "verified_per_step": ver / max(len(steps), 1),
                "accepted_per_step": acc / max(len(steps), 1), "acceptance": acc / ver if ver else None,
                "batch_tokens_mean": sum(s.batch_tokens for s in steps) / max(len(steps), 1),
                "token_requests": sum(s.batch_tokens * s.requests for s in steps),  # sum over steps of B x R
                "draft_s": sum(s.draft_s for s in steps), "verify_s": sum(s.verify_s for s in steps),
                "prefill_s": sum(s.prefill_s for s in self.steps), "compile_s": self.compile_s,
                "compile_in_clock_s": self.compile_in_clock_s, "grown": self.grown, "joined_beside": self.joined_beside}


def check_drafter(policy: Policy, drafter: Drafter | None) -> None:
    """Refuse what the loop cannot serve: a drafting policy without a drafter, a confidence policy with a drafter
    that reports no survivals, a drafter that cuts its own block."""
    if not policy.drafts:
        return
    if drafter is None:
        raise ValueError(f"policy {policy} drafts: give a drafter (or use policy 'none')")
    if policy.needs_confidence and not getattr(drafter, "confidences", False):
        raise ValueError(f"policy {policy} needs per-token survival probabilities; {type(drafter).__name__} reports "
                         f"none. Drafters that have them: {CONFIDENCE_DRAFTERS}")
    if getattr(drafter, "threshold", None) is not None:
        raise ValueError("the serving policy cuts each block: build the drafter with threshold=None (full block)")
    if getattr(drafter, "chain", True) is False:
        raise ValueError(f"the serving loop verifies chains (one causal segment per request); this "
                         f"{type(drafter).__name__} drafts trees: build it with choices=tree.chain_choices(d)")


@torch.inference_mode()
def serve(target, requests: list[Request], *, policy: str | Policy = "none", drafter: Drafter | None = None,
          concurrency: int = 1, curve: StepCurve | None = None, sampling: SamplingConfig = SamplingConfig(),
          generator: torch.Generator | None = None, eos_token_id: int | list[int] | None = None,
          allow_lossy: bool = False, record: bool = False, progress: bool = False) -> ServeResult:
    """Run ``requests`` through the continuous-batching loop with at most ``concurrency`` running at once.

    ``drafter``: a prototype; each request gets a shallow copy (shared weights, its own caches). ``curve``: SPS(B)
    for "alg1" / "vllm" / "search". ``record``: keep per-request step traces (survivals of the whole block, the
    length verified, the tokens accepted) for the simulator. The clock is the sum of measured step times; an idle
    gap before the next arrival is skipped (no work is timed in it).
    """
    from tqdm.auto import tqdm

    pol = policy if isinstance(policy, Policy) else parse_policy(policy)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if pol.kind == "search" and not allow_lossy:
        raise ValueError("policy 'search' (Algorithm 1 without its early stop) is not lossless (DSpark Appendix A); "
                         "pass allow_lossy=True to run it on purpose")
    check_drafter(pol, drafter)
    if not requests:
        raise ValueError("serve() got no requests")
    for r in requests:
        check_request(target, torch.zeros(1, len(r.prompt), dtype=torch.long), r.max_new_tokens, sampling, generator)
    loop = _Loop(target, pol, drafter, curve, sampling, generator, eos_set(eos_token_id, target), record,
                 packed_capacity(target, requests, concurrency, drafter))
    compile_s = loop.warm_up(concurrency)
    queue = sorted(requests, key=lambda r: (r.arrival, r.rid))
    bar = tqdm(total=len(requests), desc=f"serve {pol} c={concurrency}", disable=not progress)
    while queue or loop.running:
        loop.step(queue, concurrency)
        bar.update(loop.leave())
    bar.close()
    loop.results.sort(key=lambda x: x.rid)
    late = loop.compiled_s() - compile_s
    return ServeResult(str(pol), concurrency, loop.results, loop.steps, loop.clock, compile_s, late, loop.kv.grown,
                       loop.joined_beside)


def packed_capacity(target, requests: list[Request], concurrency: int, drafter: Drafter | None) -> int | None:
    """The slots a static packed row starts with (a ``fastpath.FastTarget`` target; None otherwise): the
    ``concurrency`` longest requests whole, plus a draft block each. Holes are compacted away when a forward would
    not fit, so this is what the live requests need, not what a run writes."""
    from .fastpath import FastTarget

    if not isinstance(target, FastTarget):
        return None
    sizes = sorted(len(r.prompt) + r.max_new_tokens for r in requests)[-concurrency:]
    return sum(sizes) + len(sizes) * (getattr(drafter, "gamma", 0) + 2)


class _Loop:
    """The state of one ``serve`` call; ``step`` runs steps 0-4 of the module docstring, ``leave`` step 5."""

    def __init__(self, target, pol: Policy, drafter, curve, sampling, generator, eos, record: bool,
                 capacity: int | None = None):
        self.target, self.pol, self.drafter, self.curve = target, pol, drafter, curve
        self.sampling, self.generator, self.eos, self.record = sampling, generator, eos, record
        self.hidden = bool(drafter is not None and pol.drafts and drafter.needs_hidden)
        self.capacity = capacity
        self.kv = PackedCache(target, capacity)
        self._compiled0 = target.stats.warmup_total_s if capacity is not None else 0.0
        self.ctx = context_length(target)
        self.running: list[Running] = []
        self.results: list[RequestResult] = []
        self.steps: list[StepRecord] = []
        self.clock = 0.0
        self.joined_beside = 0

    def compiled_s(self) -> float:
        """Seconds this call's FastTarget has spent compiling so far (since the loop began)."""
        return self.target.stats.warmup_total_s - self._compiled0 if self.capacity is not None else 0.0

    def warm_up(self, concurrency: int) -> float:
        """A compiled FastTarget's graphs for this row's width, built before the clock starts (none once built:
        dynamo keeps them for the process): the buckets up to the one holding ``concurrency`` requests' full
        blocks. Returns the seconds spent compiling."""
        if self.capacity is None or not self.target.compiled:
            return 0.0
        most = concurrency * (1 + (getattr(self.drafter, "gamma", 0) if self.pol.drafts else 0))
        buckets = self.target.buckets
        need = tuple(b for b in buckets if b < most) + tuple(b for b in buckets if b >= most)[:1]
        self.target.warm_up(self.capacity, buckets=need, hidden=(self.hidden,))
        return self.compiled_s()

    def _forward(self, segments, **kw):
        self.kv.fit(sum(len(ts) for _, ts, _ in segments))
        ids, pos, mask, q_owner = self.kv.inputs(segments)
        out = self.target(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(self.kv.cache),
                          use_cache=True, output_hidden_states=self.hidden, **kw)
        return out, self.kv.appended(q_owner)

    def join(self, req: Request, at: float) -> float:
        """Step 0 for one request: its prefill forward, its first token, its drafter begun. ``at``: the server clock
        when its prefill starts (after the prefills joined before it in this step). Returns its seconds."""
        t0 = time.perf_counter()
        out, _ = self._forward([(req.rid, req.prompt, 0)], logits_to_keep=1)  # the prompt's last position only
        first = int(sample(probs_from(out.logits[0, -1], self.sampling), self.generator))
        state = SpecState(tokens=req.prompt + [first], prompt_len=len(req.prompt), sampling=self.sampling,
                          generator=self.generator, target=self.target,
                          target_hidden=drafter_hidden(out, self.drafter)[0] if self.hidden else None)
        d = None
        if self.drafter is not None and self.pol.drafts:
            d = copy.copy(self.drafter)
            d.begin(state)
        stats = SpecStats(rows=1)
        stats.target_forwards = 1
        sync(self.target.device)
        dt = time.perf_counter() - t0
        self.running.append(Running(req, state, d, stats, [first], len(req.prompt), at + dt))
        return dt

    def draft(self, live: list[int]) -> tuple[list, list]:
        """Step 1: every live request's full block (cut to the context) and its survivals."""
        drafts, surv = [None] * len(self.running), [None] * len(self.running)
        if live and self.pol.drafts:
            rs = [self.running[i] for i in live]
            for i, d in zip(live, type(self.drafter).propose_batch([r.drafter for r in rs], [r.state for r in rs])):
                if not d.is_chain:
                    raise ValueError(f"{type(self.drafter).__name__} proposed a tree; the serving loop verifies "
                                     "chains (one causal segment per request)")
                drafts[i] = fit_draft(d, len(self.running[i].state.tokens) - 1, self.ctx)
                surv[i] = None if drafts[i].confidence is None else drafts[i].confidence.tolist()
        return drafts, surv

    def step(self, queue: list[Request], concurrency: int) -> None:
        # 0. joins: requests that have arrived, while there is room (skip an idle gap to the next arrival)
        if not self.running and queue and queue[0].arrival > self.clock:
            self.clock = queue[0].arrival
        prefill_s = 0.0
        while queue and len(self.running) < concurrency and queue[0].arrival <= self.clock + prefill_s:
            self.joined_beside += len(self.running)
            prefill_s += self.join(queue.pop(0), self.clock + prefill_s)
        self.clock += prefill_s
        live = [i for i, r in enumerate(self.running) if not done(r.new, self.eos, r.req.max_new_tokens)]
        t0 = time.perf_counter()
        # 1. draft every live request (the full block, with its survivals)
        drafts, surv = self.draft(live)
        t1 = time.perf_counter()
        # 2. the policy: a prefix length per request
        lengths = [len(drafts[i]) if drafts[i] is not None else 0 for i in live]
        ell = schedule(self.pol, [surv[i] for i in live], lengths, self.curve,
                       [self.running[i].stale for i in live]) if self.pol.drafts else [0] * len(live)
        # 3. + 4. one packed forward, each request verified on its own logits
        cut = {i: drafts[i].truncate_depth(n) if drafts[i] is not None else _EMPTY for i, n in zip(live, ell)}
        emitted, accepted, B = self.verify(live, cut, drafts, surv)
        t2 = time.perf_counter()
        self.clock += t2 - t0
        self.steps.append(StepRecord(self.clock, len(live), B, sum(lengths), sum(ell), accepted, emitted, t1 - t0,
                                     t2 - t1, prefill_s))

    def verify(self, live: list[int], cut: dict, drafts: list, surv: list) -> tuple[int, int, int]:
        """Steps 3-4: ONE packed forward over every live request's [newest token] + its cut draft; per request the
        shared verify core, rejected slots as holes, commit. Returns (emitted, accepted, batch tokens B)."""
        segs = [(self.running[i].req.rid, [self.running[i].state.tokens[-1]] + cut[i].tokens.tolist(),
                 self.running[i].pos) for i in live]
        if not segs:
            return 0, 0, 0
        out, start = self._forward(segs)
        hs = drafter_hidden(out, self.drafter)[0] if self.hidden else None
        emitted = accepted = off = 0
        for i, (_, toks, _) in zip(live, segs):
            r, d = self.running[i], cut[i]
            res = accept(out.logits[0, off:off + len(toks)], d, self.sampling, self.generator)
            self.kv.drop(start + off + 1 + res.n_accepted, start + off + len(toks))
            if self.hidden:
                r.state.target_hidden = hs[off:off + 1 + res.n_accepted]
            r.pos += 1 + res.n_accepted
            before = len(r.new)
            commit_step(r.state, r.new, r.drafter or _NO_DRAFTER, d, res, self.eos, r.req.max_new_tokens, r.stats)
            r.stats.target_forwards += 1
            emitted, accepted = emitted + len(r.new) - before, accepted + res.n_accepted
            r.verified, r.accepted = r.verified + len(d), r.accepted + res.n_accepted
            if self.record:
                r.trace.append({"survival": surv[i], "drafted": len(drafts[i]) if drafts[i] is not None else 0,
                                "verified": len(d), "accepted": res.n_accepted,
                                "match": _match_length(drafts[i], res, len(d)), "emitted": len(r.new) - before})
            r.stale = surv[i]
            off += len(toks)
        sync(self.target.device)
        return emitted, accepted, off

    def leave(self) -> int:
        """Step 5: finished requests leave (their slots become holes); the cache is compacted when holes dominate.
        Returns how many left."""
        gone = [r for r in self.running if done(r.new, self.eos, r.req.max_new_tokens)]
        for r in gone:
            self.running.remove(r)
            self.kv.release(r.req.rid)
            self.results.append(RequestResult(r.req.rid, r.new, r.req.arrival, r.first_token_at, self.clock,
                                              r.stats.target_forwards - 1, r.verified, r.accepted, r.trace))
        if self.kv.holes > max(64, len(self.kv.owner) // 2):
            t0 = time.perf_counter()
            self.kv.compact()
            sync(self.target.device)
            dt = time.perf_counter() - t0  # on the clock, as the step's cache upkeep (part of its verify time)
            self.clock += dt
            if self.steps:
                self.steps[-1].verify_s += dt
        return len(gone)


class _NoDrafter(Drafter):
    """The 'none' policy's stand-in: commit_step calls update(), which has nothing to roll back."""


_NO_DRAFTER = _NoDrafter()


def _empty_draft():
    from .verify import DraftTree

    return DraftTree.chain(torch.zeros(0, dtype=torch.long), None)


_EMPTY = _empty_draft()


def _match_length(full, res, verified: int) -> int | None:
    """How many tokens of the full drafted block the target accepts, when this step tells: the accepted count if
    it rejected a token inside the verified prefix or the whole block was verified; None (unknown) when the verified
    prefix was all accepted and the rest of the block was never verified."""
    if full is None:
        return 0
    if res.n_accepted < verified or verified == len(full):
        return res.n_accepted
    return None


def expected_rate(survivals: list[list[float]], ell: list[int], curve: StepCurve) -> float:
    """Theta = tau* x SPS(B) of prefix lengths ``ell``: tau* = sum_r (1 + sum_{j<=l_r} a_{r,j}), B = sum_r (1 + l_r)."""
    tau = sum(1 + sum(s[:n]) for s, n in zip(survivals, ell))
    return tau * curve.sps(sum(1 + n for n in ell))


# =========================================================================== trace-driven simulator


@dataclass
class SimCosts:
    """What a simulated step costs, each term fitted to a sweep's real runs (``sim_costs``):

    curve                  SPS(B) of the target (a step's forward over B tokens costs seconds(B))
    draft_s, draft_step_s  drafting: per running request per step, and per step whatever the batch (a batched
                           drafter's forwards)
    request_s, token_s     what a step costs beyond seconds(B): per running request (its verification and
                           bookkeeping), and per batch token x running request (the packed row's dense mask: every
                           token's attention spans all running requests' caches, so this part grows as B x R)
    prefill_s              one join's prefill forward, + ``prefill_running_s`` per request already running (its
                           cache is in the packed row the prefill attends over)
    """

    curve: StepCurve
    draft_s: float
    prefill_s: float
    request_s: float = 0.0
    draft_step_s: float = 0.0
    token_s: float = 0.0
    prefill_running_s: float = 0.0


def usable_traces(traces: list[list[dict]]) -> list[list[dict]]:
    """The traces a simulation can replay: non-empty, every record with a known ``match``."""
    return [t for t in traces if t and all(r.get("match") is not None for r in t)]


def simulate(traces: list[list[dict]], policy: str | Policy, concurrency: int, costs: SimCosts, *,
             requests: int | None = None, max_new_tokens: int = 32) -> dict:
    """A SIMULATION of the serving loop: ``requests`` requests (default 2 x concurrency, and at least one per usable
    trace, so that a low concurrency does not replay only the first few traces) in a closed loop, request i
    replaying acceptance trace ``traces[i % len(traces)]`` (each record: the full block's survivals and ``match`` =
    how many of its tokens the target accepted when the whole block was verified), cycling through its records.
    A step verifies l_r = the policy's prefix length and accepts min(l_r, match); it costs draft_step_s + R x draft_s
    (when the policy drafts) + seconds(B) of the step curve + R x request_s + B x R x token_s, and each join a prefill
    (prefill_s + prefill_running_s per request already running). Returns the summary fields ``serve`` reports."""
    pol = policy if isinstance(policy, Policy) else parse_policy(policy)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    usable = usable_traces(traces)
    if not usable:
        raise ValueError("no usable traces: record them from a full-block run (policy fixed:gamma, record=True)")
    n_req = requests or max(2 * concurrency, len(usable))
    queue = list(range(n_req))
    running: list[dict] = []
    tokens, steps, verified, accepted, btok = 0, 0, 0, 0, 0
    split = {"draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "request_steps": 0, "joined_beside": 0,
             "token_requests": 0}
    while queue or running:
        while queue and len(running) < concurrency:
            i = queue.pop(0)
            split["prefill_s"] += costs.prefill_s + costs.prefill_running_s * len(running)
            split["joined_beside"] += len(running)
            running.append({"trace": usable[i % len(usable)], "at": 0, "new": 1, "stale": None})
            tokens += 1
        recs = [r["trace"][r["at"] % len(r["trace"])] for r in running]
        surv = [rec["survival"] for rec in recs]
        lengths = [len(s) for s in surv]
        ell = schedule(pol, surv, lengths, costs.curve, [r["stale"] for r in running]) if pol.drafts \
            else [0] * len(running)
        B = sum(1 + n for n in ell)
        split["draft_s"] += costs.draft_step_s + len(running) * costs.draft_s if pol.drafts else 0.0
        split["verify_s"] += costs.curve.seconds(B) + len(running) * costs.request_s + B * len(running) * costs.token_s
        split["request_steps"] += len(running)
        split["token_requests"] += B * len(running)
        steps, btok = steps + 1, btok + B
        for r, rec, n in zip(running, recs, ell):
            acc = min(n, rec["match"])
            out = min(acc + 1, max_new_tokens - r["new"])
            r["new"] += out
            tokens += out
            verified += n
            accepted += acc
            r["at"] += 1
            r["stale"] = rec["survival"]
        running = [r for r in running if r["new"] < max_new_tokens]
    clock = split["draft_s"] + split["verify_s"] + split["prefill_s"]
    return {"policy": str(pol), "concurrency": concurrency, "requests": n_req, "tokens": tokens, "seconds": clock,
            "throughput": tokens / clock, "steps": steps, "batch_tokens_mean": btok / steps, **split,
            "verified_per_step": verified / steps, "accepted_per_step": accepted / steps, "simulated": True}


# =========================================================================== how far any scheduler could go


def oracle_traces(traces: list[list[dict]]) -> list[list[dict]]:
    """Each record's survivals replaced by what verification showed: 1.0 for the ``match`` tokens the target accepted,
    0.0 after. A scheduler reading them knows every token's fate before verifying it: no real one can (and it would
    not be lossless), so its throughput bounds what any policy gets from these drafts."""
    return [[{"survival": [1.0] * r["match"] + [0.0] * (len(r["survival"]) - r["match"]), "match": r["match"]}
             for r in t] for t in usable_traces(traces)]


def geometric_traces(alpha: float, gamma: int, requests: int = 64, steps: int = 64, seed: int = 0) -> list[list[dict]]:
    """Oracle traces (``oracle_traces``' form) of a hypothetical drafter whose token j is accepted with probability
    ``alpha`` given tokens 1..j-1 were (the i.i.d. acceptance model of Leviathan et al.), blocks of ``gamma``."""
    if not 0.0 <= alpha <= 1.0 or gamma < 1:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 1, got alpha={alpha!r}, gamma={gamma!r}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(requests):
        kept = (torch.rand(steps, gamma, generator=g) < alpha).int().cumprod(1).sum(1).tolist()
        out.append([{"survival": [1.0] * m + [0.0] * (gamma - m), "match": m} for m in kept])
    return out


def equivalent_alpha(traces: list[list[dict]], gamma: int) -> float:
    """The per-token acceptance alpha of the i.i.d. model whose mean accepted length over a block of ``gamma``,
    alpha (1 - alpha^gamma) / (1 - alpha), equals the traces' mean ``match`` (bisection; the model is increasing)."""
    ms = [r["match"] for t in traces for r in t if r.get("match") is not None]
    if not ms:
        raise ValueError("no record with a known match: traces come from a full-block run (fixed:gamma)")
    target = sum(ms) / len(ms)
    mean = lambda a: sum(a ** j for j in range(1, gamma + 1))  # noqa: E731  E[accepted] = sum_j alpha^j
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    return (lo + hi) / 2


def ceiling(result: dict, concurrencies=(16,), max_new_tokens=(32,), alphas=(0.6, 0.7, 0.8, 0.9, 1.0)) -> list[dict]:
    """SIMULATED: how far any scheduler could go on a sweep's machine. Per output length and concurrency, each row's
    throughput over no speculation, all simulated with the sweep's fitted costs (``sim_costs``):

    alg1                     Algorithm 1 on the recorded traces (the real policy, for reference)
    oracle                   the recorded drafts scheduled knowing each token's fate (``oracle_traces``); per step
                             the count of accepted tokens that maximises Theta along the greedy path
    oracle, alpha = a        the same for a hypothetical drafter of per-token acceptance a (``geometric_traces``,
                             the sweep's gamma)

    each oracle row with the measured drafting cost and with drafting free."""
    import dataclasses

    costs = sim_costs(result)
    free = dataclasses.replace(costs, draft_s=0.0, draft_step_s=0.0)
    gamma = result["settings"]["gamma"]
    sources = [("recorded", oracle_traces(result["traces"]))] + [
        (f"alpha = {a:g}", geometric_traces(a, gamma)) for a in alphas]
    rows = []
    for mx in max_new_tokens:
        for c in concurrencies:
            none = simulate(result["traces"], "none", c, costs, max_new_tokens=mx)["throughput"]
            real = simulate(result["traces"], "alg1", c, costs, max_new_tokens=mx)["throughput"]
            rows.append({"max_new_tokens": mx, "concurrency": c, "scheduler": "alg1", "drafts": "recorded",
                         "drafting": "measured", "over_none": real / none})
            for name, traces in sources:
                for drafting, cs in (("measured", costs), ("free", free)):
                    s = simulate(traces, "search", c, cs, max_new_tokens=mx)
                    rows.append({"max_new_tokens": mx, "concurrency": c, "scheduler": "oracle", "drafts": name,
                                 "drafting": drafting, "over_none": s["throughput"] / none})
    return rows


# =========================================================================== CLI: python -m specbook.serving


def _load(model_name: str, dtype: str, kind: str, gamma: int | None = None, temperature: float = 0.0):
    """The target and a serving drafter from the committed checkpoints: DSpark's block (``gamma`` <= its trained
    block; default the whole block) with its card's survival calibration (``card_calibration``), or an EAGLE chain
    of ``gamma`` tokens (default 5; children drawn from q at T > 0) whose survivals are its top-1 path confidence x the card's
    calibration at this temperature (``EagleDrafter._chains``). Returns
    (model, tokenizer, drafter, {"checkpoint", "corpus_sha", "steps", "calibration"})."""
    from .drafters.block_calibration import card_calibration
    from .drafters.dflash import BlockDrafter, check_gamma, load_block
    from .drafters.eagle import EagleDrafter, confidence_calibration, load_eagle
    from .models import load_model
    from .train import CKPT_DIR
    from .tree import chain_choices

    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {kind!r}")
    if gamma is not None:
        check_gamma(gamma)
    model, tok = load_model(model_name, dtype=dtype)
    if kind == "eagle":
        head, vocab, card = load_eagle(model, CKPT_DIR / "eagle")
        cal = confidence_calibration(card, temperature)
        drafter = EagleDrafter(model, head, vocab, choices=chain_choices(5 if gamma is None else gamma),
                               calibration=cal, children="noreplace")
    else:
        net, card = load_block(model, CKPT_DIR / kind, kind)
        cal = card_calibration(card)
        drafter = BlockDrafter(model, net, gamma=gamma, **cal)
    info = {"checkpoint": f"data/checkpoints/{kind}", "corpus_sha": card.get("corpus_sha"), "steps": card.get("steps"),
            "calibration": cal}
    return model, tok, drafter, info


def eval_prompt_ids(tokenizer, n: int, max_prompt: int = 256) -> list[list[int]]:
    """The first ``n`` eval prompts (chat template applied) of at most ``max_prompt`` tokens."""
    from .decoding import encode
    from .prompts import load_prompts

    out = []
    for p in load_prompts("eval"):
        ids = encode(tokenizer, p["turns"][0])[0][0].tolist()
        if len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} eval prompts have <= {max_prompt} tokens; ask for fewer requests")


FORWARDS = ("hf", "static", "compiled")  # the packed forward: transformers' cache, or a FastTarget's static row


def forward_target(model, forward: str):
    """``model`` for one serving forward mode: itself ("hf"), or wrapped in a ``fastpath.FastTarget`` ("static" =
    eager over the written slots, "compiled" = torch.compile'd per block bucket)."""
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if forward == "hf":
        return model
    from .fastpath import FastTarget

    return FastTarget(model, compile=forward == "compiled")


def run_sweep(model, tokenizer, drafter, *, concurrencies, policies, max_new_tokens: int = 32,
              temperature: float = 0.0, seed: int = 0, curve: StepCurve | None = None, progress: bool = True,
              requests_per_level: int = 2, min_requests: int = 8, forwards: tuple[str, ...] = ("hf",)) -> dict:
    """Every policy at every concurrency on the same requests (``requests_per_level`` x c of the eval prompts, at
    least ``min_requests``), policies (and ``forwards``, the packed forward's modes) interleaved per level; each
    forward schedules with its own step curve. Per-request traces (of the first forward's runs) recorded for the
    simulator, whose costs come from the first forward's rows and curve."""
    from .models import machine_info

    for c in concurrencies:
        if not isinstance(c, int) or c < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {c!r}")
    if not forwards or len(set(forwards)) != len(forwards):
        raise ValueError(f"forwards must be distinct modes of {FORWARDS}, got {forwards!r}")
    pols = [parse_policy(p) for p in policies]
    targets = {f: forward_target(model, f) for f in forwards}
    curves = {f: (curve if curve is not None and f == forwards[0] else profile_step_curve(t, progress=progress))
              for f, t in targets.items()}
    sampling = SamplingConfig(temperature=temperature)
    prompts = eval_prompt_ids(tokenizer, max(max(requests_per_level * c, min_requests) for c in concurrencies))
    rows, traces = [], []
    # warm-up: one short run of every policy (thread pools, allocations)
    for f, t in targets.items():
        for p in pols:
            serve(t, closed_loop(prompts[:2], 4), policy=p, drafter=drafter, concurrency=2, curve=curves[f],
                  sampling=sampling, generator=torch.Generator().manual_seed(seed))
    for c in concurrencies:
        reqs = closed_loop(prompts[:max(requests_per_level * c, min_requests)], max_new_tokens)
        for p in pols:
            for f, t in targets.items():
                res = serve(t, reqs, policy=p, drafter=drafter, concurrency=c, curve=curves[f], sampling=sampling,
                            generator=torch.Generator().manual_seed(seed), record=True, progress=progress)
                rows.append({**res.summary(), "forward": f})
                if f == forwards[0] and p.kind == "fixed" and p.k >= drafter.gamma:
                    traces += [[{"survival": [round(a, 4) for a in x["survival"]], "match": x["match"]}
                                for x in r.trace] for r in res.requests]
    fast = {f: t.stats.as_json() for f, t in targets.items() if f != "hf"}
    return {"machine": machine_info(),
            "settings": {"dtype": str(model.dtype).replace("torch.", ""), "max_new_tokens": max_new_tokens,
                         "temperature": temperature, "seed": seed, "concurrencies": list(concurrencies),
                         "policies": [str(p) for p in pols], "gamma": drafter.gamma,
                         "requests_per_level": requests_per_level, "min_requests": min_requests,
                         "threads": torch.get_num_threads(), "forwards": list(forwards), "fast": fast},
            "curve": curves[forwards[0]].to_json(), "curves": {f: c.to_json() for f, c in curves.items()},
            "rows": rows, "traces": traces}


def sim_rows(result: dict) -> list[dict]:
    """The rows the simulator models: the sweep's first forward (a sweep without forwards: all of them)."""
    first = result["settings"].get("forwards", [None])[0]
    return [r for r in result["rows"] if r.get("forward") == first]


def _nonneg_lstsq(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a negative one is set to 0 and the rest refitted."""
    import numpy as np

    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    free = list(range(A.shape[1]))
    coef = np.zeros(A.shape[1])
    while free:
        sol = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            coef[free] = sol
            break
        free = [f for f, v in zip(free, sol) if v > 0]
    return coef.tolist()


def _joined_beside(r: dict) -> float:
    """Requests already running, summed over a run's joins: as recorded, or for a sweep recorded without it, a closed
    loop's estimate (the first c joins find 0..c-1, each later one c - 1: it replaces a request that left)."""
    if "joined_beside" in r:
        return r["joined_beside"]
    c, n = min(r["concurrency"], r["requests"]), r["requests"]
    return c * (c - 1) / 2 + (n - c) * (c - 1)


def sim_costs(result: dict, rows: list[dict] | None = None) -> SimCosts:
    """The simulator's costs, fitted by least squares (coefficients >= 0) to a sweep's real runs (``rows``, default
    ``sim_rows(result)``): drafting seconds = draft_step_s x steps + draft_s x request steps (the drafting runs);
    prefill seconds = prefill_s x joins + prefill_running_s x requests already running at them; verification seconds
    beyond steps x seconds(mean B) = request_s x request steps + token_s x sum of B x R over the steps (for a sweep
    recorded without that sum: request steps x mean B)."""
    rows = sim_rows(result) if rows is None else rows
    curve = StepCurve.from_json(result["curve"])
    drafting = [r for r in rows if r["policy"] != "none" and r["steps"]]
    a, b = _nonneg_lstsq([[r["steps"], r["request_steps"]] for r in drafting], [r["draft_s"] for r in drafting]) \
        if drafting else (0.0, 0.0)
    p0, p1 = _nonneg_lstsq([[r["requests"], _joined_beside(r)] for r in rows], [r["prefill_s"] for r in rows])
    ran = [r for r in rows if r["steps"]]
    e_req, e_tok = _nonneg_lstsq([[r["request_steps"], r.get("token_requests", r["request_steps"] *
                                                             r["batch_tokens_mean"])] for r in ran],
                                 [r["verify_s"] - r["steps"] * curve.seconds(r["batch_tokens_mean"]) for r in ran])
    return SimCosts(curve, draft_s=b, prefill_s=p0, request_s=e_req, draft_step_s=a, token_s=e_tok,
                    prefill_running_s=p1)


def validate(result: dict) -> list[dict]:
    """The simulator against every real run of a sweep, each concurrency level held out: its runs are simulated with
    costs fitted to the OTHER levels' runs (all of them when the sweep has one level) -> (concurrency, policy, real,
    simulated, relative error)."""
    rows, out = sim_rows(result), []
    mx = result["settings"]["max_new_tokens"]
    levels = sorted({r["concurrency"] for r in rows})
    for c in levels:
        costs = sim_costs(result, [r for r in rows if r["concurrency"] != c] if len(levels) > 1 else rows)
        for r in (r for r in rows if r["concurrency"] == c):
            s = simulate(result["traces"], r["policy"], r["concurrency"], costs, requests=r["requests"],
                         max_new_tokens=mx)
            out.append({"concurrency": r["concurrency"], "policy": r["policy"], "real": r["throughput"],
                        "simulated": s["throughput"], "error": s["throughput"] / r["throughput"] - 1})
    return out


def markdown(rows: list[dict]) -> str:
    cols = ["concurrency", "policy", "forward", "throughput", "latency_mean", "batch_tokens_mean", "verified_per_step",
            "accepted_per_step", "draft_s", "verify_s", "prefill_s"]
    cols = [c for c in cols if c in rows[0]]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] +
                     ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])


def main(argv=None) -> None:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m specbook.serving",
                                 description="Serving benchmark: policies x concurrency on the target + DSpark, and "
                                             "the trace-driven simulator.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="real runs: every policy at every concurrency (JSON + markdown)")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b.add_argument("--policy", nargs="+", default=["none", "fixed:1", "fixed:3", "fixed:7", "threshold:0.3", "alg1",
                                                   "vllm"])
    b.add_argument("--model", default="smollm2-135m-instruct")
    b.add_argument("--drafter", default="dspark", choices=DRAFTERS,
                   help="DSpark's block drafter (calibrated confidence head) or an EAGLE chain (calibrated path "
                        "confidence)")
    b.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per step: DSpark's block (default: its trained block), EAGLE's chain (default 5)")
    b.add_argument("--dtype", default="fast")
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--forward", nargs="+", default=["hf"], choices=FORWARDS,
                   help="the packed forward, one or more side by side: transformers' cache (hf), a static row "
                        "eagerly (static) or compiled per block bucket (compiled); the simulator models the first")
    b.add_argument("--out", type=Path, default=None)
    s = sub.add_parser("simulate", help="replay a bench JSON's traces at other concurrencies (a simulation)")
    s.add_argument("bench_json", type=Path)
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    s.add_argument("--curve", type=Path, default=None, help="another step curve (JSON of StepCurve.to_json)")
    s.add_argument("--out", type=Path, default=None)
    o = sub.add_parser("ceiling", help="how far any scheduler could go: an oracle that knows each token's fate, "
                                       "on a bench JSON's drafts and on hypothetical drafters (a simulation)")
    o.add_argument("bench_json", type=Path)
    o.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    o.add_argument("--max-new-tokens", type=int, nargs="+", default=[32, 128, 512])
    o.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0],
                   help="per-token acceptance of the hypothetical drafters")
    o.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("profile", help="only the step curve SPS(B) of a target on this device (JSON)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="fast")
    p.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    {"profile": _cmd_profile, "bench": _cmd_bench, "simulate": _cmd_simulate, "ceiling": _cmd_ceiling}[a.cmd](a, argv)


def _cmd_profile(a, argv) -> None:
    import json

    from .models import load_model, machine_info

    model, _ = load_model(a.model, dtype=a.dtype)
    a.out.write_text(json.dumps({"machine": machine_info(), **profile_step_curve(model, progress=True).to_json()},
                                indent=1))


def _cmd_bench(a, argv) -> None:
    import json
    import sys

    model, tok, drafter, info = _load(a.model, a.dtype, a.drafter, a.gamma, a.temperature)
    res = run_sweep(model, tok, drafter, concurrencies=a.concurrency, policies=a.policy,
                    max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                    forwards=tuple(a.forward))
    res["settings"].update(model=a.model, drafter=a.drafter, drafter_checkpoint=info,
                           command="python -m specbook.serving " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(markdown(res["rows"]))  # the simulator's validation is derived from it: serving.validate(res)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


def _cmd_simulate(a, argv) -> None:
    import json

    res = json.loads(a.bench_json.read_text())
    costs = sim_costs(res)
    if a.curve:
        costs.curve = StepCurve.from_json(json.loads(a.curve.read_text()))
    rows = [simulate(res["traces"], pol, c, costs, max_new_tokens=res["settings"]["max_new_tokens"])
            for c in a.concurrency for pol in res["settings"]["policies"]]
    print(markdown(rows))
    if a.out:
        a.out.write_text(json.dumps({"note": "SIMULATED: traces replayed against a measured step curve",
                                     "source": str(a.bench_json), "validation": validate(res), "rows": rows,
                                     "costs": {k: (v.to_json() if k == "curve" else v)
                                               for k, v in vars(costs).items()}}, indent=1))


def _cmd_ceiling(a, argv) -> None:
    import json
    import sys

    res = json.loads(a.bench_json.read_text())
    rows = ceiling(res, a.concurrency, a.max_new_tokens, a.alpha)
    print(ceiling_markdown(rows))
    if a.out:
        cmd = "python -m specbook.serving " + " ".join(argv if argv is not None else sys.argv[1:])
        a.out.write_text(json.dumps({
            "note": "SIMULATED: an oracle scheduler (each token's fate known) against the sweep's fitted costs",
            "ceiling": True, "source": str(a.bench_json), "machine": res["machine"],
            "settings": {"command": cmd, "gamma": res["settings"]["gamma"], "drafter": res["settings"].get("drafter"),
                         "sweep_max_new_tokens": res["settings"]["max_new_tokens"]},
            "rows": rows}, indent=1))


def ceiling_markdown(rows: list[dict]) -> str:
    """``ceiling``'s rows as one table per output length: a row per scheduler / drafts / drafting, a column per
    concurrency (throughput over no speculation)."""
    cs = sorted({r["concurrency"] for r in rows})
    out = []
    for mx in sorted({r["max_new_tokens"] for r in rows}):
        keys = list(dict.fromkeys((r["scheduler"], r["drafts"], r["drafting"]) for r in rows
                                  if r["max_new_tokens"] == mx))
        by = {(r["scheduler"], r["drafts"], r["drafting"], r["concurrency"]): r["over_none"] for r in rows
              if r["max_new_tokens"] == mx}
        out += [f"{mx} tokens per request: throughput over no speculation (simulated)", "",
                "| scheduler | drafts | drafting | " + " | ".join(f"c = {c}" for c in cs) + " |",
                "|" + "---|" * (3 + len(cs))]
        out += ["| " + " | ".join(k) + " | " + " | ".join(f"{by[k + (c,)]:.2f}x" for c in cs) + " |" for k in keys]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
