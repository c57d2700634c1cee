"""The one benchmark harness: Spec-Bench-format prompts in, a markdown table + JSON out.

    python -m specbook.bench --methods ar,hf_generate --prompts eval --limit 20 \
        --max-new-tokens 128 --temperature 0 --dtype bf16 --json build/bench.json

Methods run *interleaved* (for each repeat, for each prompt, every method in a rotating order)
so that machine noise hits all of them alike; speedup is tokens/s against ``ar`` measured in
the same run. A method is a function registered with ``@method("name")``; a new drafter adds a
method (and, if it has knobs, a settings dataclass in ``Settings``), never a second harness.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Union

import torch

from .models import machine_info
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


Size = Union[int, Literal["auto"]]  # a tree size: a node count, or "auto" = what this run's latency curve pays for


def check_size(name: str, value, minimum: int = 1) -> None:
    """The one validation of a tree-size setting."""
    if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} or 'auto', got {value!r}")


@dataclass(frozen=True)
class SpsSettings:
    """sps / sps_rv / hf_assisted."""

    gamma: int = 4  # draft tokens per step (notebook 01's gamma sweep)
    draft_vocab: int = 8192  # sps_rv's reduced draft output layer: the most frequent corpus response tokens

    def __post_init__(self):
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be an int >= 1, got {self.draft_vocab!r}")


@dataclass(frozen=True)
class LookupSettings:
    """pld / hf_lookup: transformers' prompt lookup defaults (10 tokens, 2-gram match)."""

    k: int = 10
    ngram: int = 2


@dataclass(frozen=True)
class MedusaSettings:
    """medusa / medusa_typical. ``nodes``: the sparse tree's size; "auto" = the size this run's measured latency
    curve pays for (tree.auto_nodes). ``choices``: an explicit tree (choice paths), overriding ``nodes``."""

    nodes: Size = "auto"
    choices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        check_size("medusa nodes", self.nodes)


@dataclass(frozen=True)
class EagleSettings:
    """eagle / eagle2. depth / top_k: the best of a search on 6 eval prompts on a CPU with AMX (depth 6-10 x
    top_k 4-10, auto size). Sizes "auto": what the target's latency curve and the head's confidence pay for on
    the machine at hand, measured in the same run (an AVX2 CPU in fp32: latency(k) jumps from 1 to 2 tokens,
    small trees; AMX in bf16: nearly flat to 32 tokens, large trees).

    nodes               eagle's static tree size (sparse tree from the head's rank accuracies) or "auto"
    depth, top_k        drafting depth (both) and children per expanded node (eagle2)
    eagle2_total        eagle2's nodes kept per step, or "auto" (per step, from the latency curve and draft cost)
    eagle2_calibration  None = from the head's card at the run's temperature; 1.0 = the paper's
                        confidence-as-acceptance (notebook 03 compares)
    draft_cost          None = measured once per run; a number overrides it (0.0 = an auto mode blind to it)
    children            at T > 0: "topk" (the papers' top-k picks), "iid" or "noreplace" (children drawn from the
                        draft's q, kept with min(1, p/q); EagleRunner); eagle, eagle2 and eagle3 use it. The default
                        draws without replacement (no sibling spent on a duplicate) and must be at least as fast as
                        the top-k picks in the README's T = 1 bench, which runs the three rules side by side
                        (`eagle2[children=topk]`, `[children=iid]`, `eagle2`; tests/test_docs.py reads it); the
                        drafters' own default stays the papers' top-k rule
    """

    nodes: Size = "auto"
    depth: int = 8
    top_k: int = 8
    eagle2_total: Size = "auto"
    eagle2_calibration: float | None = None
    draft_cost: float | None = None
    children: str = "noreplace"

    def __post_init__(self):
        from .drafters.eagle.drafter import CHILD_RULES

        if self.children not in CHILD_RULES:
            raise ValueError(f"eagle children must be one of {CHILD_RULES}, got {self.children!r}")
        for name in ("depth", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"eagle {name} must be an int >= 1, got {getattr(self, name)!r}")
        check_size("eagle nodes", self.nodes)
        check_size("eagle2_total", self.eagle2_total, minimum=self.depth)


@dataclass(frozen=True)
class MtpSettings:
    """mtp: chain depth D (<= the modules trained) or "auto" = the depth the latency curve, the modules' measured
    cost and the card's held-out accuracies pay for (drafters.mtp.auto_depth)."""

    depth: Size = "auto"

    def __post_init__(self):
        check_size("mtp depth", self.depth)


BLOCK_DRAFTS = ("auto", "eager", "compiled")


@dataclass(frozen=True)
class BlockSettings:
    """dflash / dspark: ``gamma`` draft tokens per block (<= the block trained); dspark's ``threshold``: a calibrated
    survival h in [0, 1] (cut before the first position below it: DeepSpec's static rule) or "auto" = keep a
    position while it raises the expected tokens per second of this run's latency curve (drafters.dflash); dspark's
    ``calibration``: "card" = what the card says a drafter reads (its in-loop fit when it has one:
    drafters.block_calibration), "held_out" = DSpark's temperatures fitted on teacher-forced held-out blocks,
    "none" = the raw confidence head. A variant puts two side by side: ``dspark[calibration=held_out]``. ``draft``:
    how a step's block forward runs, "compiled" (drafters.block_compiled: one compiled graph per step), "eager", or
    "auto" = compiled when the target's forward is (``dspark[draft=eager]`` beside it shows what compiling buys)."""

    gamma: int = 7
    threshold: float | str = "auto"
    calibration: str = "card"
    draft: str = "auto"

    def __post_init__(self):
        from .drafters.dflash import check_gamma, check_threshold

        check_gamma(self.gamma)
        if self.threshold is None:
            raise ValueError("dspark threshold must be a number in [0, 1] or 'auto' (dflash is the full block)")
        check_threshold(self.threshold)
        from .drafters.block_calibration import SOURCES

        if self.calibration not in SOURCES:
            raise ValueError(f"dspark calibration must be one of {SOURCES}, got {self.calibration!r}")
        if self.draft not in BLOCK_DRAFTS:
            raise ValueError(f"block draft must be one of {BLOCK_DRAFTS}, got {self.draft!r}")

    def compiled(self, forward: str) -> bool:
        """Whether the block drafters' step runs compiled with a target whose forward is ``forward``."""
        return self.draft == "compiled" or (self.draft == "auto" and forward == "compiled")

    def survival_calibration(self, card: dict) -> dict:
        """The BlockDrafter keyword arguments ``temperatures`` / ``shifts`` this setting reads from ``card``."""
        from .drafters.block_calibration import card_calibration

        return card_calibration(card, self.calibration)


@dataclass(frozen=True)
class DrafterSettings:
    """Where the trained drafters are read from: "" = the committed ones (data/checkpoints), or a folder holding
    METHOD.{safetensors,json} files, e.g. drafters trained on another corpus, so that ``eagle2`` and
    ``eagle2[checkpoints=data/checkpoints/broad_corpus]`` meet in one run (a relative folder: from the working
    directory where it exists there, else from the repository root)."""

    checkpoints: str = ""

    def folder(self) -> Path:
        from .prompts import ROOT
        from .train import CKPT_DIR

        if not self.checkpoints:
            return CKPT_DIR
        f = Path(self.checkpoints)
        f = (f if f.is_absolute() or f.exists() else ROOT / f).resolve()
        if not f.is_dir():
            raise ValueError(f"checkpoints folder {self.checkpoints!r} does not exist: give a folder of "
                             "METHOD.safetensors + METHOD.json files (as python -m specbook.train --out writes)")
        return f


FORWARDS = ("compiled", "static", "hf")


@dataclass(frozen=True)
class TargetSettings:
    """How the target runs its forwards (fastpath.py): "compiled" (static KV cache + torch.compile'd buckets, the
    CLI's default), "static" (the same static cache, eager: the reference), "hf" (transformers' forward and its
    dynamic cache). ``hf_generate`` always runs transformers' own ``generate``."""

    forward: str = "hf"

    def __post_init__(self):
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {self.forward!r}")


@dataclass(frozen=True)
class Settings:
    """Every method's configuration for one bench run (recorded in the JSON)."""

    target: TargetSettings = field(default_factory=TargetSettings)
    sps: SpsSettings = field(default_factory=SpsSettings)
    lookup: LookupSettings = field(default_factory=LookupSettings)
    medusa: MedusaSettings = field(default_factory=MedusaSettings)
    eagle: EagleSettings = field(default_factory=EagleSettings)
    mtp: MtpSettings = field(default_factory=MtpSettings)
    block: BlockSettings = field(default_factory=BlockSettings)
    drafters: DrafterSettings = field(default_factory=DrafterSettings)


@dataclass
class Loaded:
    """Objects loaded or measured once and shared by runs on one target (notebooks pass one to several
    run_bench calls): the committed drafters, the reduced draft vocabulary, the target's latency curve."""

    draft_model: object = None
    draft_vocab: dict = field(default_factory=dict)  # size -> [Vd] token ids
    fast_drafts: dict = field(default_factory=dict)  # reduced vocabulary size (0 = full) -> the draft as a FastTarget
    latency: dict | None = None  # {k tokens: seconds}
    medusa: tuple | None = None  # (heads, vocab, card)
    eagle: tuple | None = None  # (head, vocab, card, measured draft cost in seconds)
    mtp: tuple | None = None  # (modules, vocab, card, measured cost of one module forward in seconds)
    eagle3: tuple | None = None  # (head, card, measured draft cost in seconds)
    dflash: tuple | None = None  # (net, card, measured cost of one block forward in seconds)
    dspark: tuple | None = None  # (net, card, measured cost of one block forward in seconds)
    compiled_blocks: dict = field(default_factory=dict)  # "dspark" (or "dspark[gamma=4]") -> (CompiledBlock, its step cost)
    toy: object = None  # a parallel_heads.ToyMTP whose ``lm`` is the run's model (self_spec)
    targets: dict = field(default_factory=dict)  # forward mode -> the target run that way ("hf": the model itself)
    latency_by: dict = field(default_factory=dict)  # forward mode -> its latency curve (variants of another mode)
    cards: dict = field(default_factory=dict)  # drafter kind -> the card of the checkpoint loaded
    siblings: dict = field(default_factory=dict)  # checkpoints folder -> the Loaded of drafters read from there

    def for_checkpoints(self, folder: str) -> "Loaded":
        """The Loaded that holds drafters read from another checkpoints folder: its own drafters, and this run's
        target, latency curves and draft vocabulary (one measurement serves both)."""
        if folder not in self.siblings:
            self.siblings[folder] = Loaded(draft_vocab=self.draft_vocab, latency=self.latency, toy=self.toy,
                                           targets=self.targets, latency_by=self.latency_by)
        return self.siblings[folder]


@dataclass
class BenchContext:
    model: object
    tokenizer: object
    sampling: SamplingConfig
    max_new_tokens: int
    settings: Settings = field(default_factory=Settings)
    loaded: Loaded = field(default_factory=Loaded)
    trees: dict = field(default_factory=dict)  # trees derived from settings + loaded objects for this run


MethodFn = Callable[[BenchContext, torch.Tensor, torch.Tensor, "torch.Generator | None"], RunStats]
METHODS: dict[str, MethodFn] = {}
DESCRIPTIONS: dict[str, str] = {}


def method(name: str, description: str = ""):
    def deco(fn: MethodFn) -> MethodFn:
        METHODS[name] = fn
        DESCRIPTIONS[name] = description or (fn.__doc__ or "").strip().split("\n")[0]
        return fn

    return deco


def checkpoint(ctx: BenchContext, kind: str) -> Path:
    """The checkpoint (path without suffix) a method of this context reads: ``settings.drafters`` folder / kind."""
    return ctx.settings.drafters.folder() / kind


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


class _hf_internal_warnings_off:
    """transformers' assisted generation calls the assistant's own generate() with a config *and* keyword
    arguments and then warns about that internal call; silence its logger for the timed call only."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)


def _hf_new_tokens(out: torch.Tensor, prompt_len: int, eos: int) -> int:
    new = out[0, prompt_len:].tolist()
    return new.index(eos) + 1 if eos in new else len(new)


@method("hf_generate", "transformers model.generate() on the same model, dtype and settings")
def _hf_generate(ctx: BenchContext, ids, mask, gen) -> RunStats:
    _seed_global_rng(gen)
    out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, **hf_generate_kwargs(ctx, gen)))
    n = _hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id)
    return RunStats(n, dt, n)


# ---------------------------------------------------------------- speculative methods


def draft_model_for(ctx: BenchContext):
    """The committed distilled draft for the bench target (loaded once)."""
    if ctx.loaded.draft_model is None:
        from .drafters.draft_model import load_draft_model

        ctx.loaded.draft_model, ctx.loaded.cards["draft_model"] = load_draft_model(ctx.model,
                                                                                  checkpoint(ctx, "draft_model"))
    return ctx.loaded.draft_model


def draft_vocab_for(ctx: BenchContext) -> torch.Tensor:
    """The ``settings.sps.draft_vocab`` most frequent corpus response tokens (loaded once per size)."""
    n = ctx.settings.sps.draft_vocab
    if n not in ctx.loaded.draft_vocab:
        from .corpus import load_corpus, top_tokens

        ids, _ = top_tokens(load_corpus(), n)
        ctx.loaded.draft_vocab[n] = torch.as_tensor(ids, dtype=torch.long)
    return ctx.loaded.draft_vocab[n]


def _spec(ctx: BenchContext, ids, drafter, gen, acceptance: str = "exact") -> RunStats:
    from .decoding import speculative_generate

    res, dt = _timed(lambda: speculative_generate(ctx.model, drafter, ids, max_new_tokens=ctx.max_new_tokens,
                                                  sampling=ctx.sampling, generator=gen, acceptance=acceptance,
                                                  eos_token_id=ctx.tokenizer.eos_token_id))
    st = res.stats
    return RunStats(st.new_tokens, dt, st.target_forwards, st.draft_time, st.verify_time, st.draft_forwards,
                    len(st.step_times))


def draft_drafter(ctx: BenchContext, reduced: bool):
    """A DraftModelDrafter on the committed draft (``reduced``: its output layer cut to the draft vocabulary). When
    the target's forward is compiled, the draft's forwards are too: a FastTarget of the draft (static cache,
    buckets up to one step's catch-up block of gamma + 1 tokens), made once per vocabulary and run, its graphs
    built in the bench's warm-up."""
    from .drafters.draft_model import DraftModelDrafter
    from .fastpath import BUCKETS, FastTarget

    gamma, vocab = ctx.settings.sps.gamma, draft_vocab_for(ctx) if reduced else None
    if ctx.settings.target.forward != "compiled":
        return DraftModelDrafter(draft_model_for(ctx), gamma=gamma, vocab=vocab)
    key = 0 if vocab is None else len(vocab)
    if key not in ctx.loaded.fast_drafts:
        top = next((b for b in BUCKETS if b >= gamma + 1), BUCKETS[-1])
        ft = FastTarget(draft_model_for(ctx), compile=True, vocab=vocab, buckets=tuple(b for b in BUCKETS if b <= top))
        ft.reserve(getattr(ctx.model, "min_capacity", 0))  # the run's capacity: one set of graphs for every request
        ctx.loaded.fast_drafts[key] = ft
    return DraftModelDrafter(ctx.loaded.fast_drafts[key], gamma=gamma)


@method("sps", "speculative sampling with the distilled draft model (data/checkpoints/draft_model), gamma draft tokens")
def _sps(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _spec(ctx, ids, draft_drafter(ctx, reduced=False), gen)


@method("sps_rv", "sps with a reduced draft output layer (the draft_vocab most frequent corpus tokens)")
def _sps_rv(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _spec(ctx, ids, draft_drafter(ctx, reduced=True), gen)


@method("pld", "prompt lookup decoding (n-gram copy from the context), our loop")
def _pld(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.lookup import PromptLookupDrafter

    s = ctx.settings.lookup
    return _spec(ctx, ids, PromptLookupDrafter(k=s.k, max_ngram=s.ngram), gen)


def _seed_global_rng(gen) -> None:
    """transformers samples from the global RNG: seed it from our generator (its only use)."""
    if gen is not None:
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))


@method("hf_assisted", "transformers assisted generation (assistant_model=) with the same draft and gamma")
def _hf_assisted(ctx: BenchContext, ids, mask, gen) -> RunStats:
    draft = draft_model_for(ctx)
    draft.generation_config.num_assistant_tokens = ctx.settings.sps.gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"  # same fixed gamma as ours
    draft.generation_config.assistant_confidence_threshold = 0.0  # no early exit: identical drafting policy
    _seed_global_rng(gen)
    with _hf_internal_warnings_off():
        out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, assistant_model=draft,
                                                    **hf_generate_kwargs(ctx, gen)))
    return RunStats(_hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id), dt, None)


@method("hf_lookup", "transformers prompt lookup (the same k and n-gram as pld)")
def _hf_lookup(ctx: BenchContext, ids, mask, gen) -> RunStats:
    s = ctx.settings.lookup
    _seed_global_rng(gen)
    out, dt = _timed(lambda: ctx.model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=s.k,
                                                max_matching_ngram_size=s.ngram, **hf_generate_kwargs(ctx, gen)))
    return RunStats(_hf_new_tokens(out, ids.shape[1], ctx.tokenizer.eos_token_id), dt, None)


# ---------------------------------------------------------------- the target's latency curve ("auto" sizes)


def measure_latency(model) -> dict[int, float]:
    """The target's forward latency curve {k tokens: seconds} at a 256-token context (what "auto" trees use):
    best of 5 per k, made non-decreasing in k by roofline.monotone_latency (out-of-order points are timing noise
    that would move the auto trees)."""
    from .roofline import monotone_latency, profile_latency_vs_k

    return monotone_latency(profile_latency_vs_k(model, ks=(1, 2, 4, 8, 16, 32, 64), context=256, repeats=5))



def latency_for(ctx: BenchContext) -> dict[int, float]:
    """measure_latency, once per target (and per forward mode: a compiled forward has its own curve)."""
    mode = ctx.settings.target.forward
    if mode not in ctx.loaded.latency_by:  # a curve given in Loaded(latency=...) serves the first mode asked
        given = ctx.loaded.latency if not ctx.loaded.latency_by else None
        ctx.loaded.latency_by[mode] = given if given is not None else measure_latency(ctx.model)
        if ctx.loaded.latency is None:
            ctx.loaded.latency = ctx.loaded.latency_by[mode]
    return ctx.loaded.latency_by[mode]


def target_for(loaded: Loaded, model, forward: str):
    """The target run with ``forward`` (fastpath.FastTarget around ``model``, made once per mode and run)."""
    from .fastpath import FastTarget

    if loaded.targets.get("hf") is not model:
        loaded.targets.clear()
        loaded.latency_by.clear()
        loaded.targets["hf"] = model
    if forward not in loaded.targets:
        loaded.targets[forward] = FastTarget(model, compile=forward == "compiled")
    return loaded.targets[forward]


# ---------------------------------------------------------------- Medusa


def medusa_for(ctx: BenchContext):
    """The committed Medusa heads, their vocabulary and this run's tree (choice paths)."""
    from .drafters.medusa import load_medusa, rank_accuracy
    from .tree import sized_sparse_tree

    if ctx.loaded.medusa is None:

        ctx.loaded.medusa = load_medusa(ctx.model, checkpoint(ctx, "medusa"))
        ctx.loaded.cards["medusa"] = ctx.loaded.medusa[2]
    heads, vocab, card = ctx.loaded.medusa
    if "medusa" not in ctx.trees:
        s = ctx.settings.medusa
        ctx.trees["medusa"] = list(s.choices) if s.choices else sized_sparse_tree(
            rank_accuracy(card), s.nodes, latency_for(ctx) if s.nodes == "auto" else None)
    return heads, vocab, ctx.trees["medusa"]


def _medusa_run(ctx: BenchContext, ids, gen, acceptance: str) -> RunStats:
    from .drafters.medusa import MedusaDrafter

    heads, vocab, choices = medusa_for(ctx)
    return _spec(ctx, ids, MedusaDrafter(ctx.model, heads, choices, vocab=vocab), gen, acceptance)


@method("medusa", "Medusa heads (data/checkpoints/medusa), sparse tree (medusa nodes), lossless tree verification")
def _medusa(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _medusa_run(ctx, ids, gen, "exact")


@method("medusa_typical", "Medusa with typical acceptance (LOSSY at temperature > 0; equals greedy at 0)")
def _medusa_typical(ctx: BenchContext, ids, mask, gen) -> RunStats:
    return _medusa_run(ctx, ids, gen, "typical")


# ---------------------------------------------------------------- EAGLE / EAGLE-2


def eagle_for(ctx: BenchContext):
    """The committed EAGLE head, its vocabulary and card, and the draft's cost per forward (measured once, or
    ``settings.eagle.draft_cost``). The latency curve is measured with it ("auto" sizes need both)."""
    if ctx.loaded.eagle is None:
        from .drafters.eagle import load_eagle, measure_draft_cost

        head, vocab, card = load_eagle(ctx.model, checkpoint(ctx, "eagle"))
        ctx.loaded.cards["eagle"] = card
        cost = measure_draft_cost(ctx.model, head, vocab, top_k=ctx.settings.eagle.top_k)
        ctx.loaded.eagle = (head, vocab, card, cost)
    latency_for(ctx)
    head, vocab, card, cost = ctx.loaded.eagle
    s = ctx.settings.eagle
    return head, vocab, card, cost if s.draft_cost is None else s.draft_cost


def preload(model, tokenizer, methods: tuple[str, ...] = ("eagle",)) -> Loaded:
    """A ``Loaded`` holding what ``methods`` load or measure (e.g. the EAGLE head, the latency curve, the draft
    cost): pass it to several run_bench calls (notebook 03's search) so they share one load and one measurement."""
    ctx = BenchContext(model=model, tokenizer=tokenizer, sampling=SamplingConfig(), max_new_tokens=1)
    for m in methods:
        {"eagle": eagle_for, "eagle2": eagle_for, "medusa": medusa_for, "sps": draft_model_for, "mtp": mtp_for,
         "eagle3": eagle3_for, "dflash": lambda c: block_for(c, "dflash"),
         "dspark": lambda c: block_for(c, "dspark")}[m](ctx)
    return ctx.loaded


def eagle_calibration(ctx: BenchContext) -> float:
    """eagle2's confidence calibration for this run: the head's card at the run's temperature, or the
    setting (1.0 = the paper's confidence-as-acceptance)."""
    from .drafters.eagle import confidence_calibration

    if ctx.settings.eagle.eagle2_calibration is not None:
        return float(ctx.settings.eagle.eagle2_calibration)
    return confidence_calibration(eagle_for(ctx)[2], ctx.sampling.temperature)


@method("eagle", "EAGLE-1 head (data/checkpoints/eagle), static tree (eagle nodes), lossless tree verification")
def _eagle(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import EagleDrafter, static_tree

    head, vocab, card, cost = eagle_for(ctx)
    if "eagle" not in ctx.trees:
        s = ctx.settings.eagle
        ctx.trees["eagle"] = static_tree(card, s.nodes, s.depth, ctx.sampling.temperature, latency_for(ctx), cost)
    return _spec(ctx, ids, EagleDrafter(ctx.model, head, vocab, choices=ctx.trees["eagle"],
                                        children=ctx.settings.eagle.children), gen)


@method("eagle2", "EAGLE-2 dynamic tree (depth, top_k, eagle2_total nodes) on the same head, lossless")
def _eagle2(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import Eagle2Drafter

    head, vocab, _, cost = eagle_for(ctx)
    s = ctx.settings.eagle
    drafter = Eagle2Drafter(ctx.model, head, vocab, depth=s.depth, top_k=s.top_k, total_tokens=s.eagle2_total,
                            latency=latency_for(ctx), draft_cost=cost, calibration=eagle_calibration(ctx),
                            children=s.children)
    return _spec(ctx, ids, drafter, gen)


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


def _totals() -> dict:
    return {"new_tokens": 0, "seconds": 0.0, "target_forwards": 0, **dict.fromkeys(SPLIT, 0)}


def _add(acc: dict, s: RunStats) -> None:
    """Accumulate one run; a counter some run did not expose (None) stays None."""
    acc["new_tokens"] += s.new_tokens
    acc["seconds"] += s.seconds
    for f in ("target_forwards", *SPLIT):
        v = getattr(s, f)
        acc[f] = None if v is None or acc[f] is None else acc[f] + v


def _row(m: str, a: dict, base: float) -> dict:
    tps = a["new_tokens"] / a["seconds"] if a["seconds"] else 0.0
    return {"method": m, "tokens_per_s": round(tps, 2),
            "tau": round(a["new_tokens"] / max(a["target_forwards"], 1), 3) if a["target_forwards"] is not None else None,
            "speedup": round(tps / base, 3) if base else None,
            "target_forwards": a["target_forwards"], "new_tokens": a["new_tokens"],
            "seconds": round(a["seconds"], 3), **step_split(a)}


# the Settings group each method reads (a variant's bare field name resolves to it first)
SETTINGS_GROUP = {"sps": "sps", "sps_rv": "sps", "hf_assisted": "sps", "pld": "lookup", "hf_lookup": "lookup",
                  "medusa": "medusa", "medusa_typical": "medusa", "eagle": "eagle", "eagle2": "eagle",
                  "eagle3": "eagle", "eagle_chain": "eagle", "mtp": "mtp", "dflash": "block", "dspark": "block"}


def parse_variant(name: str) -> tuple[str, dict[tuple[str, str], object]]:
    """A method run with some settings changed, so two settings of one method meet in one run (interleaved, one
    AR baseline): ``"eagle2[children=iid]"`` -> ``("eagle2", {("eagle", "children"): "iid"})``. A key is
    ``group.field`` (a field of one of Settings' groups: target / sps / lookup / medusa / eagle / mtp / block /
    drafters) or a field name only one group has, e.g. ``eagle2[checkpoints=FOLDER]``;
    several are separated by ``;``. Values: int, float, or the string as written."""
    import dataclasses
    import re

    m = re.fullmatch(r"([A-Za-z0-9_]+)(?:\[(.*)\])?", name.strip())
    if not m:
        raise ValueError(f"bad method {name!r}: expected NAME or NAME[key=value;...]")
    base, body = m.group(1), m.group(2)
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}; available: {sorted(METHODS)}")
    groups = {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(Settings)}
    out: dict[tuple[str, str], object] = {}
    for item in filter(None, (body or "").split(";")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"bad setting {item!r} in {name!r}: expected key=value")
        grp, _, fld = key.strip().rpartition(".")
        owners = [grp] if grp else [g for g, fs in groups.items() if fld in fs]
        if len(owners) > 1 and SETTINGS_GROUP.get(base) in owners:  # eagle2[depth=6]: eagle2's own group
            owners = [SETTINGS_GROUP[base]]
        if len(owners) != 1 or owners[0] not in groups or fld not in groups[owners[0]]:
            raise ValueError(f"setting {key!r} in {name!r} is " + ("ambiguous: write group.field, group one of "
                             f"{sorted(owners)}" if len(owners) > 1 else
                             f"unknown; groups and fields: { {g: sorted(fs) for g, fs in groups.items()} }"))
        val: object = raw.strip()
        for cast in (int, float):
            try:
                val = cast(raw)
                break
            except ValueError:
                pass
        out[owners[0], fld] = val
    return base, out


def _variant_ctx(ctx: BenchContext, name: str) -> tuple[MethodFn, BenchContext]:
    """(method function, the context it runs in): a variant gets its own settings (validated) and its own
    derived trees, and shares what is loaded."""
    import dataclasses

    base, over = parse_variant(name)
    if not over:
        return METHODS[base], ctx
    settings = ctx.settings
    for (grp, fld), val in over.items():
        settings = dataclasses.replace(settings, **{grp: dataclasses.replace(getattr(settings, grp), **{fld: val})})
    model, loaded = ctx.model, ctx.loaded
    if settings.target.forward != ctx.settings.target.forward:  # ar[forward=hf]: the same run, another forward
        model = target_for(ctx.loaded, ctx.loaded.targets["hf"], settings.target.forward)
    if settings.drafters != ctx.settings.drafters:  # eagle2[checkpoints=F]: drafters trained elsewhere, same run
        settings.drafters.folder()  # a missing folder is an error now, not in the middle of the run
        loaded = ctx.loaded.for_checkpoints(settings.drafters.checkpoints)
    return METHODS[base], dataclasses.replace(ctx, settings=settings, trees={}, model=model, loaded=loaded)


def _interleaved(runners: dict, methods: list[str], prompts: list[dict], encoded: list, repeats: int, seed: int,
                 progress: bool) -> tuple[dict, dict, dict, dict]:
    """For each repeat, for each prompt, every method in a rotating order (so no method always runs first).
    ``runners``: method name -> (function, context). -> totals per method, per (method, category), per (method,
    prompt index) (repeats summed: what a paired interval over prompts resamples), peak memory."""
    from tqdm.auto import tqdm

    tot, cat, per, mem = defaultdict(_totals), defaultdict(_totals), defaultdict(_totals), {}
    ctx = runners[methods[0]][1]
    dev = ctx.model.device
    bar = tqdm(total=repeats * len(prompts) * len(methods), desc="bench", disable=not progress)
    for r in range(repeats):
        for i, (p, (ids, mask)) in enumerate(zip(prompts, encoded)):
            k = (r * len(prompts) + i) % len(methods)
            for m in methods[k:] + methods[:k]:
                gen = None if ctx.sampling.greedy else torch.Generator().manual_seed(seed * 7919 + r * 104729 + i)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                fn, mctx = runners[m]
                s = fn(mctx, ids, mask, gen)
                mem[m] = max(mem.get(m, 0.0), _peak_mem_mb(dev))
                _add(tot[m], s)
                _add(cat[(m, p.get("category", ""))], s)
                _add(per[(m, i)], s)
                bar.update(1)
    bar.close()
    return tot, cat, per, mem


def by_prompt_json(per: dict, methods: list[str], prompts: list[dict]) -> dict:
    """Each method's counts per prompt, in prompt order (lists parallel to ``categories``): enough to resample
    prompts for an interval on any ratio of pooled counts (report.change_interval), never printed as a result."""
    return {"categories": [p.get("category", "") for p in prompts],
            "methods": {m: {"new_tokens": [per[m, i]["new_tokens"] for i in range(len(prompts))],
                            "target_forwards": [per[m, i]["target_forwards"] for i in range(len(prompts))],
                            "seconds": [round(per[m, i]["seconds"], 4) for i in range(len(prompts))]}
                        for m in methods}}


@method("eagle3", "EAGLE-3 head (data/checkpoints/eagle3: fused taps, draft vocabulary), EAGLE-2's dynamic tree, lossless")
def _eagle3(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import confidence_calibration
    from .drafters.eagle3 import Eagle3Drafter

    head, card, cost = eagle3_for(ctx)
    s = ctx.settings.eagle
    drafter = Eagle3Drafter(ctx.model, head, depth=s.depth, top_k=s.top_k, total_tokens=s.eagle2_total,
                            latency=latency_for(ctx), draft_cost=cost,
                            calibration=confidence_calibration(card, ctx.sampling.temperature), children=s.children)
    return _spec(ctx, ids, drafter, gen)


def eagle3_for(ctx: BenchContext):
    """The committed EAGLE-3 head, its card and one draft forward's measured cost (as eagle_for)."""
    if ctx.loaded.eagle3 is None:
        from .drafters.eagle3 import Eagle3Drafter, load_eagle3

        head, card = load_eagle3(ctx.model, checkpoint(ctx, "eagle3"))
        ctx.loaded.cards["eagle3"] = card
        cost = Eagle3Drafter(ctx.model, head, top_k=ctx.settings.eagle.top_k).measure_draft_cost()
        ctx.loaded.eagle3 = (head, card, cost)
    return ctx.loaded.eagle3


@method("self_spec", "Gloeckle's self-speculation: a toy MTP model's heads 2..n draft, the model itself verifies "
                     "(run_bench(model=toy.lm, tokenizer=ToyTokenizer(tok, toy), loaded=Loaded(toy=toy)))")
def _self_spec(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.parallel_heads import SelfSpecDrafter

    if ctx.loaded.toy is None or ctx.loaded.toy.lm is not ctx.model:
        raise ValueError("self_spec runs on a toy MTP model: pass model=toy.lm and loaded=Loaded(toy=toy)")
    return _spec(ctx, ids, SelfSpecDrafter(ctx.loaded.toy), gen)


# ---------------------------------------------------------------- MTP


def mtp_for(ctx: BenchContext):
    """The committed MTP modules, their vocabulary and card, one module forward's measured cost, and this run's
    chain depth (MtpSettings.depth, or auto_depth from the latency curve)."""
    from .drafters.mtp import auto_depth, load_mtp, measure_module_cost

    if ctx.loaded.mtp is None:

        mods, vocab, card = load_mtp(ctx.model, checkpoint(ctx, "mtp"))
        ctx.loaded.cards["mtp"] = card
        ctx.loaded.mtp = (mods, vocab, card, measure_module_cost(ctx.model, mods, vocab))
    mods, vocab, card, cost = ctx.loaded.mtp
    if "mtp" not in ctx.trees:
        d = ctx.settings.mtp.depth
        if d != "auto" and d > mods.depth:
            raise ValueError(f"mtp depth {d} is above the {mods.depth} modules of data/checkpoints/mtp")
        ctx.trees["mtp"] = auto_depth(card, latency_for(ctx), cost) if d == "auto" else d
    return mods, vocab, card, cost, ctx.trees["mtp"]


@method("mtp", "DeepSeek-V3 MTP modules (data/checkpoints/mtp), a chain of mtp depth tokens, lossless")
def _mtp(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.mtp import MTPDrafter

    mods, vocab, _, _, depth = mtp_for(ctx)
    return _spec(ctx, ids, MTPDrafter(ctx.model, mods, vocab, depth=depth), gen)


@method("eagle_chain", "the EAGLE-1 head drafting a chain as deep as mtp's (top-1 tokens at T = 0; at T > 0 each drawn "
                       "from q under the run's child rule, as mtp's are): the like-for-like baseline of mtp (same "
                       "inputs, one head reused per depth)")
def _eagle_chain(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.eagle import EagleDrafter
    from .tree import chain_choices

    head, vocab, _, _ = eagle_for(ctx)
    return _spec(ctx, ids, EagleDrafter(ctx.model, head, vocab, choices=chain_choices(mtp_for(ctx)[4]),
                                        children=ctx.settings.eagle.children), gen)


# ---------------------------------------------------------------- DFlash / DSpark


def block_for(ctx: BenchContext, kind: str):
    """The committed DFlash or DSpark network, its card and one block forward's measured cost."""
    if getattr(ctx.loaded, kind) is None:
        from .drafters.dflash import load_block, measure_draft_cost

        net, card = load_block(ctx.model, checkpoint(ctx, kind), kind)
        ctx.loaded.cards[kind] = card
        setattr(ctx.loaded, kind, (net, card, measure_draft_cost(ctx.model, net)))
    return getattr(ctx.loaded, kind)


def compiled_block_for(ctx: BenchContext, kind: str) -> tuple[object | None, float]:
    """(the kind's CompiledBlock, one compiled step's measured cost) when this run's block drafters step compiled
    (``BlockSettings.compiled``), else (None, the eager block forward's cost)."""
    net, _, cost = block_for(ctx, kind)
    if not ctx.settings.block.compiled(ctx.settings.target.forward):
        return None, cost
    key = kind if ctx.settings.block.gamma == net.gamma else f"{kind}[gamma={ctx.settings.block.gamma}]"
    if key not in ctx.loaded.compiled_blocks:
        from .drafters import head_rows
        from .drafters.block_compiled import CompiledBlock

        cb = CompiledBlock(net, head_rows(ctx.model.get_output_embeddings().weight, net.vocab)[0],
                           gamma=ctx.settings.block.gamma)
        ctx.loaded.compiled_blocks[key] = (cb, cb.measure_cost())
    return ctx.loaded.compiled_blocks[key]


@method("dflash", "DFlash block drafter (data/checkpoints/dflash): gamma tokens in one parallel forward, lossless chain")
def _dflash(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.dflash import BlockDrafter

    net, _, _ = block_for(ctx, "dflash")
    compiled, _ = compiled_block_for(ctx, "dflash")
    return _spec(ctx, ids, BlockDrafter(ctx.model, net, gamma=ctx.settings.block.gamma, compiled=compiled), gen)


@method("dspark", "DSpark (data/checkpoints/dspark): DFlash + Markov head, the block cut by the calibrated survival "
                  "(block threshold), lossless chain")
def _dspark(ctx: BenchContext, ids, mask, gen) -> RunStats:
    from .drafters.dflash import BlockDrafter

    net, card, _ = block_for(ctx, "dspark")
    compiled, cost = compiled_block_for(ctx, "dspark")
    s = ctx.settings.block
    drafter = BlockDrafter(ctx.model, net, gamma=s.gamma, threshold=s.threshold, **s.survival_calibration(card),
                           latency=latency_for(ctx) if s.threshold == "auto" else None, draft_cost=cost,
                           compiled=compiled)
    return _spec(ctx, ids, drafter, gen)


def settings_json(ctx: BenchContext, methods: list[str]) -> dict:
    """What a run used, beyond its arguments: method settings and what the "auto" sizes measured."""
    out = {"gamma": ctx.settings.sps.gamma}
    if "medusa" in ctx.trees:
        out["medusa_choices"] = [list(c) for c in ctx.trees["medusa"]]
    if ctx.loaded.latency is not None:
        out["latency_s"] = ctx.loaded.latency_by.get(ctx.settings.target.forward, ctx.loaded.latency)
    if len(ctx.loaded.latency_by) > 1:
        out["latency_s_by_forward"] = ctx.loaded.latency_by
    if ctx.loaded.eagle is not None and {"eagle", "eagle2"} & set(methods):
        s = ctx.settings.eagle
        out["eagle"] = {"nodes": s.nodes, "depth": s.depth, "top_k": s.top_k, "eagle2_total": s.eagle2_total,
                        "children": s.children,
                        "draft_cost_s": eagle_for(ctx)[3], "eagle2_calibration": eagle_calibration(ctx)}
        if "eagle" in ctx.trees:
            out["eagle"]["static_choices"] = [list(c) for c in ctx.trees["eagle"]]
    if ctx.loaded.eagle3 is not None and "eagle3" in methods:
        s = ctx.settings.eagle
        out["eagle3"] = {"depth": s.depth, "top_k": s.top_k, "eagle2_total": s.eagle2_total, "children": s.children,
                         "draft_cost_s": ctx.loaded.eagle3[2], "checkpoint_steps": ctx.loaded.eagle3[1].get("steps")}
    if {"pld", "hf_lookup"} & set(methods):
        out["lookup"] = {"k": ctx.settings.lookup.k, "ngram": ctx.settings.lookup.ngram}
    if ctx.loaded.mtp is not None and {"mtp", "eagle_chain"} & set(methods):
        out["mtp"] = {"depth": ctx.settings.mtp.depth, "chosen_depth": ctx.trees.get("mtp"),
                      "module_cost_s": ctx.loaded.mtp[3]}
    for kind in ("dflash", "dspark"):
        if getattr(ctx.loaded, kind) is not None and kind in {parse_variant_base(m) for m in methods}:
            net, card, cost = getattr(ctx.loaded, kind)
            out[kind] = {"gamma": ctx.settings.block.gamma, "block_cost_s": cost, "checkpoint_steps": card.get("steps"),
                         "draft": "compiled" if ctx.settings.block.compiled(ctx.settings.target.forward) else "eager"}
            if kind in ctx.loaded.compiled_blocks:
                out[kind]["compiled_step_cost_s"] = ctx.loaded.compiled_blocks[kind][1]
            if kind == "dspark":
                out[kind]["threshold"] = ctx.settings.block.threshold
                from .drafters.block_calibration import calibration_source

                out[kind]["calibration"] = calibration_source(card, ctx.settings.block.calibration)
    return out


# the checkpoints each method reads (settings.drafters.checkpoints / KIND)
CHECKPOINT_KINDS = {"sps": ("draft_model",), "sps_rv": ("draft_model",), "hf_assisted": ("draft_model",),
                    "medusa": ("medusa",), "medusa_typical": ("medusa",), "eagle": ("eagle",), "eagle2": ("eagle",),
                    "eagle3": ("eagle3",), "eagle_chain": ("eagle", "mtp"), "mtp": ("mtp",), "dflash": ("dflash",),
                    "dspark": ("dspark",)}


def checkpoints_json(ctx: BenchContext, method: str) -> dict:
    """The checkpoints a method read in this run: kind -> folder, the corpus it was trained on, its steps."""
    from .prompts import ROOT

    folder = ctx.settings.drafters.folder()
    shown = str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder)
    return {k: {"folder": shown, "corpus_sha": ctx.loaded.cards[k].get("corpus_sha"),
                "corpus_records": ctx.loaded.cards[k].get("corpus_records"), "steps": ctx.loaded.cards[k].get("steps"),
                "init_steps": (ctx.loaded.cards[k].get("init") or {}).get("steps"),
                **({"interpolated": {"alpha": mix["alpha"], "start_steps": mix["start"].get("steps")}}
                   if (mix := ctx.loaded.cards[k].get("interpolated")) else {})}
            for k in CHECKPOINT_KINDS.get(parse_variant_base(method), ()) if k in ctx.loaded.cards}


def parse_variant_base(name: str) -> str:
    """The method a (possibly variant) name runs: ``"eagle2[children=iid]"`` -> ``"eagle2"``."""
    return name.split("[", 1)[0].strip()


def run_bench(methods: list[str], prompts: list[dict], *, model_name: str = "smollm2-135m-instruct",
              dtype: str = "fast", device: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int | None = None, repeats: int = 1, seed: int = 0,
              progress: bool = True, model=None, tokenizer=None, settings: Settings | None = None,
              loaded: Loaded | None = None) -> dict:
    """Run ``methods`` interleaved over ``prompts``; return the JSON-ready result. ``settings``: the methods'
    configuration (default ``Settings()``; ``settings.target.forward`` picks how the target runs, default "hf");
    ``loaded``: drafters / measurements to reuse (``preload``). A method may be a variant with some settings
    changed, e.g. ``"eagle2[children=iid]"`` or ``"ar[forward=hf]"`` (``parse_variant``). A compiled target's graphs
    are all built before the timed runs; their seconds are in the JSON (``settings.fast``), never in a figure."""

    from .decoding import encode
    from .models import load_model

    unknown = [m for m in methods if parse_variant_base(m) not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {sorted(METHODS)} (a variant: NAME[key=value])")
    if "ar" not in methods:
        methods = ["ar", *methods]  # speedup needs the baseline from the same run
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if model is None:
        model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    settings = settings or Settings()
    loaded = loaded or Loaded()
    encoded = [encode(tokenizer, p["turns"][0], max_new_tokens=max_new_tokens,
                      max_length=int(model.config.max_position_embeddings), device=model.device) for p in prompts]
    target = target_for(loaded, model, settings.target.forward)
    ctx = BenchContext(model=target, tokenizer=tokenizer, sampling=sampling, max_new_tokens=max_new_tokens,
                       settings=settings, loaded=loaded)
    runners = {m: _variant_ctx(ctx, m) for m in methods}
    fast, drafts, blocks = _warm_up(loaded, runners, encoded, max_new_tokens, seed, progress)
    tot, cat, per, mem = _interleaved(runners, methods, prompts, encoded, repeats, seed, progress)
    base = tot["ar"]["new_tokens"] / tot["ar"]["seconds"]
    rows = [{**_row(m, tot[m], base), "peak_mem_mb": round(mem[m], 1)} for m in methods]
    by_cat = []
    for c in sorted({c for (_, c) in cat}):
        cb = cat[("ar", c)]
        cbase = cb["new_tokens"] / cb["seconds"] if cb["seconds"] else 0
        by_cat += [{"category": c, **_row(m, cat[(m, c)], cbase)} for m in methods]
    return {
        "machine": machine_info(),
        "settings": {"model": model_name, "dtype": str(model.dtype).replace("torch.", ""), "device": str(model.device),
                     "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                     "repeats": repeats, "prompts": len(prompts), "seed": seed, "methods": methods,
                     **settings_json(ctx, [parse_variant(m)[0] for m in methods]),
                     **({"variants": {m: {f"{g}.{f}": v for (g, f), v in parse_variant(m)[1].items()}
                                      for m in methods if "[" in m}} if any("[" in m for m in methods) else {}),
                     "peak_mem_note": "CUDA: peak allocated per method; CPU: process max RSS (shared by all methods)",
                     "forward": settings.target.forward,
                     "checkpoints": {m: c for m, (_, mctx) in runners.items() if (c := checkpoints_json(mctx, m))},
                     **({"fast": {**{mode: t.stats.as_json() for mode, t in loaded.targets.items() if mode != "hf"},
                                  **{name: t.stats.as_json() for name, t in drafts.items()},
                                  **{name: cb.stats_json() for name, cb in blocks.items()}}}
                        if fast or blocks else {})},
        "rows": rows,
        "by_category": by_cat, "by_prompt": by_prompt_json(per, methods, prompts),
    }


def _warm_up(loaded: Loaded, runners: dict, encoded: list, max_new_tokens: int, seed: int, progress: bool):
    """Before the timed runs: one short run of every method (allocations, thread pools, lazy state; a variant's own
    trees), then every graph a timed run could need compiled -> (compiled targets, draft models, block steps)."""
    import dataclasses

    from .decoding import MAX_BLOCK

    longest = max(ids.shape[1] for ids, _ in encoded) + max_new_tokens
    fast = [t for mode, t in loaded.targets.items() if mode != "hf"]
    for t in fast:  # one cache capacity for the whole run: one set of compiled graphs serves every request
        t.reserve(longest + MAX_BLOCK)
    for m, (fn, mctx) in runners.items():
        fn(dataclasses.replace(mctx, max_new_tokens=8), *encoded[0],
           torch.Generator().manual_seed(seed) if not mctx.sampling.greedy else None)
    for t in fast:  # every bucket compiled now (with hidden states too where a drafter asked for them)
        t.warm_up(hidden=tuple(sorted({k.endswith("+hidden") for k in t.stats.warmup_s} | {False})),
                  progress=progress)
    for t in (drafts := fast_drafts(loaded)).values():  # the draft models' graphs too (every bucket a step can use)
        t.warm_up(progress=progress)
    greedy = next(iter(runners.values()))[1].sampling.greedy
    for cb in (blocks := compiled_blocks(loaded)).values():  # the block drafters' steps: every buffer capacity
        cb.warm_up(longest, greedy=greedy)
    return fast, drafts, blocks


def compiled_blocks(loaded: Loaded) -> dict[str, object]:
    """Every compiled block-drafter step of a run (its own and those of other checkpoint folders), named for the
    JSON."""
    return {f"{key.split('[')[0]}[draft=compiled, gamma={cb.gamma}{', checkpoints=' + folder if folder else ''}]": cb
            for folder, L in [("", loaded), *loaded.siblings.items()] for key, (cb, _) in L.compiled_blocks.items()}


def fast_drafts(loaded: Loaded) -> dict[str, object]:
    """Every compiled draft model of a run (its own and those of other checkpoint folders), named for the JSON."""
    out = {}
    for folder, L in [("", loaded), *loaded.siblings.items()]:
        for k, t in L.fast_drafts.items():
            out[f"draft_model[vocab={k or 'full'}{', checkpoints=' + folder if folder else ''}]"] = t
    return out


def per_category(prompts: list[dict], n: int, categories: list[str] | None = None, skip: int = 0) -> list[dict]:
    """Prompts skip+1 .. skip+n of every category (of ``categories`` only, when given), in file order.

    ``skip`` > 0 gives a confirmation run prompts that an earlier ``skip = 0`` run of the same ``n`` never saw."""
    if n < 1 or skip < 0:
        raise ValueError(f"per_category needs n >= 1 and skip >= 0, got n={n}, skip={skip}")
    known = {p.get("category", "") for p in prompts}
    if missing := sorted(set(categories or ()) - known):
        raise ValueError(f"no prompts of categories {missing}; the prompt set has {sorted(known)}")
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        c = p.get("category", "")
        if categories and c not in categories:
            continue
        seen[c] = seen.get(c, 0) + 1
        if skip < seen[c] <= skip + n:
            out.append(p)
    if empty := sorted(c for c, k in seen.items() if k <= skip):
        raise ValueError(f"skipping the first {skip} prompts of every category leaves none of {empty} "
                         f"(they have {[seen[c] for c in empty]}); lower --skip or pass --categories without them")
    return out


def markdown_table(result: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "tau", "target_forwards", "new_tokens", "peak_mem_mb",
            "draft_ms_per_step", "verify_ms_per_step"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def write_result(res: dict, path: str | Path | None) -> None:
    """Write a run's JSON to ``path`` (folders made as needed); nothing when ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=1))
        print(f"wrote {path}")


def main(argv=None):
    from .prompts import load_prompts

    ap = argparse.ArgumentParser(prog="python -m specbook.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ar,hf_generate",
                    help=f"comma list; available: {','.join(sorted(METHODS))}; a variant with some settings changed: "
                         "NAME[key=value;...], e.g. eagle2[children=iid]")
    ap.add_argument("--prompts", default="eval", help="'eval', 'train' or a Spec-Bench-format .jsonl path")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--per-category", type=int, default=0,
                    help="the first N prompts of every category instead of the first --limit (a per-category table)")
    ap.add_argument("--categories", default="",
                    help="comma list: only these categories (with --per-category), e.g. math_reasoning,translation")
    ap.add_argument("--skip", type=int, default=0,
                    help="with --per-category: leave out the first N prompts of every category, so a confirmation "
                         "run reads prompts that a run without --skip did not")
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
    ap.add_argument("--children", default=EagleSettings.children, choices=["topk", "iid", "noreplace"],
                    help="eagle / eagle2 / eagle3 at T > 0: top-k picks, or children drawn from q (i.i.d. / without "
                         f"replacement); default {EagleSettings.children} (EagleSettings says how it was chosen)")
    ap.add_argument("--forward", default="compiled", choices=list(FORWARDS),
                    help="how the target runs (fastpath.py): compiled (default; compile seconds reported in the JSON), "
                         "static (the same static KV cache, eager: the reference), hf (transformers' forward)")
    ap.add_argument("--no-compile", dest="forward", action="store_const", const="static",
                    help="same as --forward static")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    cats = [c.strip() for c in a.categories.split(",") if c.strip()]
    if (cats or a.skip) and not a.per_category:
        ap.error("--categories and --skip need --per-category N (how many prompts of each)")
    prompts = per_category(load_prompts(a.prompts), a.per_category, cats, a.skip) if a.per_category else \
        load_prompts(a.prompts, limit=a.limit)
    res = run_bench(methods, prompts, model_name=a.model, dtype=a.dtype, device=a.device,
                    max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    repeats=a.repeats, seed=a.seed, settings=Settings(target=TargetSettings(forward=a.forward),
                                                                      eagle=EagleSettings(children=a.children)))
    res["settings"]["command"] = "python -m specbook.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    res["settings"]["prompts_source"] = a.prompts
    print(markdown_table(res))
    write_result(res, a.json)


if __name__ == "__main__":
    main()
