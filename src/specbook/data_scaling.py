"""Data scaling: held-out acceptance of EAGLE and EAGLE-3 heads against how much training data they saw.

    python -m specbook.data_scaling [--records 3200 --fractions 0.0625,0.25,0.5,1 --methods eagle,eagle3 --steps 400]

EAGLE-3's claim (Li et al. 2025, the scaling figure) is that without EAGLE's feature-regression loss acceptance
keeps rising with data while EAGLE's flattens. Here every run trains a head from scratch through the one training
loop (``python -m specbook.train``) on a nested part of the corpus's train prompts (``--train-fraction``: 1/4 lies
inside 1/2), each with the same steps, batch and learning-rate schedule: runs differ only in how many distinct
tokens they saw (a small part is seen more times over), and all of them are read on the same held-out prompts.

Simplifications, said where the figure is drawn: the corpus is a spread subset of the committed one (``--records``;
0 = all of it) so that one session's CPU time covers six runs, the draft vocabulary is the top tokens of that whole
subset for every fraction (the held-out positions scored are then the same), and the measure is held-out
acceptance at draft steps 1 and 2 (EAGLE: ``top1`` / ``top1_step2``; EAGLE-3: ``acc_0`` / ``acc_1``; both are the
draft's argmax equal to the target's, the step-2 input being the head's own step-1 output), not in-loop tau.

Writes one JSON (every run's held-out evaluations and its card's command) that notebook 05 plots with ``plot``.
The trained heads stay in ``$SPECBOOK_CACHE/scaling`` (not committed); a finished run is reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .prompts import ROOT

OUT = ROOT / "docs" / "scaling" / "eagle_data_scaling.json"
# held-out metric names per method -> (draft step 1, draft step 2)
STEP_METRICS = {"eagle": ("top1", "top1_step2"), "eagle3": ("acc_0", "acc_1")}


def run_argv(method: str, fraction: float, args, out: Path) -> list[str]:
    """The ``python -m specbook.train`` arguments of one run (the same for every fraction but the fraction)."""
    argv = [method, "--records", str(args.records), "--train-fraction", str(fraction), "--steps", str(args.steps),
            "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
            "--warmup", str(args.warmup), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--out", str(out), "--force"]
    if method == "eagle3":
        argv += ["--ttt-steps", str(args.ttt_steps)]
    return argv


def summarize(method: str, fraction: float, card: dict) -> dict:
    """What the figure reads from one run's card."""
    s1, s2 = STEP_METRICS[method]
    pick = [{"step": e["step"], "step1": e[s1], "step2": e[s2]} for e in card["evals"]]
    return {"method": method, "fraction": fraction, "train_records": card["train_records"],
            "train_tokens": card["train_tokens"], "steps": card["steps"], "final": pick[-1], "evals": pick,
            "train_seconds": card["train_seconds"], "corpus_sha": card["corpus_sha"], "command": card["command"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specbook.data_scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="eagle,eagle3")
    ap.add_argument("--fractions", default="0.0625,0.25,0.5,1")
    ap.add_argument("--records", type=int, default=3200, help="spread corpus subset (0 = the whole corpus)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--ttt-steps", type=int, default=4, help="eagle3: as the committed head")
    ap.add_argument("--out", default=str(OUT))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from . import train
    from .models import cache_dir, machine_info

    args = parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in STEP_METRICS]
    if bad:
        raise SystemExit(f"data scaling compares {sorted(STEP_METRICS)}, not {bad}")
    fractions = [float(f) for f in args.fractions.split(",")]
    if any(not 0 < f <= 1 for f in fractions):
        raise SystemExit(f"--fractions must each be in (0, 1], got {fractions}")
    work = cache_dir() / "scaling"
    runs = []
    for f in sorted(fractions):  # the cheap small parts first: a stopped sweep has whole rows of the figure
        for method in methods:
            out = work / f"{method}-r{args.records}-s{args.steps}-f{f:g}" / method
            targv = run_argv(method, f, args, out)
            card_p = out.with_suffix(".json")
            card = json.loads(card_p.read_text()) if card_p.exists() else None
            if card is None or card.get("command") != train.command(targv):
                print(f"[data_scaling] {method} on {f:g} of the train prompts", file=sys.stderr)
                card = train.run(method, train.parser().parse_args(targv), targv)
            runs.append(summarize(method, f, card))
    res = {"command": " ".join(["python -m specbook.data_scaling", *(sys.argv[1:] if argv is None else argv)]),
           "records": args.records, "methods": methods, "fractions": fractions, "runs": runs,
           "machine": machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"[data_scaling] wrote {args.out}")
    return res


def plot(res: dict, axes=None):
    """Left: held-out acceptance at draft steps 1 (solid) and 2 (dashed) against distinct training tokens, one
    line per method. Right: step-1 acceptance along training for each fraction (a small part flattening or
    falling back while a larger one still rises is the data limit)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"eagle": "tab:blue", "eagle3": "tab:red"}
    for m in res["methods"]:
        rs = sorted((r for r in res["runs"] if r["method"] == m), key=lambda r: r["train_tokens"])
        x = [r["train_tokens"] for r in rs]
        axes[0].plot(x, [r["final"]["step1"] for r in rs], "o-", color=colors.get(m), label=f"{m}: draft step 1")
        axes[0].plot(x, [r["final"]["step2"] for r in rs], "s--", color=colors.get(m), label=f"{m}: draft step 2")
        for r in rs:
            axes[1].plot([e["step"] for e in r["evals"]], [e["step1"] for e in r["evals"]], color=colors.get(m),
                         alpha=0.35 + 0.65 * r["fraction"], label=f"{m}, {r['fraction']:g} of the data")
    axes[0].set(xscale="log", xlabel="distinct training tokens", ylabel="held-out acceptance (argmax = target's)",
                title="acceptance vs data (same steps per run)")
    axes[1].set(xlabel="training step", ylabel="held-out acceptance, draft step 1", title="along training")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return axes


if __name__ == "__main__":
    main()
