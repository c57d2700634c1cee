"""The code's shape: functions a reader can hold in their head."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "specbook"
MAX_LINES = 60  # body lines, docstring excluded


def _long_functions():
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            doc = ast.get_docstring(node) or ""
            if doc:
                body = body[1:]
            if not body:
                continue
            n = body[-1].end_lineno - body[0].lineno + 1
            if n > MAX_LINES and "Long because" not in doc:
                yield f"{f.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)"


def test_no_function_over_60_lines_without_a_reason():
    """A function over 60 lines (docstring excluded) must say why in its docstring ("Long because ...")."""
    assert list(_long_functions()) == []
