"""Does compiling a drafter's own forward pay? Each committed drafter's draft cost — the same measurement its
"auto" size prices (EagleRunner.measure_draft_cost, mtp.measure_module_cost, dflash.measure_draft_cost; Medusa: its
heads and top-k) — taken eager and with the head's forward ``torch.compile``d, side by side in one process.

Three compiled sides: fixed shapes (the measured shapes on every call, cache cropped back after each run, so no
recompile is timed: compilation's best case), dynamic shapes (a graph general in the lengths, as drafting needs:
every step meets a new cache length), and frozen (fixed shapes with the target's own settings,
``fastpath.COMPILE_CONFIG``: weights frozen and prepacked, concatenated linears, a C++ wrapper; what DFlash / DSpark's
compiled step uses, its graphs fixed by padding to a few buffer sizes: drafters.block_compiled). Where compiling
does not beat eager, the drafter stays eager on the fast path; the verdict is measured here, per machine, not
assumed.

    python -m specbook.draft_compile --json docs/bench/cpu_bf16_draft_compile.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from .fastpath import COMPILE_CONFIG

HEADS = ("medusa", "eagle", "eagle3", "mtp", "dspark")
# the bench method that drafts with each (its draft ms per step prices the saving on the results page)
METHOD_OF = {"medusa": "medusa", "eagle": "eagle2", "eagle3": "eagle3", "mtp": "mtp", "dspark": "dspark"}


def compiled_copy(module: torch.nn.Module, method: str = "forward", dynamic: bool = False,
                  options: dict | None = None) -> torch.nn.Module:
    """A copy of ``module`` (weights shared) whose ``method`` is torch.compile'd (with inductor ``options``: a
    backend of its own, so its graphs are never another side's); the original stays eager."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)  # the same submodules (weights), in a dict the twin may change alone
    setattr(twin, method, torch.compile(getattr(module, method), dynamic=dynamic, options=options))
    return twin


def _load(target, kind: str, folder: Path | None):
    """The committed drafter network of ``kind`` and its head vocabulary (None where the network holds it)."""
    from .bench import DrafterSettings

    path = (folder or DrafterSettings().folder()) / kind  # a checkpoint without its suffix, as the bench reads it
    if kind == "medusa":
        from .drafters.medusa import load_medusa

        return load_medusa(target, path)[:2]
    if kind == "eagle":
        from .drafters.eagle import load_eagle

        return load_eagle(target, path)[:2]
    if kind == "eagle3":
        from .drafters.eagle3 import load_eagle3

        return load_eagle3(target, path)[0], None
    if kind == "mtp":
        from .drafters.mtp import load_mtp

        return load_mtp(target, path)[:2]
    if kind == "dspark":
        from .drafters.dflash import load_block

        return load_block(target, path, "dspark")[0], None
    raise ValueError(f"unknown drafter {kind!r}; choose from {HEADS}")


def _compiled(kind: str, net, dynamic: bool, options: dict | None = None):
    """The network with its draft forward compiled: the head's forward (Medusa, EAGLE, EAGLE-3), each MTP module's, the
    DFlash / DSpark block's."""
    if kind == "mtp":
        twin = copy.copy(net)
        twin._modules = dict(net._modules)
        twin.mods = torch.nn.ModuleList([compiled_copy(m, dynamic=dynamic, options=options) for m in net.mods])
        return twin
    return compiled_copy(net, "block" if kind == "dspark" else "forward", dynamic, options)


def _cost(target, kind: str, net, vocab, context: int) -> float:
    """Seconds of one draft forward after ``context`` cached positions: the drafter's own cost measurement (Medusa:
    its heads and top-k over the head vocabulary on one hidden state, the whole of its drafting; no context)."""
    if kind == "medusa":
        from .drafters import head_rows
        from .roofline import median_seconds

        W, _ = head_rows(target.get_output_embeddings().weight, vocab)
        h = torch.zeros(W.shape[1], dtype=W.dtype, device=W.device)
        with torch.inference_mode():
            return median_seconds(lambda: (net(h) @ W.T).topk(10, dim=-1))
    from .bench import EagleSettings

    top_k = EagleSettings().top_k  # the tree nodes per draft forward the bench's EAGLE methods expand
    if kind == "eagle":
        from .drafters.eagle import measure_draft_cost

        return measure_draft_cost(target, net, vocab, top_k=top_k, context=context)
    if kind == "eagle3":
        from .drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(target, net, top_k=top_k).measure_draft_cost(context=context)
    if kind == "mtp":
        from .drafters.mtp import measure_module_cost

        return measure_module_cost(target, net, vocab, context=context)
    from .drafters.dflash import measure_draft_cost

    return measure_draft_cost(target, net, context=context)


def probe(target, kinds=HEADS, folder: Path | None = None, repeats: int = 5, context: int = 256) -> list[dict]:
    """Per drafter: the draft-forward cost (ms) eager, compiled for fixed shapes (the measured shapes only: the
    best case), and compiled for dynamic shapes (warmed on another context length first, as drafting meets a
    new cache length every step); medians of ``repeats`` interleaved rounds, and the compile seconds apart."""
    rows = []
    for kind in kinds:
        net, vocab = _load(target, kind, folder)
        sides = {"eager": net, "fixed": _compiled(kind, net, False), "dynamic": _compiled(kind, net, True),
                 "frozen": _compiled(kind, net, False, COMPILE_CONFIG)}
        t0 = time.perf_counter()
        _cost(target, kind, sides["fixed"], vocab, context)  # builds the graph (its seconds apart, never a cost)
        fixed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _cost(target, kind, sides["dynamic"], vocab, context // 2)  # another length: the graph must be general
        dyn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        failed = None
        try:
            with torch.inference_mode():  # freezing folds weights only where no gradient is recorded
                _cost(target, kind, sides["frozen"], vocab, context)
        except Exception as e:  # inductor refuses some graphs with these settings: recorded, not hidden
            failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
            del sides["frozen"]
        frozen_s = time.perf_counter() - t0
        ms = {name: [] for name in sides}
        for _ in range(repeats):  # interleaved rounds: a noisy machine slows every side alike
            for name, m in sides.items():
                ms[name].append(_cost(target, kind, m, vocab, context) * 1e3)
        med = {name: sorted(v)[repeats // 2] for name, v in ms.items()}
        rows.append({"drafter": kind, **{f"{n}_ms": round(med[n], 3) for n in sides},
                     **{f"{n}_over_eager": round(med[n] / med["eager"], 3) for n in sides if n != "eager"},
                     "compile_s": {"fixed": round(fixed_s, 1), "dynamic": round(dyn_s, 1),
                                   **({} if failed else {"frozen": round(frozen_s, 1)})},
                     **({"frozen_failed": failed} if failed else {})})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table of ``probe``'s rows."""
    frozen = any("frozen_ms" in r for r in rows)  # probes written before the frozen side have two sides
    out = ["| drafter | eager ms | compiled, fixed shapes ms | compiled, dynamic shapes ms | "
           + ("compiled, frozen (the target's settings) ms | " if frozen else "") + "fixed / eager | dynamic / eager | "
           + ("frozen / eager | compile s (fixed, dynamic, frozen) |" if frozen else "compile s (fixed, dynamic) |"),
           "|" + "---|" * (9 if frozen else 7)]
    for r in rows:
        c = r["compile_s"]
        out.append(f"| {r['drafter']} | {r['eager_ms']} | {r['fixed_ms']} | {r['dynamic_ms']} | "
                   + (f"{r.get('frozen_ms', 'did not compile')} | " if frozen else "") + f"{r['fixed_over_eager']} | "
                   f"{r['dynamic_over_eager']} | " + (f"{r.get('frozen_over_eager', '')} | " if frozen else "")
                   + ", ".join(str(c[k]) for k in ("fixed", "dynamic", "frozen") if k in c) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    from .models import load_model, machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="fast", help="fast = bf16 on CPU (the bench's default)")
    ap.add_argument("--drafters", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (each a median of 5 forwards)")
    ap.add_argument("--context", type=int, default=256, help="cached positions before the drafted block")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.context < 2:
        raise SystemExit(f"--repeats must be >= 1 and --context >= 2, got {a.repeats} and {a.context}")
    target, _ = load_model(a.model, dtype=a.dtype)
    rows = probe(target, a.drafters, repeats=a.repeats, context=a.context)
    print(table(rows))
    if a.json:
        cmd = "python -m specbook.draft_compile " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        out = {"machine": machine_info(), "settings": {"model": a.model, "dtype": str(target.dtype).replace("torch.", ""),
                                                       "threads": torch.get_num_threads(), "repeats": a.repeats,
                                                       "context": a.context,
                                                       "command": cmd.strip()}, "rows": rows}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
