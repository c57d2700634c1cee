"""Collect the SPECBOOK_SUMMARY line each executed notebook prints into one table.

    python -m specbook.report build/notebooks
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


def main(argv=None):
    folder = (argv or sys.argv[1:] or ["build/notebooks"])[0]
    rows = summaries(folder)
    if not rows:
        print(f"no summaries found in {folder}")
        return
    print("\nResults summary")
    for r in rows:
        name = r.pop("notebook")
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    Path(folder, "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
