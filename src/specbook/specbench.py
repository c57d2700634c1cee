"""Spec-Bench (Xia et al. 2024, hemingkx/Spec-Bench): the field's benchmark, run through the one bench harness.

    python -m specbook.specbench --questions PATH/question.jsonl --per-group 5 --out docs/bench/cpu_specbench_t0.json

The question file is read from its path (it is not copied into the repository); ``--questions`` defaults to
``$SPECBOOK_SPEC_BENCH``. The leaderboard reports six groups: multi-turn conversation (MT-bench's 80 questions,
eight categories of ten), translation, summarization, QA, math reasoning and RAG (80 each). A stratified sample
takes ``per_group`` questions of every group (multi-turn: spread over its eight categories), chosen by a seeded
shuffle so the sample is the same on every machine.

Simplification: every question runs its first turn only. Spec-Bench runs MT-bench's second turn after the
model's own first answer; the harness measures single-turn prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

# Spec-Bench's categories -> the leaderboard's six groups (the order of its table)
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = {**{c: "multi-turn" for c in MT_BENCH}, "translation": "translation", "summarization": "summarization",
          "qa": "qa", "math_reasoning": "math", "rag": "rag"}
GROUP_ORDER = ("multi-turn", "translation", "summarization", "qa", "math", "rag")
METHODS = ("sps", "pld", "medusa", "eagle", "eagle2", "eagle3", "mtp", "dflash", "dspark")  # every landed drafter


def load_questions(path: str | Path) -> list[dict]:
    """Read a Spec-Bench question file; refuse anything else with the reason. Each record: an int
    ``question_id``, a ``category`` Spec-Bench uses, a non-empty ``turns`` list of strings."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Spec-Bench question file {path} not found: pass --questions PATH/question.jsonl "
                                "(hemingkx/Spec-Bench data/spec_bench/question.jsonl) or set SPECBOOK_SPEC_BENCH")
    recs = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not Spec-Bench format: not valid JSON ({e})") from e
            if not isinstance(r, dict) or not isinstance(r.get("question_id"), int):
                raise ValueError(f"{path}:{ln}: not Spec-Bench format: each line needs an int 'question_id'")
            if r.get("category") not in GROUPS:
                raise ValueError(f"{path}:{ln}: not Spec-Bench format: category {r.get('category')!r} is not one of "
                                 f"Spec-Bench's {sorted(GROUPS)}")
            turns = r.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{path}:{ln}: not Spec-Bench format: 'turns' must be a non-empty list of strings")
            recs.append(r)
    if not recs:
        raise ValueError(f"{path}: no questions in file")
    return recs


def stratified(questions: list[dict], per_group: int, seed: int = 0) -> list[dict]:
    """``per_group`` questions of every leaderboard group, as bench prompts (``category`` = the group).
    Multi-turn takes its categories round-robin so the sample spans them; within a category the order is a
    shuffle seeded by ``seed``. A group with fewer questions than asked is an error, not a smaller sample."""
    if per_group < 1:
        raise ValueError(f"per_group must be >= 1, got {per_group}")
    rng = random.Random(seed)
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q)
    for qs in by_cat.values():
        rng.shuffle(qs)
    out = []
    for g in GROUP_ORDER:
        cats = [c for c in GROUPS if GROUPS[c] == g and c in by_cat]
        pool = [by_cat[c][i] for i in range(max((len(by_cat[c]) for c in cats), default=0))
                for c in cats if i < len(by_cat[c])]  # round-robin over the group's categories
        if len(pool) < per_group:
            raise ValueError(f"group {g!r} has {len(pool)} questions, fewer than per_group={per_group}")
        out += [{"question_id": q["question_id"], "category": g, "source_category": q["category"],
                 "turns": q["turns"][:1]} for q in pool[:per_group]]
    return out


def leaderboard(result: dict) -> list[dict]:
    """The leaderboard's shape from a bench result: one row per method, speedup and tau per group, and overall."""
    by = {(r["category"], r["method"]): r for r in result["by_category"]}
    rows = []
    for r in result["rows"]:
        m = r["method"]
        if m == "ar":
            continue
        row = {"method": m}
        for g in GROUP_ORDER:
            c = by.get((g, m), {})
            row[g] = (c.get("speedup"), c.get("tau"))
        row["overall"] = (r.get("speedup"), r.get("tau"))
        rows.append(row)
    return rows


def leaderboard_markdown(result: dict) -> str:
    rows = leaderboard(result)
    cols = [*GROUP_ORDER, "overall"]
    lines = ["| method | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for row in rows:
        lines.append(f"| {row['method']} | " + " | ".join(
            f"{s}x ({t})" if s is not None else "" for s, t in (row[c] for c in cols)) + " |")
    return "\n".join(lines) + "\n\nspeedup vs `ar` of the same run (tau = tokens per target forward)"


def main(argv=None):
    from .bench import run_bench, write_result

    ap = argparse.ArgumentParser(prog="python -m specbook.specbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", default=os.environ.get("SPECBOOK_SPEC_BENCH"),
                    help="Spec-Bench's question.jsonl (default: $SPECBOOK_SPEC_BENCH)")
    ap.add_argument("--per-group", type=int, default=5, help="questions per leaderboard group (6 groups)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="fast")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the bench JSON here (python -m specbook.report results "
                                                "puts it on the results page)")
    a = ap.parse_args(argv)
    if not a.questions:
        ap.error("no question file: pass --questions PATH/question.jsonl or set SPECBOOK_SPEC_BENCH")
    prompts = stratified(load_questions(a.questions), a.per_group, a.seed)
    res = run_bench([m.strip() for m in a.methods.split(",") if m.strip()], prompts, dtype=a.dtype,
                    max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    res["settings"]["command"] = "python -m specbook.specbench " + " ".join(
        x for x in (argv if argv is not None else sys.argv[1:]))
    res["settings"]["spec_bench"] = {"file": Path(a.questions).name, "per_group": a.per_group, "seed": a.seed,
                                     "question_ids": [p["question_id"] for p in prompts], "turns": "first only"}
    print(leaderboard_markdown(res))
    write_result(res, a.out)


if __name__ == "__main__":
    main()
