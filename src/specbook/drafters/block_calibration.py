"""DSpark's survival, calibrated where the scheduler spends it: in the decoding loop.

The card's calibration (``dflash.calibrate``, DSpark's sequential temperature scaling) is fitted on teacher-forced
held-out blocks: a block at EVERY response position. The loop drafts a block only where the previous step stopped,
and a step stops at a rejection, so the loop's anchors sit at harder positions than the average one: its first
token survives less often than the held-out average, and a survival calibrated on every position is over-confident
there (notebook 06, section 5). A temperature cannot remove that gap: it rescales z, it does not move the mean.
This module refits the survival on blocks the loop itself drafted:

1. trace full blocks (no cut) at T = 0 and T = 1 on the **held-out prompts of the checkpoint's own training split**
   (``training.prompt_split`` of the corpus its card names: never trained on, never the eval prompts);
2. per block, the confidence logits z_k and the outcome o_k = [the target kept tokens 1..k] (hard 0/1);
3. ``sequential_platt_scaling``: per position, left to right, a temperature and a shift by log loss (mode "greedy"
   from the T = 0 traces, "sampled" from T = 1); DSpark's temperature-only fit on the same blocks is kept beside
   it in the report, to show what the shift adds;
4. report ECE / Brier / AUROC per position on eval prompts (held out) before and after.

The result goes into the card as ``calibration.in_loop`` (the teacher-forced fit stays beside it);
``card_calibration`` is the one place that picks what a drafter uses.

    python -m specbook.drafters.block_calibration --checkpoint data/checkpoints/dspark

Where we simplify: the traces draft the full block; a drafter that cuts starts its next step after a token it did
not verify rather than after a rejection, so its anchors are slightly easier than the traced ones, and the fit is
slightly pessimistic for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

MODES = {"greedy": 0.0, "sampled": 1.0}  # the calibration mode -> the temperature its traces decode at


SOURCES = ("card", "held_out", "none")  # what a drafter's survival reads (bench knob ``dspark[calibration=...]``)


def calibration_source(card: dict, source: str = "card") -> str:
    """Which fit ``source`` resolves to for this card: "in_loop", "held_out" (DSpark's teacher-forced temperatures)
    or "none". "card" = the in-loop fit when the card has one, else the held-out temperatures, else none."""
    if source not in SOURCES:
        raise ValueError(f"dspark calibration must be one of {SOURCES}, got {source!r}")
    cal = card.get("calibration") or {}
    if source == "card":
        source = "in_loop" if (cal.get("in_loop") or {}).get("temperatures") else "held_out"
    return "none" if source == "held_out" and not cal.get("temperatures") else source


def card_calibration(card: dict, source: str = "card") -> dict:
    """The BlockDrafter keyword arguments ``temperatures`` / ``shifts`` (per sampling mode) that ``source`` reads
    from a card (``calibration_source``); uncalibrated = both None."""
    cal = card.get("calibration") or {}
    which = calibration_source(card, source)
    if which == "in_loop":
        return {"temperatures": cal["in_loop"]["temperatures"], "shifts": cal["in_loop"].get("shifts")}
    return {"temperatures": cal.get("temperatures") if which == "held_out" else None, "shifts": None}


def loop_outcomes(steps: list[dict], gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``trace_blocks`` steps -> (z [N, gamma], o [N, gamma]) over the N steps that drafted the full block:
    the confidence logits and o_k = 1 when the target kept tokens 1..k of the block."""
    full = [s for s in steps if len(s["z"]) == gamma and len(s["tokens"]) == gamma]
    if not full:
        return torch.zeros(0, gamma, dtype=torch.float64), torch.zeros(0, gamma, dtype=torch.float64)
    z = torch.tensor([s["z"] for s in full], dtype=torch.float64)
    o = torch.tensor([[float(s["accepted"] >= k) for k in range(1, gamma + 1)] for s in full], dtype=torch.float64)
    return z, o


def trace_outcomes(target, net, prompt_ids: list[torch.Tensor], temperature: float, *, max_new_tokens: int,
                   eos_token_id=None, seed: int = 0, desc: str = "trace") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every prompt once with the full block (no cut) and collect ``loop_outcomes`` over all of them.
    Prompt i samples from generator seed + i (T > 0), so a rerun draws the same blocks."""
    from tqdm.auto import tqdm

    from ..sampling import SamplingConfig, make_generator
    from .dflash import BlockDrafter, trace_blocks

    if net.confidence is None:
        raise ValueError("in-loop calibration needs DSpark's confidence head; this drafter has none (DFlash)")
    cfg = SamplingConfig(temperature)
    zs, os_ = [], []
    for i, ids in enumerate(tqdm(prompt_ids, desc=f"{desc} T={temperature:g}", leave=False)):
        d = BlockDrafter(target, net)  # uncalibrated (t = 1): the raw z is what is fitted
        steps, _ = trace_blocks(target, d, ids, max_new_tokens=max_new_tokens, sampling=cfg,
                                generator=None if cfg.greedy else make_generator(seed + i), eos_token_id=eos_token_id)
        z, o = loop_outcomes(steps, net.gamma)
        zs.append(z)
        os_.append(o)
    return torch.cat(zs), torch.cat(os_)


def calibrate_in_loop(target, net, fit_ids: list[torch.Tensor], report_ids: list[torch.Tensor], *,
                      max_new_tokens: int = 96, eos_token_id=None) -> dict:
    """Steps 1-4 of the module docstring -> the card's ``calibration.in_loop`` (without the command)."""
    from .dflash import calibration_report, sequential_platt_scaling, sequential_temperature_scaling

    out = {"fit_prompts": len(fit_ids), "report_prompts": len(report_ids), "max_new_tokens": max_new_tokens,
           "fit_blocks": {}, "report_blocks": {}, "temperatures": {}, "shifts": {}, "before": {}, "after": {},
           "temperature_only": {}}
    for mode, temp in MODES.items():
        z_fit, o_fit = trace_outcomes(target, net, fit_ids, temp, max_new_tokens=max_new_tokens,
                                      eos_token_id=eos_token_id, desc="fit")
        z_rep, o_rep = trace_outcomes(target, net, report_ids, temp, max_new_tokens=max_new_tokens,
                                      eos_token_id=eos_token_id, desc="report")
        if len(z_fit) == 0 or len(z_rep) == 0:
            raise ValueError(f"no full blocks were drafted at T = {temp:g}: use more prompts or --max-new-tokens")
        temps, shifts = sequential_platt_scaling(z_fit, o_fit)
        t_only = sequential_temperature_scaling(z_fit, o_fit)
        out["fit_blocks"][mode], out["report_blocks"][mode] = len(z_fit), len(z_rep)
        out["temperatures"][mode], out["shifts"][mode] = temps, shifts
        out["before"][mode] = calibration_report(z_rep, o_rep, [1.0] * net.gamma)
        out["after"][mode] = calibration_report(z_rep, o_rep, temps, shifts)
        out["temperature_only"][mode] = {"temperatures": t_only, **calibration_report(z_rep, o_rep, t_only)}
    return out


def heldout_prompt_ids(card: dict, corpus_dir=None, limit: int | None = None) -> list[torch.Tensor]:
    """The prompts the checkpoint held out of its training: its card's corpus (``train --records``'s subset when it
    trained on one), split as training split it (``training.prompt_split``, the card's seed); one prompt per held-out
    prompt group (its first record's prompt tokens), at most ``limit``."""
    from ..corpus import CORPUS_DIR, load_corpus
    from ..train import training_corpus
    from ..training import prompt_split

    full = load_corpus(CORPUS_DIR if corpus_dir is None else corpus_dir)
    n = int(card.get("corpus_records", len(full)))
    corpus = training_corpus(full, n if n < len(full) else 0)
    if corpus.sha != card.get("corpus_sha"):
        raise ValueError(f"the checkpoint was trained on corpus {card.get('corpus_sha')}, but {n} records of the corpus "
                         f"here are {corpus.sha}: calibrate with the corpus it was trained on (--corpus)")
    held, _ = prompt_split(corpus, seed=int(card.get("train_config", {}).get("seed", 0)))
    out = [torch.as_tensor(corpus.sequence(grp[0])[:corpus.prompt_len(grp[0])].astype("int64"))[None] for grp in held]
    return out[:limit]


def eval_prompt_ids(tokenizer, n: int, device=None) -> list[torch.Tensor]:
    """The first ``n`` eval prompts (first turn, chat template), as notebook 06 and the bench read them."""
    from ..decoding import encode
    from ..prompts import load_prompts

    return [encode(tokenizer, p["turns"][0], device=device)[0] for p in load_prompts("eval", limit=n)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specbook.drafters.block_calibration",
                                 description="Fit a DSpark checkpoint's survival on in-loop traces of the prompts "
                                             "its training held out; report on eval prompts; write the card.")
    ap.add_argument("--checkpoint", default="data/checkpoints/dspark", help="checkpoint path (without suffix)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="fast", help="the dtype the loop runs in (the bench's: fast)")
    ap.add_argument("--fit", type=int, default=0, help="held-out prompts of the checkpoint's training split traced "
                                                       "for the fit (0 = all of them)")
    ap.add_argument("--corpus", default=None, help="the corpus the checkpoint was trained on (default data/corpus)")
    ap.add_argument("--report", type=int, default=24, help="eval prompts traced for the before / after report")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dry-run", action="store_true", help="print the result, leave the card as it is")
    return ap


def main(argv=None) -> dict:
    from ..models import load_model
    from .dflash import load_block

    args = parser().parse_args(argv)
    for name in ("fit", "report", "max_new_tokens"):
        if getattr(args, name) < (0 if name == "fit" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {0 if name == 'fit' else 1}, got {getattr(args, name)}")
    target, tok = load_model(args.model, dtype=args.dtype)
    path = Path(args.checkpoint)
    net, card = load_block(target, path, "dspark")
    t0 = time.time()
    fit = [ids.to(target.device) for ids in heldout_prompt_ids(card, args.corpus, args.fit or None)]
    rep = eval_prompt_ids(tok, args.report, target.device)
    res = calibrate_in_loop(target, net, fit, rep, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    res["dtype"] = str(target.dtype).replace("torch.", "")
    res["seconds"] = round(time.time() - t0, 1)
    res["command"] = " ".join(["python", "-m", "specbook.drafters.block_calibration", *(sys.argv[1:] if argv is None
                                                                                        else argv)])
    for mode in MODES:
        print(f"{mode}: ECE per position before {[round(x, 3) for x in res['before'][mode]['ece']]} -> after "
              f"{[round(x, 3) for x in res['after'][mode]['ece']]} ({res['report_blocks'][mode]} held-out blocks)")
    if not args.dry_run:
        cj = path.with_suffix(".json")
        card = json.loads(cj.read_text())  # the card as written (weights and their sha untouched)
        card.setdefault("calibration", {})["in_loop"] = res
        cj.write_text(json.dumps(card, indent=1, default=str))
        print(f"wrote calibration.in_loop into {cj}")
    return res


if __name__ == "__main__":
    main()
