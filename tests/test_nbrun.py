"""The notebook runner: a cell whose execute reply never arrives is taken as done once the kernel reported it idle,
with the outputs it produced; an error output still fails the run."""
import asyncio

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from specbook import nbrun


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_lost_reply_carries_the_status_the_outputs_show():
    assert nbrun.lost_reply("m", [{"output_type": "stream", "text": "x"}])["content"]["status"] == "ok"
    err = nbrun.lost_reply("m", [{"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": []}])
    assert err["content"] == {"status": "error", "ename": "ValueError", "evalue": "bad", "traceback": []}
    assert err["parent_header"] == {"msg_id": "m"}


def test_a_normal_run_writes_outputs_and_loses_no_reply(tmp_path):
    p = _notebook(tmp_path / "a.ipynb", "x = 6 * 7\nprint(x)", "x + 1")
    assert nbrun.run(p, timeout=120) == []
    cells = nbformat.read(p, as_version=4).cells
    assert cells[0].outputs[0]["text"] == "42\n" and cells[1].outputs[0]["data"]["text/plain"] == "43"
    assert [c.execution_count for c in cells] == [1, 2]


@pytest.fixture
def replies_never_come(monkeypatch):
    """nbclient's own wait for the execute reply, made to wait forever (the bug this runner works around)."""
    async def forever(self, *a, **k):
        await asyncio.sleep(3600)

    monkeypatch.setattr(NotebookClient, "_async_poll_for_reply", forever)


def test_a_lost_reply_is_taken_as_done_after_the_grace_period(tmp_path, replies_never_come, capsys):
    p = _notebook(tmp_path / "b.ipynb", "print('first')", "print('second')")
    assert nbrun.run(p, timeout=120, grace_s=0.5) == [0, 1]
    cells = nbformat.read(p, as_version=4).cells
    assert [c.outputs[0]["text"] for c in cells] == ["first\n", "second\n"]  # every output kept, in order
    assert "cell 0: the kernel finished it but its reply never came" in capsys.readouterr().err


def test_a_lost_reply_of_a_failing_cell_still_fails_the_run(tmp_path, replies_never_come):
    p = _notebook(tmp_path / "c.ipynb", "raise ValueError('planted')", "print('never')")
    before = p.read_text()
    with pytest.raises(CellExecutionError, match="planted"):
        nbrun.run(p, timeout=120, grace_s=0.5)
    assert p.read_text() == before  # nothing written


def test_out_writes_the_executed_copy_and_leaves_the_source(tmp_path):
    p = _notebook(tmp_path / "d.ipynb", "import os\nprint(os.path.basename(os.getcwd()))")
    before = p.read_text()
    (tmp_path / "build").mkdir()
    nbrun.main(["--out", str(tmp_path / "build"), str(p)])
    assert p.read_text() == before
    out = nbformat.read(tmp_path / "build" / "d.ipynb", as_version=4)
    assert out.cells[0].outputs[0]["text"] == tmp_path.name + "\n"  # the kernel ran in the notebook's own folder
