"""Train a drafter for the target with the one training loop.

    python -m specbook.train draft_model [--steps 600 --batch 8 --seq-len 256 --lr 1e-3]
    python -m specbook.train medusa [--heads 4 --vocab 8192 ...]
    python -m specbook.train eagle [--vocab 8192 --noise 0.1 ...]
    python -m specbook.train mtp [--modules 3 --vocab 8192 ...]
    python -m specbook.train eagle3 [--vocab 8192 --ttt-steps 7 ...]
    python -m specbook.train dflash [--vocab 8192 --gamma 7 --draft-layers 2 ...]
    python -m specbook.train dspark [--vocab 8192 --gamma 7 --draft-layers 2 ...]
    python -m specbook.train METHOD --init END --interpolate START [--alpha 0.5]   (no training: WiSE-FT)

Reads the committed self-distilled corpus (data/corpus), builds/reuses the target's feature
cache, trains, and writes ``data/checkpoints/<method>.{safetensors,json}`` — but only replaces an
existing checkpoint when the held-out acceptance improves (``--force`` overrides), so a committed
checkpoint never gets worse. METHOD grows as drafters land.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .prompts import ROOT

CKPT_DIR = ROOT / "data" / "checkpoints"


def _head_vocab(args, corpus=None):
    """--vocab N: the N most frequent response tokens of the whole corpus (None = the full vocabulary);
    --keep-vocab: the --init checkpoint's own draft vocabulary, in its order."""
    from .corpus import load_corpus, top_tokens
    from .training import checkpoint_vocab

    if getattr(args, "keep_vocab", False):
        if not args.init:
            raise SystemExit("--keep-vocab keeps the draft vocabulary of the --init checkpoint: pass --init PATH")
        return checkpoint_vocab(args.init)
    if not args.vocab:
        return None
    ids, _ = top_tokens(corpus if corpus is not None else load_corpus(Path(args.corpus)), args.vocab)
    return ids


def _eagle3_layers(config, taps=None) -> tuple[int, ...]:
    from .drafters.eagle3 import default_taps

    return (*default_taps(config.num_hidden_layers), -1)  # the three taps, then the final state (the teacher)


def _taps(args) -> tuple[int, ...] | None:
    """--taps "2,15,30" -> (2, 15, 30); None when not given (the drafter's default rule)."""
    text = getattr(args, "taps", None)
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--taps takes comma-separated output_hidden_states indices, e.g. 2,15,28; got {text!r}") from None


def _dflash_layers(config, taps=None) -> tuple[int, ...]:
    from .drafters.dflash import default_taps

    return (*(taps or default_taps(config.num_hidden_layers)), -1)  # the taps, then the final state (the teacher)


def _block_kwargs(args, corpus) -> dict:
    return {"vocab": _head_vocab(args, corpus), "gamma": args.gamma, "layers": args.draft_layers, "taps": _taps(args),
            "anchors": args.anchors}


@dataclass(frozen=True)
class Method:
    """A trainable drafter: its objective class ("module:Class", imported on use), the target layers its
    feature cache holds, the held-out metric that decides whether a new checkpoint replaces the committed one,
    and the objective's keyword arguments from the command line."""

    objective: str
    layers: tuple[int, ...] | Callable  # or a function of the target's config and the drafter's taps (EAGLE-3's
    #                                     depend on the target's depth; DFlash's on --taps)
    metric: str
    cli_kwargs: Callable = lambda args, corpus: {}

    def layers_for(self, config, taps=None) -> tuple[int, ...]:
        """The feature-store layers, a tap at L named -1 (the final state it is: features.store_layers)."""
        from .features import store_layers

        layers = self.layers(config, taps) if callable(self.layers) else self.layers
        return store_layers(tuple(layers), config.num_hidden_layers)

    def build(self, target, **kw):
        module, name = self.objective.split(":")
        return getattr(importlib.import_module(module), name)(target, **kw)

    def seeded_build(self, target, seed: int, **kw):
        """``build`` with the head's initial weights drawn from ``seed`` (the same --seed, the same starting head);
        the caller's global RNG is left as it was."""
        import torch

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return self.build(target, **kw)


METHODS = {
    "draft_model": Method("specbook.drafters.draft_model:DraftModelObjective", (-1,), "alpha_T1",
                          lambda a, c: {"layers_from": tuple(int(x) for x in a.layers_from.split(","))}
                          if a.layers_from else {}),
    "medusa": Method("specbook.drafters.medusa:MedusaObjective", (-1,), "mean_top1",
                     lambda a, c: {"n_heads": a.heads, "vocab": _head_vocab(a, c)}),
    "eagle": Method("specbook.drafters.eagle:EagleObjective", (-1,), "mean_top1",
                    lambda a, c: {"vocab": _head_vocab(a, c), "noise": a.noise}),
    "mtp": Method("specbook.drafters.mtp:MTPObjective", (-1,), "mean_acc",
                  lambda a, c: {"depth": a.modules, "vocab": _head_vocab(a, c)}),
    "eagle3": Method("specbook.drafters.eagle3:Eagle3Objective", _eagle3_layers, "mean_acc",
                     lambda a, c: {"vocab": _head_vocab(a, c), "ttt_steps": a.ttt_steps}),
    "dflash": Method("specbook.drafters.dflash:DFlashObjective", _dflash_layers, "tau0", _block_kwargs),
    "dspark": Method("specbook.drafters.dflash:DSparkObjective", _dflash_layers, "tau0", _block_kwargs),
}


def training_corpus(corpus, records: int = 0):
    """What ``train --records N`` trains on: N evenly spaced records of ``corpus`` (every category; less feature and
    training time on a slow machine); 0 = all of it. Written once to the cache and read from there after (its files
    checked against their manifest), never rewritten in place: another run may be reading it."""
    if not records:
        return corpus
    from .corpus import CorpusError, load_corpus, subset
    from .models import cache_dir

    out = cache_dir() / "subsets" / f"{corpus.sha}-{records}"
    if (out / "manifest.json").exists():
        try:
            old = load_corpus(out)
            s = old.manifest.get("settings", {})
            if (s.get("subset_of"), s.get("n"), s.get("spread")) == (corpus.sha, min(records, len(corpus)), True):
                return old
        except CorpusError:
            pass  # a partial or edited copy: written again below
    return subset(corpus, records, out, spread=True)


def feature_layers(methods: list[str], config, taps=None) -> tuple[int, ...]:
    """The union of the target layers ``methods`` train on, in first-seen order: one feature store built for it
    serves each of them (features.load_or_build reads a wider store), so the target runs over the corpus once."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown} in --features-for; available: {sorted(METHODS)}")
    return tuple(dict.fromkeys(x for m in methods for x in METHODS[m].layers_for(config, taps)))


def _fit(method: str, obj, args, corpus, store, target):
    """Train ``obj`` (from scratch, or on from --init's weights), or with --interpolate only mix two checkpoints
    and evaluate held-out. -> (config, data, result, what the card records about where the weights came from)."""
    from .models import cache_dir, fingerprint
    from .training import TrainConfig, TrainData, TrainResult, evaluate, interpolate, train, warm_start

    if args.interpolate and not args.init:
        raise SystemExit("--interpolate START needs --init END: the checkpoint that was trained on from START")
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                      eval_every=args.eval_every, ckpt_every=args.eval_every, seed=args.seed, pack=args.pack,
                      train_fraction=args.train_fraction, eval_batches=args.eval_batches)
    data = TrainData(corpus, store, seq_len=cfg.seq_len, seed=cfg.seed, pack=cfg.pack,
                     train_fraction=cfg.train_fraction, teacher=teacher_for(obj, store, target))
    if args.interpolate:  # no training: a point on the line from START to its continuation, evaluated held-out
        mix = interpolate(obj, args.interpolate, args.init, args.alpha, target)
        final = {"step": 0, **evaluate(obj, data, cfg, target.device)}  # steps: none of its own; its ends' in the card
        return cfg, data, TrainResult(steps=0, evals=[final]), {
            "init": mix["end"], "interpolated": {"start": mix["start"], "alpha": mix["alpha"]}}
    init = warm_start(obj, args.init, target) if args.init else None  # continued training: the card says from what
    cfg_key = hashlib.sha256(json.dumps([asdict(cfg), obj.card_config(), init], sort_keys=True).encode()).hexdigest()[:8]
    run_dir = cache_dir() / "runs" / f"{method}-{fingerprint(target)}-{corpus.sha}-{cfg_key}"
    return cfg, data, train(obj, data, cfg, run_dir=run_dir, resume=not args.fresh), ({"init": init} if init else {})


def teacher_for(obj, store, target, progress: bool = True):
    """The per-token (lse, argmax) of the target's full vocabulary beside ``store``, for an objective that reads
    them (``reads_teacher``: EAGLE-3, DFlash, DSpark); None for the rest. Built once per corpus and LM head."""
    from .features import load_or_build_teacher

    if not getattr(obj, "reads_teacher", False):
        return None
    return load_or_build_teacher(store, target.get_output_embeddings().weight.detach().float(), progress=progress)


def command(argv: list[str]) -> str:
    """The command line a card records for a run with these arguments."""
    return " ".join(["python -m specbook.train", *argv])


def run(method: str, args, argv: list[str] | None = None) -> dict:
    from .corpus import load_corpus
    from .features import load_or_build
    from .models import fingerprint, load_model, machine_info
    from .training import load_checkpoint, save_checkpoint

    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r}; available: {sorted(METHODS)}")
    spec = METHODS[method]
    taps = _taps(args)
    if spec.cli_kwargs is not _block_kwargs and (taps or args.anchors != parser().get_default("anchors")):
        raise SystemExit(f"--taps and --anchors configure the block drafters (dflash, dspark), not {method}")
    corpus = training_corpus(load_corpus(Path(args.corpus)), args.records)
    tgt16, _ = load_model(args.target, dtype="fast", device=args.device)  # features: the speed dtype
    if corpus.manifest["target_fingerprint"] != fingerprint(tgt16):
        raise SystemExit(f"the corpus was generated by target {corpus.manifest['target_fingerprint']}, not "
                         f"{fingerprint(tgt16)} ({args.target}); regenerate it with `python -m specbook.corpus generate "
                         f"--target {args.target}`")
    layers = spec.layers_for(tgt16.config, taps)
    wanted = feature_layers([method, *args.features_for.split(",")] if args.features_for else [method], tgt16.config, taps)
    store = load_or_build(tgt16, corpus, wanted)  # a wider store serves this method's layers (later runs reuse it)
    store = store.select(layers) if tuple(store.layers) != tuple(layers) else store
    del tgt16
    target, _ = load_model(args.target, dtype="fp32", device=args.device)
    obj = spec.seeded_build(target, args.seed, **spec.cli_kwargs(args, corpus))
    cfg, data, res, origin = _fit(method, obj, args, corpus, store, target)
    final = res.evals[-1]
    extra = obj.finalize(data) if hasattr(obj, "finalize") else {}  # e.g. DSpark's calibration
    card = {
        "kind": method, "config": obj.card_config(), "target": args.target, "target_fingerprint": fingerprint(target),
        "corpus_sha": corpus.sha, "corpus_records": len(corpus), "train_records": len(data.train),
        "train_tokens": data.train_tokens, "train_config": asdict(cfg), "steps": res.steps, "heldout": final, **extra, **origin,
        "evals": res.evals, "loss_curve": [h for h in res.history if h["step"] % 10 == 0 or h["step"] == 1],
        "train_seconds": round(res.seconds, 1), "machine": machine_info(),
        "command": command(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out) if args.out else CKPT_DIR / method
    if out.with_suffix(".json").exists() and not args.force:
        try:
            _, old = load_checkpoint(out, target=target, kind=method)
            if old["heldout"].get(spec.metric, -1) >= final[spec.metric]:
                out = out.with_name(out.name + ".candidate")
                print(f"[train] held-out {spec.metric} {final[spec.metric]:.4f} does not beat the committed "
                      f"{old['heldout'][spec.metric]:.4f}; wrote {out} instead (use --force to replace)")
        except Exception as e:  # a broken old checkpoint is replaced
            print(f"[train] replacing unreadable checkpoint: {e}")
    save_checkpoint(out, obj.state(), card)
    shown = {k: v for k, v in final.items() if not k.startswith(("acc_", "soft_", "surv_"))}  # the rest: in the card
    print(f"[train] wrote {out}.safetensors  held-out: " + " ".join(f"{k}={v:.4f}" for k, v in shown.items()))
    return card


def short_run(method: str, target, corpus, records: int = 32, steps: int = 20, workdir=None, progress: bool = False,
              **objective_kw):
    """Exercise the whole pipeline quickly (notebooks in FAST mode): a corpus subset -> its features ->
    ``steps`` steps of the one loop. Returns (objective, TrainResult); nothing is written to data/."""
    import tempfile

    from .corpus import load_corpus, subset
    from .features import load_or_build
    from .training import TrainConfig, TrainData, train

    workdir = Path(workdir or tempfile.mkdtemp(prefix="specbook-short-"))
    cdir = workdir / "corpus"  # a second run in the same workdir reuses its corpus slice and features
    small = load_corpus(cdir) if (cdir / "manifest.json").exists() else subset(corpus, records, cdir)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {sorted(METHODS)}")
    store = load_or_build(target, small, METHODS[method].layers_for(target.config, objective_kw.get("taps")),
                          root=workdir / "features", progress=progress)
    obj = METHODS[method].build(target, **objective_kw)
    cfg = TrainConfig(steps=steps, batch=4, seq_len=128, warmup=2, eval_every=steps, ckpt_every=steps, eval_batches=1)
    data = TrainData(small, store, seq_len=cfg.seq_len, teacher=teacher_for(obj, store, target, progress))
    res = train(obj, data, cfg, progress=progress)
    obj.workdir = workdir
    return obj, res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specbook.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("method", choices=sorted(METHODS))
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--corpus", default=str(ROOT / "data" / "corpus"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--pack", action="store_true",
                    help="fill every window with whole records one after another up to --seq-len (train and held-out), "
                         "so the head sees positions that far out; each record keeps its own target features")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=4,
                    help="held-out batches per evaluation (the same windows at every evaluation; more = less noise)")
    ap.add_argument("--train-fraction", type=float, default=1.0,
                    help="train on this nested part of the train prompts (0.25 lies inside 0.5); the held-out prompts "
                         "stay the same, so runs on different fractions compare (python -m specbook.data_scaling)")
    ap.add_argument("--layers-from", default=None, help="draft_model: target layers to copy, e.g. 0,1,29")
    ap.add_argument("--records", type=int, default=0,
                    help="train on N evenly spaced corpus records (0 = all); the card records the subset's sha")
    ap.add_argument("--heads", type=int, default=4, help="medusa: number of heads K")
    ap.add_argument("--noise", type=float, default=0.1, help="eagle: uniform noise amplitude on input features")
    ap.add_argument("--modules", type=int, default=3, help="mtp: number of sequential MTP modules D")
    ap.add_argument("--ttt-steps", type=int, default=7, help="eagle3: draft steps unrolled by the training-time test")
    ap.add_argument("--gamma", type=int, default=7, help="dflash / dspark: draft tokens per block")
    ap.add_argument("--draft-layers", type=int, default=2, help="dflash / dspark: decoder layers of the drafter")
    ap.add_argument("--taps", default=None,
                    help="dflash / dspark: the target layers the drafter reads, as output_hidden_states indices (comma "
                         "list; L = the final state after the norm). Default DFlash's rule: 3 evenly spaced over [1, L - 3]")
    ap.add_argument("--anchors", type=int, default=8, help="dflash / dspark: random blocks trained per window and step")
    ap.add_argument("--vocab", type=int, default=8192,
                    help="medusa / eagle / mtp / eagle3 / dflash / dspark: head vocabulary = the N most frequent corpus tokens "
                         "(0 = full vocabulary)")
    ap.add_argument("--features-for", default="",
                    help="build the corpus features for these methods' layers too (comma list, e.g. "
                         "eagle,eagle3,dflash): one pass of the target serves every later run of any of them")
    ap.add_argument("--init", default=None,
                    help="checkpoint path (no suffix) to continue training from: same method, target, head config and "
                         "draft-vocabulary size (see training.warm_start); its steps and corpus go in the new card")
    ap.add_argument("--keep-vocab", action="store_true",
                    help="with --init: draft from the checkpoint's own vocabulary instead of this corpus's top --vocab "
                         "tokens (needed to continue DSpark's Markov head or EAGLE-3's LM head on another corpus)")
    ap.add_argument("--interpolate", default=None, metavar="START",
                    help="no training: the weights (1 - alpha) * START + alpha * INIT, where --init was trained on from "
                         "START (WiSE-FT; training.interpolate), evaluated on the held-out split and written as a "
                         "checkpoint whose card names both")
    ap.add_argument("--alpha", type=float, default=0.5, help="with --interpolate: 0 = START's weights, 1 = INIT's")
    ap.add_argument("--out", default=None, help="checkpoint path without suffix (default data/checkpoints/METHOD)")
    ap.add_argument("--force", action="store_true", help="replace the checkpoint even if held-out acceptance is worse")
    ap.add_argument("--fresh", action="store_true", help="ignore a resumable state from an interrupted run")
    return ap


def main(argv: list[str] | None = None):
    """``argv``: the arguments after ``python -m specbook.train`` (None = the command line); the card records them."""
    args = parser().parse_args(argv)
    run(args.method, args, argv)


if __name__ == "__main__":
    main()
