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

Drafting is one drafter call per request (not batched across requests): its cost is measured and reported apart.
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
CONFIDENCE_DRAFTERS = "DSpark (drafters.dflash.BlockDrafter on a checkpoint with a confidence head, threshold=None)"


# =========================================================================== SPS(B): the target's step curve


@dataclass
class StepCurve:
    """Seconds of one target forward over B packed tokens, profiled once; non-decreasing in B (a dip is timing
    noise: a forward over more tokens is not faster), piecewise-linear between the measured sizes, proportional
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
    rejected draft token or a finished request). Each request keeps its own position count."""

    def __init__(self, target):
        from .decoding import new_cache

        self.cache = new_cache(target)
        self.owner = torch.zeros(0, dtype=torch.long)
        self.dtype, self.device = target.dtype, target.device

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
    verify_s: float
    prefill_s: float  # joins of this step


@dataclass
class ServeResult:
    policy: str
    concurrency: int
    requests: list[RequestResult]
    steps: list[StepRecord]
    clock: float  # server seconds (busy time; idle gaps of an arrival trace skipped)

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
                "steps": len(steps), "verified_per_step": ver / max(len(steps), 1),
                "accepted_per_step": acc / max(len(steps), 1), "acceptance": acc / ver if ver else None,
                "batch_tokens_mean": sum(s.batch_tokens for s in steps) / max(len(steps), 1),
                "draft_s": sum(s.draft_s for s in steps), "verify_s": sum(s.verify_s for s in steps),
                "prefill_s": sum(s.prefill_s for s in self.steps)}


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
    ctx = context_length(target)
    for r in requests:
        check_request(target, torch.zeros(1, len(r.prompt), dtype=torch.long), r.max_new_tokens, sampling, generator)
    eos = eos_set(eos_token_id, target)
    dev = target.device
    hidden = bool(drafter is not None and pol.drafts and drafter.needs_hidden)
    kv = PackedCache(target)
    queue = sorted(requests, key=lambda r: (r.arrival, r.rid))
    running: list[Running] = []
    results: list[RequestResult] = []
    steps: list[StepRecord] = []
    clock = 0.0
    bar = tqdm(total=len(requests), desc=f"serve {pol} c={concurrency}", disable=not progress)

    def join(req: Request) -> float:
        t0 = time.perf_counter()
        ids, pos, mask, q_owner = kv.inputs([(req.rid, req.prompt, 0)])
        out = target(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(kv.cache), use_cache=True,
                     output_hidden_states=hidden)
        kv.appended(q_owner)
        first = int(sample(probs_from(out.logits[0, -1], sampling), generator))
        state = SpecState(tokens=req.prompt + [first], prompt_len=len(req.prompt), sampling=sampling,
                          generator=generator, target=target,
                          target_hidden=drafter_hidden(out, drafter)[0] if hidden else None)
        d = None
        if drafter is not None and pol.drafts:
            d = copy.copy(drafter)
            d.begin(state)
        stats = SpecStats(rows=1)
        stats.target_forwards = 1
        sync(dev)
        dt = time.perf_counter() - t0
        running.append(Running(req, state, d, stats, [first], len(req.prompt), clock + dt))
        return dt

    while queue or running:
        # 0. joins: requests that have arrived, while there is room (skip an idle gap to the next arrival)
        if not running and queue and queue[0].arrival > clock:
            clock = queue[0].arrival
        prefill_s = 0.0
        while queue and len(running) < concurrency and queue[0].arrival <= clock + prefill_s:
            prefill_s += join(queue.pop(0))
        clock += prefill_s
        finished = [r for r in running if done(r.new, eos, r.req.max_new_tokens)]  # a first token may end it
        t0 = time.perf_counter()
        # 1. draft every running request (the full block, with its survivals)
        drafts, surv = [], []
        for r in running:
            if r in finished or not pol.drafts:
                drafts.append(None)
                surv.append(None)
                continue
            d = fit_draft(r.drafter.propose(r.state), len(r.state.tokens) - 1, ctx)
            drafts.append(d)
            surv.append(None if d.confidence is None else d.confidence.tolist())
        t1 = time.perf_counter()
        # 2. the policy: a prefix length per request
        live = [i for i, r in enumerate(running) if r not in finished]
        lengths = [len(drafts[i]) if drafts[i] is not None else 0 for i in live]
        ell = schedule(pol, [surv[i] for i in live], lengths, curve,
                       [running[i].stale for i in live]) if pol.drafts else [0] * len(live)
        # 3. ONE packed forward over every live request's [newest token] + its first l_r draft tokens
        segs, cut = [], {}
        for i, n in zip(live, ell):
            r = running[i]
            d = drafts[i].truncate_depth(n) if drafts[i] is not None else None
            cut[i] = d
            segs.append((r.req.rid, [r.state.tokens[-1]] + (d.tokens.tolist() if d is not None else []), r.pos))
        emitted_n = accepted_n = 0
        if segs:
            ids, pos, mask, q_owner = kv.inputs(segs)
            out = target(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(kv.cache), use_cache=True,
                         output_hidden_states=hidden)
            start = kv.appended(q_owner)
            hs = drafter_hidden(out, running[live[0]].drafter)[0] if hidden else None
            # 4. verify each request on its own logits; rejected slots become holes; commit
            off = 0
            for i, (_, toks, _) in zip(live, segs):
                r, d = running[i], cut[i]
                d = d if d is not None else _EMPTY
                res = accept(out.logits[0, off:off + len(toks)], d, sampling, generator)
                kv.drop(start + off + 1 + res.n_accepted, start + off + len(toks))
                if hidden:
                    r.state.target_hidden = hs[off:off + 1 + res.n_accepted]
                r.pos += 1 + res.n_accepted
                before = len(r.new)
                commit_step(r.state, r.new, r.drafter or _NO_DRAFTER, d, res, eos, r.req.max_new_tokens, r.stats)
                r.stats.target_forwards += 1
                emitted_n += len(r.new) - before
                accepted_n += res.n_accepted
                r.verified += len(d)
                r.accepted += res.n_accepted
                if record:
                    r.trace.append({"survival": surv[i], "drafted": len(drafts[i]) if drafts[i] is not None else 0,
                                    "verified": len(d), "accepted": res.n_accepted,
                                    "match": _match_length(drafts[i], res, len(d)), "emitted": len(r.new) - before})
                r.stale = surv[i]
                off += len(toks)
            sync(dev)
        t2 = time.perf_counter()
        clock += t2 - t0
        steps.append(StepRecord(clock, len(segs), sum(len(s[1]) for s in segs), sum(lengths), sum(ell), accepted_n,
                                emitted_n, t1 - t0, t2 - t1, prefill_s))
        # 5. finished requests leave; compact the cache when holes dominate it
        for r in [r for r in running if done(r.new, eos, r.req.max_new_tokens)]:
            running.remove(r)
            kv.release(r.req.rid)
            results.append(RequestResult(r.req.rid, r.new, r.req.arrival, r.first_token_at, clock,
                                         r.stats.target_forwards - 1, r.verified, r.accepted, r.trace))
            bar.update(1)
        if kv.holes > max(64, len(kv.owner) // 2):
            kv.compact()
    bar.close()
    results.sort(key=lambda x: x.rid)
    return ServeResult(str(pol), concurrency, results, steps, clock)


class _NoDrafter(Drafter):
    """The 'none' policy's stand-in: commit_step calls update(), which has nothing to roll back."""


_NO_DRAFTER = _NoDrafter()


def _empty_draft():
    from .verify import DraftTree

    return DraftTree.chain(torch.zeros(0, dtype=torch.long), None)


_EMPTY = _empty_draft()


def _match_length(full, res, verified: int) -> int | None:
    """How many tokens of the full block the target would have accepted, when this step tells: a rejection inside
    the verified prefix (= accepted), or the whole verified prefix accepted and nothing beyond it verified (unknown
    beyond: None) -- except when the whole block was verified."""
    if full is None:
        return 0
    if res.n_accepted < verified or verified == len(full):
        return res.n_accepted
    return None


def ar_reference(target, request: Request, *, eos_token_id=None) -> list[int]:
    """That request alone through plain greedy decoding (``decoding.generate``): what the loop must reproduce at T = 0."""
    from .decoding import generate

    ids = torch.tensor([request.prompt], device=target.device)
    return generate(target, ids, max_new_tokens=request.max_new_tokens, eos_token_id=eos_token_id).tokens[0]


def expected_rate(survivals: list[list[float]], ell: list[int], curve: StepCurve) -> float:
    """Theta = tau* x SPS(B) of prefix lengths ``ell``: tau* = sum_r (1 + sum_{j<=l_r} a_{r,j}), B = sum_r (1 + l_r)."""
    tau = sum(1 + sum(s[:n]) for s, n in zip(survivals, ell))
    return tau * curve.sps(sum(1 + n for n in ell))
