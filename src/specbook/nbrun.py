"""Execute notebooks in full and write their outputs back: ``python -m specbook.nbrun notebooks/06_dspark.ipynb``
(``--out DIR`` writes the executed copies there instead; each kernel runs in its notebook's own directory).

``jupyter nbconvert --execute`` waits for the kernel's reply to every cell. After a cell that opens ipywidgets
comms that reply sometimes never reaches the client although the kernel has run the cell to the end and reported
itself idle (an open nbclient / nbconvert bug, seen here with ipykernel 7), and nbconvert then waits forever.
This runner is nbclient with one change: once the kernel has reported a cell idle and every output has arrived,
a reply that has not come ``grace_s`` seconds later is taken as lost. The cell counts as done, with the status
its outputs show (an error output still fails the run), and stderr says which cell it was. Everything else —
outputs, execution counts, timing metadata, widget state — is what nbconvert writes.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from nbclient import NotebookClient


def lost_reply(msg_id: str, outputs: list[dict]) -> dict:
    """The execute reply a finished cell would have sent: ok, or the error its outputs hold."""
    err = next((o for o in outputs if o.get("output_type") == "error"), None)
    content = {"status": "ok"} if err is None else {
        "status": "error", "ename": err.get("ename", ""), "evalue": err.get("evalue", ""),
        "traceback": err.get("traceback", [])}
    return {"content": content, "parent_header": {"msg_id": msg_id}, "lost": True}


class PatientClient(NotebookClient):
    """nbclient's client that does not wait forever for a reply the kernel's idle status says is due."""

    def __init__(self, nb, grace_s: float = 60.0, **kw):
        super().__init__(nb, **kw)
        self.grace_s = grace_s
        self.lost: list[int] = []  # cells whose reply never came

    async def _async_poll_for_reply(self, msg_id, cell, timeout, task_poll_output_msg, task_poll_kernel_alive):
        reply = asyncio.ensure_future(super()._async_poll_for_reply(msg_id, cell, timeout, task_poll_output_msg,
                                                                    task_poll_kernel_alive))
        # 1. the reply, or the kernel's idle status for this cell (every output has arrived), whichever is first
        await asyncio.wait([reply, task_poll_output_msg], return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        # 2. idle first: give the reply its grace period, then take it as lost
        try:
            return await asyncio.wait_for(asyncio.shield(reply), self.grace_s)
        except asyncio.TimeoutError:
            reply.cancel()
            task_poll_kernel_alive.cancel()
            self.lost.append(next((i for i, c in enumerate(self.nb.cells) if c is cell), -1))
            print(f"[nbrun] cell {self.lost[-1]}: the kernel finished it but its reply never came; taken as done "
                  f"after {self.grace_s:.0f} s", file=sys.stderr, flush=True)
            return lost_reply(msg_id, cell.get("outputs", []))


def run(path: Path, timeout: float | None = None, grace_s: float = 60.0, out: Path | None = None) -> list[int]:
    """Execute the notebook at ``path`` in its own directory and write it to ``out`` (default: back to ``path``);
    returns the cells whose reply was lost (empty on a normal run). A cell error raises nbclient's
    CellExecutionError and writes nothing."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = PatientClient(nb, grace_s=grace_s, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent.resolve())}})
    client.execute()
    nbformat.write(nb, out or path)
    return client.lost


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specbook.nbrun", description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per cell (default: none)")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="seconds to wait for a reply after the kernel reported the cell idle (default 60)")
    ap.add_argument("--out", type=Path, default=None, help="write the executed notebooks into this folder")
    a = ap.parse_args(argv)
    for p in a.notebooks:
        if not p.is_file():
            raise SystemExit(f"{p}: no such notebook")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    for p in a.notebooks:
        t0 = time.monotonic()
        lost = run(p, a.timeout, a.grace, a.out / p.name if a.out else None)
        print(f"[nbrun] {p}: executed in {time.monotonic() - t0:.0f} s"
              + (f"; replies lost for cells {lost}" if lost else ""), flush=True)


if __name__ == "__main__":
    main()
