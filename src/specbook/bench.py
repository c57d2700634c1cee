"""The one benchmark harness: Spec-Bench-format prompts in, a markdown table + JSON out.

    python -m specbook.bench --methods ar,hf_generate --prompts eval --limit 20 \
        --max-new-tokens 128 --temperature 0 --dtype bf16 --json build/bench.json

Methods run *interleaved* (for each repeat, for each prompt, every method in a rotating order)
so that machine noise hits all of them alike; speedup is tokens/s against ``ar`` measured in
the same run. A method is a function registered with ``@method("name")``; later issues add
drafters by registering more methods, never a second harness.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .sampling import SamplingConfig


@dataclass
class RunStats:
    """What one method did on one prompt."""

    new_tokens: int
    seconds: float
    target_forwards: int | None  # None where the method does not expose it (transformers' own loops)
    # our speculative loop's own split of its decoding steps (SpecStats); None for the other methods
    draft_seconds: float | None = None  # drafter.propose, summed over steps
    verify_seconds: float | None = None  # target forward + verification + cache compaction, summed over steps
    draft_forwards: int | None = None  # the drafter's own forwards (draft model / head passes)
    steps: int | None = None  # draft-verify steps (target forwards after the prefill)


@dataclass
class BenchContext:
    model: object
    tokenizer: object
    sampling: SamplingConfig
    max_new_tokens: int
    extras: dict = field(default_factory=dict)  # lazily built per-method state (draft models, heads)


MethodFn = Callable[[BenchContext, torch.Tensor, torch.Tensor, "torch.Generator | None"], RunStats]
METHODS: dict[str, MethodFn] = {}
DESCRIPTIONS: dict[str, str] = {}


def method(name: str, description: str = ""):
    def deco(fn: MethodFn) -> MethodFn:
        METHODS[name] = fn
        DESCRIPTIONS[name] = description or (fn.__doc__ or "").strip().split("\n")[0]
        return fn

    return deco


def _timed(fn):
    t = time.perf_counter()
    r = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return r, time.perf_counter() - t


@method("ar", "our autoregressive loop (decoding.generate), the speedup baseline")
def _ar(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .decoding import generate

    res, dt = _timed(lambda: generate(ctx.model, ids, mask, max_new_tokens=ctx.max_new_tokens, sampling=ctx.sampling,
                                      generator=gen, eos_token_id=ctx.tokenizer.eos_token_id))
    return RunStats(res.stats.new_tokens, dt, res.stats.target_forwards)


def hf_generate_kwargs(ctx: BenchContext, gen) -> dict:
    """transformers generate() arguments equivalent to ``ctx.sampling`` (no other processors)."""
    s = ctx.sampling
    kw = dict(max_new_tokens=ctx.max_new_tokens, pad_token_id=ctx.tokenizer.pad_token_id,
              eos_token_id=ctx.tokenizer.eos_token_id)
    if s.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p)
    return kw


def _hf_new_tokens(out: torch.Tensor, prompt_len: int, eos: int) -> int:
    new = out[0, prompt_len:].tolist()
    return new.index(eos) + 1 if eos in new else len(new)


@method("hf_generate", "transformers model.generate() on the same model, dtype and settings")
def _hf_generate(ctx: BenchContext, ids, mask, gen) -> RunStats:
    if gen is not None:  # transformers samples from the global RNG: seed it from our generator (its only use)
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, **hf_generate_kwargs(ctx, gen)))
    n = _hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id)
    return RunStats(n, dt, n)


# ---------------------------------------------------------------- speculative methods (issue: speculative sampling)

GAMMA = 4  # draft tokens per step for sps / hf_assisted (tuned in notebook 01)
LOOKUP_K, LOOKUP_NGRAM = 10, 2  # transformers' prompt lookup defaults: 10 tokens, 2-gram match


def draft_model_for(ctx: BenchContext):
    """The committed distilled draft for the bench target (built once per run)."""
    if "draft_model" not in ctx.extras:
        from .drafters.draft_model import load_draft_model
        from .train import CKPT_DIR

        ctx.extras["draft_model"], _ = load_draft_model(ctx.model, CKPT_DIR / "draft_model")
    return ctx.extras["draft_model"]


def _spec(ctx: BenchContext, ids, drafter, gen, acceptance: str = "exact") -> RunStats:
    from .decoding import speculative_generate

    res, dt = _timed(lambda: speculative_generate(ctx.model, drafter, ids, max_new_tokens=ctx.max_new_tokens,
                                                  sampling=ctx.sampling, generator=gen, acceptance=acceptance,
                                                  eos_token_id=ctx.tokenizer.eos_token_id))
    st = res.stats
    return RunStats(st.new_tokens, dt, st.target_forwards, st.draft_time, st.verify_time, st.draft_forwards,
                    len(st.step_times))


@method("sps", "speculative sampling with the distilled draft model (data/checkpoints/draft_model), gamma=GAMMA")
def _sps(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.draft_model import DraftModelDrafter

    return _spec(ctx, ids, DraftModelDrafter(draft_model_for(ctx), gamma=ctx.extras.get("gamma", GAMMA)), gen)


DRAFT_VOCAB = 8192  # reduced draft output layer for sps_rv: the most frequent corpus response tokens


def draft_vocab_for(ctx: BenchContext):
    if "draft_vocab" not in ctx.extras:
        from .corpus import load_corpus, top_tokens

        ids, _ = top_tokens(load_corpus(), ctx.extras.get("draft_vocab_size", DRAFT_VOCAB))
        ctx.extras["draft_vocab"] = torch.as_tensor(ids, dtype=torch.long)
    return ctx.extras["draft_vocab"]


@method("sps_rv", "sps with a reduced draft output layer (the DRAFT_VOCAB most frequent corpus tokens)")
def _sps_rv(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.draft_model import DraftModelDrafter

    drafter = DraftModelDrafter(draft_model_for(ctx), gamma=ctx.extras.get("gamma", GAMMA), vocab=draft_vocab_for(ctx))
    return _spec(ctx, ids, drafter, gen)


@method("pld", "prompt lookup decoding (n-gram copy from the context), our loop")
def _pld(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.lookup import PromptLookupDrafter

    return _spec(ctx, ids, PromptLookupDrafter(k=LOOKUP_K, max_ngram=LOOKUP_NGRAM), gen)


@method("hf_assisted", "transformers assisted generation (assistant_model=) with the same draft and gamma")
def _hf_assisted(ctx: BenchContext, ids, mask, gen) -> RunStats:
    draft = draft_model_for(ctx)
    draft.generation_config.num_assistant_tokens = ctx.extras.get("gamma", GAMMA)
    draft.generation_config.num_assistant_tokens_schedule = "constant"  # same fixed gamma as ours
    draft.generation_config.assistant_confidence_threshold = 0.0  # no early exit: identical drafting policy
    if gen is not None:
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, assistant_model=draft,
                                                **hf_generate_kwargs(ctx, gen)))
    return RunStats(_hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id), dt, None)


@method("hf_lookup", "transformers prompt lookup (prompt_lookup_num_tokens=10, max_matching_ngram_size=2)")
def _hf_lookup(ctx: BenchContext, ids, mask, gen) -> RunStats:
    if gen is not None:
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=LOOKUP_K,
                                                max_matching_ngram_size=LOOKUP_NGRAM, **hf_generate_kwargs(ctx, gen)))
    return RunStats(_hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id), dt, None)


# ---------------------------------------------------------------- Medusa (issue: Medusa)

MEDUSA_NODES = "auto"  # nodes of the sparse tree; "auto": the size the target's latency curve, measured in this run,
# pays for (medusa.auto_nodes). On an AVX2 CPU (fp32) notebook 02's measured search found 4 nodes fastest; on a CPU
# with AMX (bf16) latency(k) is nearly flat to 16-32 tokens and auto picks ~15 (README).


def measure_latency(model) -> dict[int, float]:
    """The target's forward latency curve {k tokens: seconds} at a 256-token context (what "auto" trees use):
    best of 5 per k, made non-decreasing in k (a forward over more tokens is not faster; a dip is timing
    noise, and at stop 10 one such dip, 55.7 ms at 8 vs 54.7 at 16 tokens, moved the auto trees)."""
    from .roofline import profile_latency_vs_k

    return monotone_latency(profile_latency_vs_k(model, ks=(1, 2, 4, 8, 16, 32, 64), context=256, repeats=5))


def monotone_latency(latency: dict[int, float]) -> dict[int, float]:
    """The curve with every point raised to the largest latency at fewer tokens (running maximum over k)."""
    out, top = {}, 0.0
    for k in sorted(latency):
        top = max(top, latency[k])
        out[k] = top
    return out


def latency_for(ctx: BenchContext) -> dict[int, float]:
    """measure_latency, once per run."""
    if "latency" not in ctx.extras:
        ctx.extras["latency"] = measure_latency(ctx.model)
    return ctx.extras["latency"]


def medusa_for(ctx: BenchContext):
    """The committed Medusa heads, their vocabulary and the tree's choice paths (built once per run)."""
    if "medusa" not in ctx.extras:
        from .drafters.medusa import load_medusa, rank_accuracy, sized_sparse_tree
        from .train import CKPT_DIR

        heads, vocab, card = load_medusa(ctx.model, CKPT_DIR / "medusa")
        choices = ctx.extras.get("medusa_choices")
        if not choices:
            n = ctx.extras.get("medusa_nodes", MEDUSA_NODES)
            choices = sized_sparse_tree(rank_accuracy(card), n, latency_for(ctx) if n == "auto" else None)
        ctx.extras["medusa"] = (heads, vocab, choices)
    return ctx.extras["medusa"]


def _medusa_run(ctx: BenchContext, ids, gen, acceptance: str) -> RunStats:
    from .drafters.medusa import MedusaDrafter

    heads, vocab, choices = medusa_for(ctx)
    return _spec(ctx, ids, MedusaDrafter(ctx.model, heads, choices, vocab=vocab), gen, acceptance)


@method("medusa", "Medusa heads (data/checkpoints/medusa), sparse tree of MEDUSA_NODES, lossless tree verification")
def _medusa(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _medusa_run(ctx, ids, gen, "exact")


@method("medusa_typical", "Medusa with typical acceptance (LOSSY at temperature > 0; equals greedy at 0)")
def _medusa_typical(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _medusa_run(ctx, ids, gen, "typical")


# ---------------------------------------------------------------- EAGLE (issue: EAGLE-1 / EAGLE-2)

# Tree settings. depth / top_k: the best of a search on 6 eval prompts on the AMX machine (depth 6-10 x top_k 4-10,
# auto size; notebook 03's smaller search on 3 of them put depth 8 / top_k 4 ahead: at 3-6 prompts the two are
# within noise); tree sizes: "auto" = what the target's latency
# curve and the head's confidence pay for on the machine at hand, measured in the same run (an AVX2 CPU in fp32:
# latency(k) jumps from 1 to 2 tokens, small trees; AMX in bf16: nearly flat to 32 tokens, large trees).
EAGLE_NODES = "auto"  # eagle: static tree nodes (sparse tree from the head's rank accuracies), or "auto" (auto_nodes)
EAGLE_DEPTH, EAGLE_TOPK = 8, 8  # drafting depth (static and dynamic) and children per expanded node (dynamic)
EAGLE2_TOTAL = "auto"  # eagle2: nodes kept per step; "auto" = per step from the latency curve and the draft's cost


def eagle_for(ctx: BenchContext):
    """The committed EAGLE head, its vocabulary and card (+ the target's latency curve and the draft's cost per
    forward for "auto", measured once per run)."""
    if "eagle" not in ctx.extras:
        from .drafters.eagle import EagleDrafter, load_eagle
        from .train import CKPT_DIR

        head, vocab, card = load_eagle(ctx.model, CKPT_DIR / "eagle")
        s = eagle_settings(ctx)
        cost = EagleDrafter(ctx.model, head, vocab, depth=s["depth"], top_k=s["top_k"],
                            total_tokens=max(16, s["depth"])).measure_draft_cost()
        ctx.extras["eagle"] = (head, vocab, card, latency_for(ctx), cost)
    return ctx.extras["eagle"]


def eagle_settings(ctx: BenchContext) -> dict:
    """The EAGLE tree settings of this run: the module defaults, overridden through ``extras`` (notebook 03's search);
    the same dict drives the drafters and goes into the JSON."""
    return {"nodes": ctx.extras.get("eagle_nodes", EAGLE_NODES), "depth": ctx.extras.get("eagle_depth", EAGLE_DEPTH),
            "top_k": ctx.extras.get("eagle_topk", EAGLE_TOPK), "eagle2_total": ctx.extras.get("eagle2_total", EAGLE2_TOTAL)}


def eagle_static_tree(card: dict, latency: dict[int, float] | None, draft_cost: float, nodes: int | str = EAGLE_NODES,
                      depth: int = EAGLE_DEPTH, temperature: float = 0.0) -> list[tuple[int, ...]]:
    """EAGLE-1's static tree: ``nodes`` paths ``depth`` deep, or "auto" (the size ``latency`` pays for, with the
    step's draft forwards — one per depth, ``draft_cost`` seconds each — as overhead), from the head's rank
    accuracies at the run's temperature (eagle.static_accuracy)."""
    from .drafters.eagle import static_accuracy
    from .drafters.medusa import sized_sparse_tree

    return sized_sparse_tree(static_accuracy(card, depth, temperature), nodes, latency, overhead=depth * draft_cost)


def preload_eagle(model, tokenizer) -> dict:
    """``extras`` holding the loaded EAGLE head, the latency curve and the draft cost: pass it to several
    run_bench calls (notebook 03's search) so they share one load and one measurement."""
    ctx = BenchContext(model=model, tokenizer=tokenizer, sampling=SamplingConfig(), max_new_tokens=1, extras={})
    eagle_for(ctx)
    return ctx.extras


@method("eagle", "EAGLE-1 head (data/checkpoints/eagle), static tree of EAGLE_NODES, lossless tree verification")
def _eagle(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import EagleDrafter

    head, vocab, card, latency, cost = eagle_for(ctx)
    if "eagle_choices" not in ctx.extras:
        s = eagle_settings(ctx)
        ctx.extras["eagle_choices"] = eagle_static_tree(card, latency, cost, s["nodes"], s["depth"],
                                                        ctx.sampling.temperature)
    return _spec(ctx, ids, EagleDrafter(ctx.model, head, vocab, choices=ctx.extras["eagle_choices"]), gen)


def _calibration(ctx: BenchContext) -> float:
    """eagle2's confidence calibration for this run: the head's card at the run's temperature, or
    ``extras["eagle2_calibration"]`` (1.0 = the paper's confidence-as-acceptance; notebook 03 compares)."""
    from .drafters.eagle import confidence_calibration

    if "eagle2_calibration" in ctx.extras:
        return float(ctx.extras["eagle2_calibration"])
    return confidence_calibration(eagle_for(ctx)[2], ctx.sampling.temperature)


@method("eagle2", "EAGLE-2 dynamic tree (EAGLE_DEPTH, EAGLE_TOPK, EAGLE2_TOTAL nodes) on the same head, lossless")
def _eagle2(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import EagleDrafter

    head, vocab, _, latency, cost = eagle_for(ctx)
    s = eagle_settings(ctx)
    drafter = EagleDrafter(ctx.model, head, vocab, depth=s["depth"], top_k=s["top_k"], total_tokens=s["eagle2_total"],
                           latency=latency, draft_cost=cost, calibration=_calibration(ctx))
    return _spec(ctx, ids, drafter, gen)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _peak_mem_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


SPLIT = ("draft_seconds", "verify_seconds", "draft_forwards", "steps")


def step_split(a: dict) -> dict:
    """Where a speculative method's draft-verify steps spend their time, per step: ms drafting, ms verifying
    (target forward + verification + cache compaction), draft forwards. Empty for methods without our loop's
    counters (ar, transformers' loops)."""
    steps = a.get("steps")
    if not steps:
        return {}
    return {"draft_ms_per_step": round(1e3 * a["draft_seconds"] / steps, 2),
            "verify_ms_per_step": round(1e3 * a["verify_seconds"] / steps, 2),
            "draft_forwards_per_step": round(a["draft_forwards"] / steps, 2)}


def run_bench(methods: list[str], prompts: list[dict], *, model_name: str = "smollm2-135m-instruct",
              dtype: str = "fast", device: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int | None = None, repeats: int = 1, seed: int = 0,
              progress: bool = True, model=None, tokenizer=None, extras: dict | None = None) -> dict:
    """Run ``methods`` interleaved over ``prompts``; return the JSON-ready result."""
    from tqdm.auto import tqdm

    from .decoding import encode
    from .models import load_model

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {sorted(METHODS)}")
    if "ar" not in methods:
        methods = ["ar", *methods]  # speedup needs the baseline from the same run
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if model is None:
        model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ctx = BenchContext(model=model, tokenizer=tokenizer, sampling=sampling, max_new_tokens=max_new_tokens,
                       extras=dict(extras or {}))
    encoded = [encode(tokenizer, p["turns"][0], max_new_tokens=max_new_tokens,
                      max_length=int(model.config.max_position_embeddings), device=model.device) for p in prompts]
    # warm-up: one short run of every method (allocations, thread pools, lazy state)
    warm = BenchContext(model=model, tokenizer=tokenizer, sampling=sampling, max_new_tokens=8, extras=ctx.extras)
    for m in methods:
        METHODS[m](warm, *encoded[0], torch.Generator().manual_seed(seed) if not sampling.greedy else None)
    tot = defaultdict(lambda: {"new_tokens": 0, "seconds": 0.0, "target_forwards": 0, **dict.fromkeys(SPLIT, 0)})
    cat = defaultdict(lambda: {"new_tokens": 0, "seconds": 0.0, "target_forwards": 0, **dict.fromkeys(SPLIT, 0)})
    mem = {}
    bar = tqdm(total=repeats * len(prompts) * len(methods), desc="bench", disable=not progress)
    for r in range(repeats):
        for i, (p, (ids, mask)) in enumerate(zip(prompts, encoded)):
            k = (r * len(prompts) + i) % len(methods)
            for m in methods[k:] + methods[:k]:  # rotate the order so no method always runs first
                gen = None if sampling.greedy else torch.Generator().manual_seed(seed * 7919 + r * 104729 + i)
                if model.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(model.device)
                s = METHODS[m](ctx, ids, mask, gen)
                mem[m] = max(mem.get(m, 0.0), _peak_mem_mb(model.device))
                for acc in (tot[m], cat[(m, p.get("category", ""))]):
                    acc["new_tokens"] += s.new_tokens
                    acc["seconds"] += s.seconds
                    if s.target_forwards is None:
                        acc["target_forwards"] = None
                    elif acc["target_forwards"] is not None:
                        acc["target_forwards"] += s.target_forwards
                    for f in SPLIT:
                        v = getattr(s, f)
                        acc[f] = None if v is None or acc[f] is None else acc[f] + v
                bar.update(1)
    bar.close()

    def row(m, a, base):
        tps = a["new_tokens"] / a["seconds"] if a["seconds"] else 0.0
        return {"method": m, "tokens_per_s": round(tps, 2),
                "tau": round(a["new_tokens"] / max(a["target_forwards"], 1), 3) if a["target_forwards"] is not None else None,
                "speedup": round(tps / base, 3) if base else None,
                "target_forwards": a["target_forwards"], "new_tokens": a["new_tokens"],
                "seconds": round(a["seconds"], 3), **step_split(a)}

    base = tot["ar"]["new_tokens"] / tot["ar"]["seconds"]
    rows = []
    for m in methods:
        rr = row(m, tot[m], base)
        rr["peak_mem_mb"] = round(mem[m], 1)
        rows.append(rr)
    by_cat = []
    for c in sorted({c for (_, c) in cat}):
        cb = cat[("ar", c)]
        cbase = cb["new_tokens"] / cb["seconds"] if cb["seconds"] else 0
        by_cat += [{"category": c, **row(m, cat[(m, c)], cbase)} for m in methods]
    return {
        "machine": machine_info(),
        "settings": {"model": model_name, "dtype": str(model.dtype).replace("torch.", ""), "device": str(model.device),
                     "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                     "repeats": repeats, "prompts": len(prompts), "seed": seed, "methods": methods,
                     "gamma": ctx.extras.get("gamma", GAMMA),
                     **({"medusa_choices": [list(c) for c in ctx.extras["medusa"][2]]} if "medusa" in ctx.extras else {}),
                     **({"latency_s": ctx.extras["latency"]} if "latency" in ctx.extras else {}),
                     **({"eagle": {**eagle_settings(ctx), "draft_cost_s": ctx.extras["eagle"][4],
                                   "eagle2_calibration": _calibration(ctx),
                                   **({"static_choices": [list(c) for c in ctx.extras["eagle_choices"]]}
                                      if "eagle_choices" in ctx.extras else {})}}
                        if "eagle" in ctx.extras else {}),
                     "peak_mem_note": "CUDA: peak allocated per method; CPU: process max RSS (shared by all methods)"},
        "rows": rows,
        "by_category": by_cat,
    }


def markdown_table(result: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "tau", "target_forwards", "new_tokens", "peak_mem_mb",
            "draft_ms_per_step", "verify_ms_per_step"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None):
    from .prompts import load_prompts

    ap = argparse.ArgumentParser(prog="python -m specbook.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ar,hf_generate", help=f"comma list; available: {','.join(sorted(METHODS))}")
    ap.add_argument("--prompts", default="eval", help="'eval', 'train' or a Spec-Bench-format .jsonl path")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--dtype", default="fast", choices=["fast", "bf16", "fp32", "fp16", "auto"],
                    help="fast (default): bf16 on GPU and on CPUs with native bf16 (AMX/AVX512-BF16), else fp32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    prompts = load_prompts(a.prompts, limit=a.limit)
    res = run_bench(methods, prompts, model_name=a.model, dtype=a.dtype, device=a.device,
                    max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    repeats=a.repeats, seed=a.seed)
    res["settings"]["command"] = "python -m specbook.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    res["settings"]["prompts_source"] = a.prompts
    print(markdown_table(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
