"""Reports built from what the project measured.

    python -m specbook.report build/notebooks   the SPECBOOK_SUMMARY line each executed notebook prints, one table
    python -m specbook.report results           docs/RESULTS.md from the committed bench JSONs (docs/bench/*.json)
                                                and data-scaling runs (docs/scaling/*.json), and the README's
                                                results table (between its results markers)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TAG = "SPECBOOK_SUMMARY "


def summaries(folder: str | Path) -> list[dict]:
    out = []
    for nb in sorted(Path(folder).glob("[0-9]*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            for o in cell.get("outputs", []):
                text = "".join(o.get("text", "")) if o.get("output_type") == "stream" else ""
                for line in text.splitlines():
                    if line.startswith(TAG):
                        out.append(json.loads(line[len(TAG):]))
    return out


ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "docs" / "bench"
SCALING_DIR = ROOT / "docs" / "scaling"  # python -m specbook.data_scaling
RESULTS = ROOT / "docs" / "RESULTS.md"
README = ROOT / "README.md"
README_RUNS = ("cpu_bf16_t0_compiled.json", "cpu_bf16_t1_compiled.json")  # the README's table: the headline runs
BEGIN, END = "<!-- results:begin (python -m specbook.report results) -->", "<!-- results:end -->"


def _cell(v) -> str:
    return "" if v is None else str(v)


def _run_header(name: str, d: dict) -> str:
    s, m = d["settings"], d["machine"]
    fwd = ""
    if "forward" in s:  # runs that record how the target ran (fastpath.py); earlier runs used transformers' forward
        warm = sum(f.get("warmup_total_s", 0) for f in s.get("fast", {}).values())
        fwd = f", target forward: {s['forward']}" + (f" (compile warm-up {warm:.0f} s, outside every figure)" if warm else "")
    return (f"## {name}\n\n{m.get('cpu', m.get('platform', '?'))}, {m.get('torch_threads', '?')} threads, "
            f"{s['dtype']}, {s['prompts']} prompts x {s['max_new_tokens']} tokens, temperature {s['temperature']}"
            f"{'' if s.get('top_p', 1.0) == 1.0 else ', top-p ' + str(s['top_p'])}{fwd}\n\n"
            f"`{s.get('command', 'run_bench(...) from Python')}`\n" + _checkpoints_line(s) + _latency_line(s))


def _checkpoints_line(s: dict) -> str:
    """The trained drafters a run read, by folder and corpus sha (data/checkpoints/README.md says which corpus each
    sha is), as the run recorded them; a run that recorded none read what data/checkpoints/ held when it ran."""
    ck = s.get("checkpoints")
    if ck is None:
        return "\nCheckpoints: not recorded by this run (it read the drafters data/checkpoints/ held when it ran).\n"
    read = dict.fromkeys(f"{c.get('folder')}/{k} (corpus {c.get('corpus_sha')})" for per in ck.values()
                         for k, c in sorted(per.items()))
    return "\nCheckpoints read: " + (", ".join(read) if read else "none") + ".\n"


def _latency_line(s: dict) -> str:
    """The run's measured target latency(k) / latency(1): what a verification block of k tokens costs."""
    curve = s.get("latency_s_by_forward", {}).get(s.get("forward")) or s.get("latency_s")
    if not curve:
        return ""
    one = curve["1"]  # JSON keys
    ks = sorted(curve, key=int)
    return ("\nTarget forward over k tokens, latency(k) / latency(1): "
            + ", ".join(f"k = {k}: {curve[k] / one:.2f}" for k in ks) + f" (latency(1) = {1e3 * one:.1f} ms)\n")


def draft_free(r: dict) -> float | None:
    """The speedup the method would reach if drafting cost nothing: its measured speedup with each step's draft
    time removed (verification, i.e. the target's forward over the block, and the loop's bookkeeping stay)."""
    d, v = r.get("draft_ms_per_step"), r.get("verify_ms_per_step")
    if not d or not v or not r.get("speedup"):
        return None
    return round(r["speedup"] * (d + v) / v, 2)


def main_table(d: dict) -> str:
    """One run's rows: throughput, speedup against ``ar`` of the same run, tau, where a step's time goes."""
    cols = ["method", "tokens_per_s", "speedup", "tau", "draft_ms_per_step", "verify_ms_per_step"]
    lines = ["| " + " | ".join(cols) + " | speedup if drafting were free |", "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + f" | {_cell(draft_free(r))} |" for r in d["rows"]]
    return "\n".join(lines)


def category_key(c: str) -> tuple:
    """Categories in order: numeric ones (context lengths) by value, then the rest by name."""
    return (0, int(c), "") if c.isdigit() else (1, 0, c)


def category_table(d: dict) -> str:
    """speedup (tau) per category (rows) and method (columns)."""
    methods = [r["method"] for r in d["rows"] if r["method"] != "ar"]
    cats = sorted({r["category"] for r in d.get("by_category", [])}, key=category_key)
    if not cats or not methods:
        return ""
    by = {(r["category"], r["method"]): r for r in d["by_category"]}
    lines = ["| category | " + " | ".join(methods) + " |", "|" + "---|" * (len(methods) + 1)]
    for c in cats:
        cells = []
        for m in methods:
            r = by.get((c, m), {})
            cells.append(f"{r['speedup']}x ({r['tau']})" if r.get("speedup") and r.get("tau") else
                         f"{r['speedup']}x" if r.get("speedup") else "")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checkpoint_pairs(d: dict) -> list[tuple[str, str, str]]:
    """(method, its variant reading another checkpoints folder, that folder) for every ``M[checkpoints=F]`` row of a
    run whose ``M`` also ran: the same method with two sets of trained drafters, side by side."""
    from .bench import parse_variant

    names = [r["method"] for r in d["rows"]]
    out = []
    for n in names:
        base, over = parse_variant(n)
        if set(over) == {("drafters", "checkpoints")} and base in names:
            out.append((base, n, str(over["drafters", "checkpoints"])))
    return out


def _tau(rows: list[dict]) -> float | None:
    forwards = sum(r.get("target_forwards") or 0 for r in rows)
    return round(sum(r["new_tokens"] for r in rows) / forwards, 3) if forwards else None


LOSS_BAR = -0.05  # the bar a retrained drafter is held to: at most 5% less tau in any category


def change_interval(d: dict, a: str, b: str, group: list[str], draws: int = 2000, level: float = 0.95,
                    seed: int = 0, per: str = "target_forwards") -> tuple[float, float] | None:
    """A paired bootstrap interval for tau(b) / tau(a) - 1 (``per="seconds"``: tokens per second instead of per
    target forward) pooled over the prompts of ``group``'s categories: each draw resamples the prompts with
    replacement within each category, and both methods keep the same draw (they ran the same prompts, so each
    prompt's pair stays together and what the two share cancels). None for a run without per-prompt counts
    (``by_prompt``: bench JSONs older than it) or without both methods' counts."""
    import numpy as np

    bp = d.get("by_prompt") or {}
    meth = bp.get("methods", {})
    if a not in meth or b not in meth or None in meth[a].get(per, [None]) + meth[b].get(per, [None]):
        return None
    cats = np.array(bp["categories"])
    idx = [i for c in group if len(i := np.flatnonzero(cats == c))]
    if not idx:
        return None
    ta, fa, tb, fb = (np.asarray(meth[m][k], dtype=float) for m in (a, b) for k in ("new_tokens", per))
    rng = np.random.default_rng(seed)
    picks = np.concatenate([rng.choice(i, size=(draws, len(i))) for i in idx], axis=1)  # [draws, prompts of group]
    change = (tb[picks].sum(1) / fb[picks].sum(1)) / (ta[picks].sum(1) / fa[picks].sum(1)) - 1
    lo, hi = np.quantile(change, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


# methods an issue's target compares with a rival in the same run: (rival, method)
VERSUS = (("eagle2", "dspark"), ("eagle2", "eagle3"))


def versus_lines(d: dict) -> str:
    """For each VERSUS pair in a run: the method's tokens/s and tau against its rival's, each with a paired
    bootstrap interval over the run's prompts (``change_interval``)."""
    rows = {r["method"]: r for r in d["rows"]}
    cats = sorted(set((d.get("by_prompt") or {}).get("categories", [])))
    out = []
    for a, b in VERSUS:
        if a in rows and b in rows:
            speed = _change_cell(rows[a]["tokens_per_s"], rows[b]["tokens_per_s"],
                                 change_interval(d, a, b, cats, per="seconds"))
            tau = _change_cell(rows[a]["tau"], rows[b]["tau"], change_interval(d, a, b, cats))
            out.append(f"- {b} against {a} in this run: tokens/s {speed}, tau {tau} (95% paired bootstrap interval "
                       "over the prompts)")
    return "\n".join(out) + "\n" if out else ""


def _change_cell(old: float | None, new: float | None, ci: tuple[float, float] | None) -> str:
    if not (old and new):
        return ""
    return f"{100 * (new / old - 1):+.1f}%" + (f" [{100 * ci[0]:+.0f}, {100 * ci[1]:+.0f}]" if ci else "")


def checkpoint_table(d: dict) -> str:
    """tau per category for each method against the same method reading another folder's checkpoints
    (``checkpoint_pairs``): the method's own drafters first, the folder's second (the retrained ones), the change
    from the first to the second in percent, and both pooled over the template categories and over the broad ones
    (prompts.TEMPLATE_CATEGORIES), and each pair's worst category. Record counts do not order the pair: a drafter
    trained on a spread subset of a larger corpus has fewer records than one trained on all of a smaller corpus."""
    from .prompts import TEMPLATE_CATEGORIES

    found = checkpoint_pairs(d)
    cats = sorted({r["category"] for r in d.get("by_category", [])}, key=category_key)
    if not found or not cats:
        return ""
    pairs = [(m, v) for m, v, _ in found]  # (the method's own drafters, the folder's)
    by = {(r["category"], r["method"]): r for r in d["by_category"]}
    head = "| category |" + "".join(f" {a} | {b} | change |" for a, b in pairs)
    lines = [head, "|" + "---|" * (1 + 3 * len(pairs))]

    def pooled(method: str, group: list[str]) -> float | None:
        return _tau([by[c, method] for c in group if (c, method) in by])

    def row(label: str, group: list[str]) -> str:
        cells = []
        for a, b in pairs:
            old, new = pooled(a, group), pooled(b, group)
            cells.append(f" {_cell(old)} | {_cell(new)} | {_change_cell(old, new, change_interval(d, a, b, group))} |")
        return f"| {label} |" + "".join(cells)

    lines += [row(c, [c]) for c in cats]
    template = [c for c in cats if c in TEMPLATE_CATEGORIES]
    broad = [c for c in cats if c not in TEMPLATE_CATEGORIES]
    groups = ((("every context length", cats),) if all(c.isdigit() for c in cats)  # a long-context sweep
              else (("template categories", template), ("broad categories", broad)))
    lines += [row(f"**{name}** ({len(group)})", group) for name, group in groups if group]  # a run of one kind: no empty row
    ratios = []
    for a, b in pairs:
        bt = {x: (pooled(x, broad), pooled(x, template)) for x in (b, a)}
        if all(x and y for x, y in bt.values()):
            ratios.append(", ".join(f"{x} {bt[x][0] / bt[x][1]:.2f}" for x in (b, a)))
    worst, beyond = [], []  # each pair's worst category; the losses past LOSS_BAR beyond their interval
    for a, b in pairs:
        changes = [(pooled(b, [c]) / pooled(a, [c]) - 1, c) for c in cats if pooled(a, [c]) and pooled(b, [c])]
        if changes:
            loss, cat = min(changes)
            worst.append(f"{b} {cat} {100 * loss:+.1f}%")
        for loss, cat in sorted(changes):
            if loss < LOSS_BAR and (ci := change_interval(d, a, b, [cat])):
                beyond += [f"{b} {cat} {_change_cell(1, 1 + loss, ci)}"] if ci[1] < LOSS_BAR else []
    intervals = d.get("by_prompt") is not None
    ck = d["settings"].get("checkpoints", {})
    read = list(dict.fromkeys(f"`{n}` read {c.get('folder')}/{k} (corpus {c.get('corpus_sha')}, {_records_label(c)}, "
                              f"{_steps_label(c)})"
                              for a, b in pairs for n in (a, b) for k, c in ck.get(n, {}).items()))
    return ("tau per category: each method with two sets of trained drafters, its own (data/checkpoints) first and "
            "then those of another folder (change = second / first - 1; the checkpoints each read, with the corpus "
            "each was trained on, are listed below the table)."
            + (" In brackets: a 95% interval for the change in percent, a paired bootstrap over the prompts (2000 "
               "draws, prompts resampled within each category, both methods on the same draw)." if intervals else "")
            + "\n\n" + "\n".join(lines)
            + ("\n\ntau over the broad categories / over the template categories: " + "; ".join(ratios) if ratios else "")
            + ("\n\nworst per-category change, second against first: " + "; ".join(worst) if worst else "")
            + (f"\n\nlosses of more than {-100 * LOSS_BAR:g}% whose whole interval lies below -{-100 * LOSS_BAR:g}%: "
               + ("; ".join(beyond) if beyond else "none") if intervals and worst else "")
            + (f"\n\n{'; '.join(read)}.\n" if read else "\n"))


def _records_label(c: dict) -> str:
    """A checkpoint's corpus record count, or that its card does not say (cards older than the field)."""
    return f"{c['corpus_records']} records" if c.get("corpus_records") is not None else "record count not on its card"


def _steps_label(c: dict) -> str:
    """A checkpoint's training steps; a warm-started one shows the steps its starting weights had first; an
    interpolated one (``train --interpolate``) the point between its two ends."""
    if mix := c.get("interpolated"):
        return (f"no training: weights {mix['alpha']:g} of the way from a {mix['start_steps']}-step checkpoint to the "
                f"{c.get('init_steps')} steps trained on from it")
    return (f"{c.get('steps')} steps, warm-started from a {c['init_steps']}-step checkpoint" if c.get("init_steps")
            else f"{c.get('steps')} steps")


def _survival_calibration(cal, mode: str) -> str:
    """A serving run's drafter calibration in words: DSpark's per-position temperatures (and shifts: the in-loop
    fit, ``{"temperatures", "shifts"}``; older runs recorded the temperatures alone) for the run's sampling mode,
    or an EAGLE chain's factor."""
    if isinstance(cal, float):
        return f"x {cal:.3f}"
    if not isinstance(cal, dict):
        return "none"
    temps, shifts = (cal.get("temperatures"), cal.get("shifts")) if "temperatures" in cal else (cal, None)
    if not temps or mode not in temps:
        return "none"
    out = f"per-position temperatures ({mode}) {', '.join(f'{t:.2f}' for t in temps[mode])}"
    return out + (f" and shifts {', '.join(f'{b:+.1f}' for b in shifts[mode])}" if shifts and shifts.get(mode) else "")


def serving_section(name: str, d: dict) -> str:
    """A serving sweep (``python -m specbook.serving bench``): every policy at every concurrency, and how close the
    trace-driven simulator comes to those real runs."""
    from .serving import markdown, sim_rows, validate

    s, m = d["settings"], d["machine"]
    head = (f"## {name}\n\n{m.get('cpu', m.get('platform', '?'))}, {s.get('threads', '?')} threads, {s['dtype']}, "
            f"{s.get('drafter', '?')} drafter (gamma {s['gamma']}), closed loop of max({s['requests_per_level']} x c, "
            f"{s['min_requests']}) requests x {s['max_new_tokens']} tokens, temperature {s['temperature']}\n\n"
            f"`{s.get('command', 'run_sweep(...) from Python')}`\n")
    rows = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in d["rows"]]
    errs = sorted(abs(v["error"]) for v in validate(d)) if d["traces"] else []
    sim = (f"Simulator (`serving.simulate`: these traces; each concurrency's runs simulated with costs fitted to the "
           f"other concurrencies' runs) against these runs: median error {100 * errs[len(errs) // 2]:.1f}%, worst "
           f"{100 * errs[-1]:.1f}% over {len(errs)} runs.\n") if errs else (
        f"No full-block run (fixed:{s['gamma']}) in this sweep, so no acceptance traces: the simulator is not "
        "validated against it.\n")
    if ck := s.get("drafter_checkpoint"):
        cal = _survival_calibration(ck.get("calibration"), "greedy" if s["temperature"] == 0 else "sampled")
        head += (f"\nDrafter: {ck['checkpoint']} (corpus {ck.get('corpus_sha')}, {ck.get('steps')} steps); survival "
                 f"calibration: {cal}.\n")
    warm = sum(f.get("warmup_total_s", 0) for f in s.get("fast", {}).values())
    if warm:
        head += (f"\nCompiled graphs built before the clock: {warm:.0f} s (every reachable bucket, with and without "
                 "hidden states, at each row capacity), outside every figure.\n")
    return head + "\n" + markdown(rows) + "\n\n" + _policy_ratios(sim_rows(d)) + _forward_ratios(d["rows"]) + sim


def ceiling_section(name: str, d: dict) -> str:
    """``python -m specbook.serving ceiling``: an oracle scheduler's throughput over no speculation, SIMULATED with a
    serving sweep's fitted costs, on its recorded drafts and on hypothetical drafters."""
    from .serving import ceiling_markdown

    s, m = d["settings"], d["machine"]
    return (f"## {name}\n\nSIMULATED from `{d['source']}` ({m.get('cpu', m.get('platform', '?'))}, "
            f"{s.get('drafter', '?')} drafter, gamma {s['gamma']}; the sweep ran {s['sweep_max_new_tokens']} tokens "
            "per request): the costs fitted to its real runs, an oracle that knows each drafted token's fate before "
            "verifying it (the count of accepted tokens per step that maximises Theta), on the sweep's recorded "
            "drafts and on drafters of per-token acceptance alpha, with the measured drafting cost and with "
            f"drafting free. A real scheduler does not know the fates and verifies some tokens that are then rejected; "
            f"the oracle never does, so its row is what the drafts allow at best.\n\n`{s['command']}`\n\n"
            + ceiling_markdown(d["rows"]))


def _policy_ratios(rows: list[dict]) -> str:
    """Where Algorithm 1 sits in one forward mode's rows (``serving.sim_rows``: the sweep's first): at the highest
    concurrency its throughput over no speculation and over the longest fixed k; at the lowest, over the best fixed k;
    and the concurrencies at which each fixed k falls below no speculation."""
    by = {(r["concurrency"], r["policy"]): r["throughput"] for r in rows}
    cs = sorted({c for c, _ in by})
    fixed = sorted({p for _, p in by if p.startswith("fixed:")}, key=lambda p: int(p.split(":")[1]))
    if not cs or not fixed or any((c, p) not in by for c in (cs[0], cs[-1]) for p in ("none", "alg1")):
        return ""
    hi, lo = cs[-1], cs[0]
    best = max(fixed, key=lambda p: by.get((lo, p), 0.0))
    under = {p: [str(c) for c in cs if by.get((c, p), float("inf")) < by.get((c, "none"), 0.0)] for p in fixed}
    below = "; ".join(f"{p} at c = {', '.join(v)}" if v else f"{p} at no level" for p, v in under.items())
    return (f"Algorithm 1 at c = {hi}: {by[(hi, 'alg1')] / by[(hi, 'none')]:.2f}x no speculation, "
            f"{by[(hi, 'alg1')] / by[(hi, fixed[-1])]:.2f}x {fixed[-1]}; at c = {lo}: "
            f"{by[(lo, 'alg1')] / by[(lo, best)]:.2f}x the best fixed k ({best}). "
            f"Fixed k below no speculation: {below}.\n\n")


def _forward_ratios(rows: list[dict]) -> str:
    """In a sweep of several forward modes: each later mode's throughput over the first's, per concurrency and policy."""
    modes = list(dict.fromkeys(r["forward"] for r in rows if "forward" in r))
    if len(modes) < 2:
        return ""
    by = {(r["concurrency"], r["policy"], r["forward"]): r["throughput"] for r in rows}
    parts = []
    for m in modes[1:]:
        cells = [f"c={c} {p} {by[(c, p, m)] / by[(c, p, modes[0])]:.2f}x" for (c, p, f) in by if f == modes[0]
                 and (c, p, m) in by]
        parts.append(f"Throughput {m} / {modes[0]}: " + ", ".join(cells) + ".\n\n")
    return "".join(parts)


def same_cpu_headline(cpu: str | None, bench_dir: Path = BENCH_DIR) -> tuple[str, dict] | None:
    """The T = 0 compiled-forward bench run made on ``cpu`` (the README's headline first, then any other
    ``*_t0_compiled*.json``), or None: a saving measured on one machine is only priced against a step of the same."""
    names = [README_RUNS[0], *sorted(f.name for f in Path(bench_dir).glob("*_t0_compiled*.json"))]
    for n in dict.fromkeys(names):
        f = Path(bench_dir) / n
        if f.exists() and (d := json.loads(f.read_text()))["machine"].get("cpu") == cpu:
            return n, d
    return None


def draft_compile_section(name: str, d: dict, bench_dir: Path = BENCH_DIR) -> str:
    """The drafters' own forwards eager vs compiled (``python -m specbook.draft_compile``), and what the saving
    would buy a whole step of a T = 0 compiled run on the same CPU: (1 - compiled / eager) x draft ms / step ms, the
    compiled cost being the better of fixed shapes' and, where the probe measured it, the frozen side's."""
    from .draft_compile import METHOD_OF, table

    s, m = d["settings"], d["machine"]
    found = same_cpu_headline(m.get("cpu"), bench_dir)
    steps = {r["method"]: r for r in found[1]["rows"]} if found else {}
    gains = []
    for r in d["rows"]:
        st = steps.get(METHOD_OF[r["drafter"]])
        if st and st.get("draft_ms_per_step") is not None:
            ratio = min(r["fixed_over_eager"], r.get("frozen_over_eager") or r["fixed_over_eager"])
            saved = max(0.0, 1 - ratio) * st["draft_ms_per_step"]  # compiled slower: nothing to gain
            gains.append(f"{METHOD_OF[r['drafter']]} {100 * saved / (st['draft_ms_per_step'] + st['verify_ms_per_step']):.1f}%")
    side = "better of the fixed-shape and frozen" if any("frozen_over_eager" in r for r in d["rows"]) else "fixed-shape"
    read = (f"\nAt most this share of a step of {found[0]} (its draft and verify ms per step) would go if the "
            f"drafter's forwards ran at the {side} compiled cost: " + ", ".join(gains) + ".\n") if gains else (
        "\nNo T = 0 compiled-forward bench run on this CPU: no share of a step is computed.\n")
    return (f"## {name}\n\n{m.get('cpu', m.get('platform', '?'))}, {s['threads']} threads, {s['dtype']}, one draft "
            f"forward after {s['context']} cached positions (each drafter's own cost measurement), medians of "
            f"{s['repeats']} interleaved rounds; compile seconds outside every figure (small when the inductor "
            f"cache already holds the graph)\n\n`{s['command']}`\n\n" + table(d["rows"]) + "\n" + read)


def scaling_section(name: str, d: dict) -> str:
    """A data-scaling run (specbook.data_scaling): held-out acceptance of each head at the end of training and its
    best along training, per part of the train prompts."""
    lines = [f"## {name}\n", f"`{d['command']}`\n",
             f"Heads trained from scratch, the same steps each, on nested parts of the train prompts of a "
             f"{d['records'] or 'whole'}-record corpus; acceptance = the draft's argmax equals the target's on the "
             f"held-out prompts (the same for every part), draft step 2 reading the head's own step-1 output.\n",
             "| method | part | train records | train tokens | steps | step 1 (final) | step 2 (final) | step 1 (best) "
             "| train s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        best = max(e["step1"] for e in r["evals"])
        lines.append(f"| {r['method']} | {r['fraction']:g} | {r['train_records']} | {r['train_tokens']} | {r['steps']} "
                     f"| {r['final']['step1']:.3f} | {r['final']['step2']:.3f} | {best:.3f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def results_page(bench_dir: Path = BENCH_DIR, scaling_dir: Path = SCALING_DIR) -> str:
    """docs/RESULTS.md: every committed bench JSON, newest layout first by file name, then the data-scaling runs."""
    parts = ["# Results\n",
             "Generated by `python -m specbook.report results` from the bench JSONs in `docs/bench/` (and the "
             "data-scaling runs in `docs/scaling/`, at the end); every run's "
             "command is shown above its table and reproduces it. Speedup is tokens/s against our own "
             "autoregressive loop (`ar`) measured in the same run; tau = tokens per target forward (the prefill "
             "and the bonus / correction token included). Per category: speedup (tau). Below each command: the trained "
             "checkpoints the run read, by folder and corpus sha; a rerun reads what those folders hold now "
             "(data/checkpoints/README.md says which corpus each sha is and where earlier drafters are kept).\n"]
    for f in sorted(Path(bench_dir).glob("*.json")):
        d = json.loads(f.read_text())
        if "traces" in d:  # a serving sweep
            parts.append(serving_section(f.stem, d))
            continue
        if d.get("ceiling"):  # the serving sweep's simulated ceiling
            parts.append(ceiling_section(f.stem, d))
            continue
        if d["settings"].get("command", "").startswith("python -m specbook.draft_compile"):
            parts.append(draft_compile_section(f.stem, d))
            continue
        parts.append(_run_header(f.stem, d))
        parts.append(main_table(d) + "\n")
        if vs := versus_lines(d):
            parts.append(vs)
        cat = category_table(d)
        if cat:
            parts.append(cat + "\n")
        ck = checkpoint_table(d)
        if ck:
            parts.append(ck)
    for f in sorted(Path(scaling_dir).glob("*.json")):
        parts.append(scaling_section(f.stem, json.loads(f.read_text())))
    return "\n".join(parts)


def readme_block(bench_dir: Path = BENCH_DIR) -> str:
    """The README's results table: the headline runs' speedup (tau) per method, one column per run."""
    runs = [(n, json.loads((Path(bench_dir) / n).read_text())) for n in README_RUNS]
    methods = list(dict.fromkeys(r["method"] for _, d in runs for r in d["rows"]))
    cpus = [d["machine"].get("cpu", "?") for _, d in runs]
    heads = [f"T = {d['settings']['temperature']}, {d['settings']['dtype']}"
             + (f", {d['settings']['forward']} forward" if "forward" in d["settings"] else "")
             + (f", {c}" if len(set(cpus)) > 1 else "") for (_, d), c in zip(runs, cpus)]  # runs on two CPUs
    lines = ["| method | " + " | ".join(heads) + " |", "|" + "---|" * (len(runs) + 1)]
    for m in methods:
        cells = []
        for _, d in runs:
            r = next((x for x in d["rows"] if x["method"] == m), None)
            cells.append("" if r is None else f"{r['speedup']}x" + (f" ({r['tau']})" if r.get("tau") else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    where = f"{cpus[0]}; " if len(set(cpus)) == 1 else ""
    src = ", ".join(f"[{n}](docs/bench/{n})" for n, _ in runs)
    return (f"{BEGIN}\n" + "\n".join(lines) + f"\n\nspeedup vs `ar` (tau); {where}from {src} (docs/RESULTS.md "
            f"names the checkpoints each run read).\n{END}")


def with_readme_block(readme: str, block: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README has no results markers ({BEGIN} ... {END}): add them where the table goes")
    i, j = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:i] + block + readme[j:]


def write_results() -> None:
    RESULTS.write_text(results_page())
    README.write_text(with_readme_block(README.read_text(), readme_block()))
    print(f"wrote {RESULTS.relative_to(ROOT)} and the README's results table")


def main(argv=None):
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["results"]:
        write_results()
        return
    folder = (args or ["build/notebooks"])[0]
    rows = summaries(folder)
    if not rows:
        print(f"no summaries found in {folder}")
        return
    smoke = [r["notebook"] for r in rows if r.get("fast")]
    if smoke:
        print(f"\nSmoke-run summary (SPECBOOK_FAST=1 in {', '.join(smoke)}): one prompt, a few tokens — these figures "
              "show each notebook ran, they are not results. Full-size: bash scripts/tour.sh (no --quick); measured "
              "results: docs/RESULTS.md")
    else:
        print("\nResults summary (full-size notebook runs)")
    for r in rows:
        name = r.pop("notebook")
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    Path(folder, "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
