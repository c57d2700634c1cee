"""Prompts for what people send a small chat model beyond the template set: real code, multi-step math
word problems, long documents, rewriting / extraction, and follow-up turns.

Sources, all written here or openly licensed:
- **Code** is real: top-level functions of pure-Python modules of the CPython standard library that runs
  this build (PSF License 2.0), read from their source files with ``ast``. Tasks: explain, write tests,
  add type hints, find a planted bug (one operator flipped), complete a docstring-first stub
  (HumanEval's shape), port to another language; plus written-here tasks in eight languages.
- **Long documents** (1-3k tokens): the standard library's own documentation (module and function
  docstrings, PSF License 2.0) and synthetic reports about invented towns and companies.
- **Math word problems** (GSM8K's shape: several steps, small numbers) from generators with seeded numbers.
- **Follow-ups**: a second user turn (shorter, an example, for a child, ...) that the corpus answers
  *after* the target's own first answer, so the conversation is genuine.

Every prompt is grouped by its source (a module, a template, a synthetic document); the eval split takes
whole groups, so no document or function that is evaluated on is ever trained on.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import torch

from .prompts import EVENTS, FEATURES, INDUSTRY, ITEMS, NAMES, PLACES, RIVERS, TOPICS

STDLIB_MODULES = [
    "textwrap", "string", "shlex", "fractions", "statistics", "heapq", "bisect", "colorsys", "difflib", "calendar",
    "fnmatch", "glob", "ipaddress", "base64", "quopri", "html", "csv", "gettext", "email.utils", "urllib.parse",
    "posixpath", "genericpath", "ntpath", "random", "functools", "keyword", "tokenize", "dataclasses", "copy", "pprint",
    "reprlib", "graphlib", "_pydecimal", "zipfile", "tarfile", "shutil", "tempfile", "filecmp", "netrc", "mimetypes",
    "http.cookies", "json.decoder", "json.encoder", "wave", "uu", "locale", "inspect", "argparse", "optparse", "cmd",
    "codeop", "pickletools", "sched", "queue", "selectors", "smtplib", "webbrowser", "platform", "sysconfig", "ast",
]
LANGS = ["Python", "JavaScript", "TypeScript", "Rust", "Go", "Java", "C", "C++"]
PORT_LANGS = ["JavaScript", "Rust", "Go", "C++", "Java"]
CODE_TASKS = [
    "parses a date string in the format YYYY-MM-DD and returns the day of the week",
    "returns the k most common words in a text", "checks whether two strings are anagrams",
    "computes the running median of a stream of numbers", "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings", "rotates a matrix by 90 degrees",
    "validates a Sudoku board", "groups a list of records by a field and sums another field",
    "implements a least-recently-used cache", "returns all permutations of a string",
    "counts the islands in a grid of 0s and 1s", "evaluates an arithmetic expression in reverse Polish notation",
    "splits a list into chunks of size n", "computes the edit distance between two strings",
    "finds the shortest path in an unweighted graph", "serializes a binary tree to a string and back",
    "retries a function call with exponential backoff", "reads a JSON file and prints its keys",
    "merges overlapping intervals", "checks whether parentheses in a string are balanced",
    "converts a number to its binary representation", "deduplicates files in a folder by content hash",
    "computes compound interest year by year", "tokenizes a sentence into words and punctuation",
]
CODE_ASKS = [
    "Write a {lang} function that {task}.", "In {lang}, implement a function that {task}. Explain the time complexity.",
    "Write a {lang} function that {task}, with comments on each step.",
    "Show me idiomatic {lang} code that {task}.",
]
SQL = [
    "Write an SQL query that returns the {n} customers with the highest total order value from tables customers(id, "
    "name) and orders(id, customer_id, amount).",
    "Write an SQL query that counts the {item} sold per month in a table sales(id, item, sold_at, quantity).",
    "Write a Bash script that finds every .log file larger than {n} MB under /var/log and prints its size.",
    "Write a Bash one-liner that counts the lines containing the word '{item}' in all .txt files of a folder.",
]


def _pick(seq, g: torch.Generator):
    return seq[int(torch.randint(len(seq), (1,), generator=g))]


def _int(lo: int, hi: int, g: torch.Generator) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


# ---------------------------------------------------------------------------------------------- code
def stdlib_functions(module: str, min_lines: int = 5, max_lines: int = 40) -> list[dict]:
    """Top-level functions of a pure-Python standard-library module: name, source, docstring, signature line."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    text = Path(spec.origin).read_text(encoding="utf-8")
    out = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
            continue
        src = ast.get_source_segment(text, node)
        n = src.count("\n") + 1 if src else 0
        if not src or not (min_lines <= n <= max_lines) or "\t" in src:
            continue
        doc = ast.get_docstring(node) or ""
        out.append({"module": module, "name": node.name, "source": src, "doc": doc,
                    "header": src.split("\n")[0] if src.split("\n")[0].rstrip().endswith(":") else None})
    return out


FLIPS = [(" == ", " != "), (" < ", " <= "), (" > ", " >= "), (" + 1", " - 1"), (" and ", " or "), (" is None", " is not None")]


def plant_bug(source: str, g: torch.Generator) -> str | None:
    """The source with one operator flipped (the first occurrence of a randomly chosen applicable flip)."""
    body = source.split("\n", 1)[1] if "\n" in source else ""
    options = [f for f in FLIPS if f[0] in body]
    if not options:
        return None
    a, b = _pick(options, g)
    return source.split("\n", 1)[0] + "\n" + body.replace(a, b, 1)


def strip_docstring(source: str, doc: str) -> str:
    if not doc:
        return source
    tree = ast.parse(source)
    first = tree.body[0].body[0]
    lines = source.split("\n")
    del lines[first.lineno - 1:first.end_lineno]
    return "\n".join(lines)


def _block(src: str) -> str:
    return f"```python\n{src}\n```"


def code_prompts(fn: dict, g: torch.Generator) -> list[tuple[str, str]]:
    """Two (category, prompt) tasks on one real function."""
    src, asks = fn["source"], []
    asks.append(("code_explain", f"Explain what this Python function does, step by step.\n\n{_block(src)}"))
    asks.append(("code_tests", f"Write pytest unit tests for this function, covering edge cases.\n\n{_block(src)}"))
    asks.append(("code_port", f"Rewrite this Python function in {_pick(PORT_LANGS, g)}.\n\n{_block(src)}"))
    bare = strip_docstring(src, fn["doc"])
    asks.append(("code_edit", f"Add type hints and a docstring to this function.\n\n{_block(bare)}"))
    bug = plant_bug(src, g)
    if bug:
        asks.append(("code_fix", f"This function has a bug. Find it, explain it and give the fixed code.\n\n{_block(bug)}"))
    if fn["doc"] and fn["header"]:
        indent = " " * (len(src.split("\n")[1]) - len(src.split("\n")[1].lstrip())) if "\n" in src else "    "
        stub = f'{fn["header"]}\n{indent}"""{fn["doc"]}\n{indent}"""\n'
        asks.append(("code_complete", f"Complete the following Python function.\n\n{_block(stub)}"))
    picks = torch.randperm(len(asks), generator=g)[:2].tolist()
    return [(asks[i][0], asks[i][1]) for i in picks]


# ---------------------------------------------------------------------------------------------- math
def math_problem(g: torch.Generator) -> tuple[str, str]:
    """One multi-step word problem; (template id, text)."""
    a, b = _pick(NAMES, g), _pick([n for n in NAMES], g)
    b = b if b != a else "Sam"
    i = _pick(ITEMS, g)
    x, y, z = _int(2, 30, g), _int(2, 30, g), _int(2, 12, g)
    p, pct, d = _int(2, 15, g), _pick([10, 20, 25, 30, 40, 50, 60, 75], g), _int(2, 9, g)
    t = [
        f"A baker makes {x} loaves every morning and {y} every afternoon. Each loaf sells for ${p}. If {pct}% of the "
        f"loaves are sold, how much money does the bakery make in {d} days?",
        f"{a} is {x} years old. {b} is {z} years older than twice {a}'s age. How old will {b} be in {y} years?",
        f"{a} buys {x} {i} at ${p} each and {y} more at ${p + 2} each. {a} pays with ${(x + y) * (p + 2) + z}. How much "
        f"change does {a} get?",
        f"A tank holds {x * 10} litres. It is {pct}% full, and water flows in at {z} litres per minute. How many "
        f"minutes until the tank is full?",
        f"{a} runs {z} km on weekdays and {z + d} km on each weekend day. How many km does {a} run in {d} weeks?",
        f"A shirt costs ${x * 4}. It is discounted by {pct}%, and then a {d}% sales tax is added. What is the final price?",
        f"{a} has {x * 3} {i}. {a} gives a third of them to {b}, and {b} gives half of what {b} received to a friend. "
        f"How many {i} does {b} have left?",
        f"A recipe needs {z} cups of flour for {d * 4} cookies. How many cups are needed for {d * 4 * y} cookies?",
        f"A car uses {z} litres of fuel per 100 km. Fuel costs ${p} per litre. How much does a {x * 20} km trip cost?",
        f"A class has {x + y} students. {pct}% of them walk to school and {z} of the rest take the bus. How many "
        f"students come another way?",
        f"{a} saves ${x} in the first week and ${y} more each week than the week before. How much has {a} saved after "
        f"{d} weeks?",
        f"A garden is {x} m long and {y} m wide. A path {min(z, 3)} m wide runs around the outside. What is the area "
        f"of the path?",
    ]
    k = _int(0, len(t) - 1, g)
    return f"math{k}", t[k] + " " + _pick(["Think step by step.", "Show your work.", "Explain your reasoning.", ""], g)


# ---------------------------------------------------------------------------------------------- documents
def stdlib_document(module: str, max_chars: int) -> str | None:
    """A module's documentation as plain text: its docstring, then each public function's and class's."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    parts = [f"Documentation of the Python module {module}.", ast.get_docstring(tree) or ""]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                parts.append(f"{node.name}: {doc}")
    out, n = [], 0
    for p in (p.strip() for p in parts if p.strip()):
        if n + len(p) > max_chars:
            break  # whole paragraphs only
        out.append(p)
        n += len(p) + 2
    return "\n\n".join(out) if n > 3000 else None


def synthetic_report(g: torch.Generator, paragraphs: int) -> tuple[str, list[str]]:
    """A long report about invented towns (several sections) and questions its text answers."""
    text, qs = [], []
    for _ in range(paragraphs):
        town, ind, river = _pick(PLACES, g), _pick(INDUSTRY, g), _pick(RIVERS, g)
        year = 1400 + _int(0, 290, g)
        ev_year, pop = year + _int(50, 300, g), 2000 + 500 * _int(0, 80, g)
        mayor, budget = _pick(NAMES, g), _int(2, 90, g)
        text.append(
            f"{town}. {town} lies on the river {river} and was founded in {year}. Its economy grew around {ind}, and "
            f"the guild of that trade kept records of every apprentice for three centuries. In {ev_year} the town was "
            f"changed by {_pick(EVENTS, g)}; the council rebuilt the centre around {_pick(FEATURES, g)}. Today about "
            f"{pop:,} people live in {town}. The current mayor, {mayor}, has proposed a budget of {budget} million for "
            f"new schools and a second bridge, which the council will vote on next spring.")
        qs += [f"When was {town} founded?", f"What is {town}'s economy built on?", f"Who is the mayor of {town}?",
               f"What happened in {town} in {ev_year}?"]
    return "\n\n".join(text), qs


LONG_ASKS = [
    "Summarize the following document in five bullet points.\n\n{d}",
    "Read the document below and write a one-paragraph summary for a busy manager.\n\n{d}",
    "{d}\n\nWhat are the three most important points of the text above?",
    "Answer the question using only the document.\n\nDocument:\n{d}\n\nQuestion: {q}",
    "{d}\n\nBased on the document above, {q_lower}",
]
REWRITE = [
    "Rewrite the following paragraph in a formal tone.\n\n{p}", "Make this text half as long without losing facts.\n\n{p}",
    "Extract every place name, year and number from this text as a JSON object.\n\n{p}",
    "Turn this paragraph into a list of short bullet points.\n\n{p}",
    "Rewrite this text so a ten-year-old can understand it.\n\n{p}",
    "Write three quiz questions, with answers, about this text.\n\n{p}",
]
FIRST_TURNS = [
    "Explain {t} in a few paragraphs.", "What should a beginner know about {t}?", "Write a short essay about {t}.",
    "Give me five tips related to {t}.", "Compare {t} with something from everyday life.",
    "What are the biggest open questions about {t}?",
]
FOLLOW_UPS = [
    "Can you make that shorter?", "Can you give a concrete example of the second point?",
    "Now explain it as if I were ten years old.", "What are the limitations of what you just said?",
    "Turn your answer into a bulleted list.", "Translate the first sentence of your answer into French.",
    "Which part of that is most often misunderstood?", "Write a quiz question based on your answer.",
]


def _long_records(g: torch.Generator, max_chars: int) -> list[dict]:
    recs = []
    for m in STDLIB_MODULES:
        d = stdlib_document(m, max_chars=int(max_chars * (0.5 + 0.5 * float(torch.rand(1, generator=g)))))
        if d:
            tpl = _pick(LONG_ASKS[:3], g)
            recs.append({"category": "long_input", "group": f"doc:{m}", "turns": [tpl.format(d=d)],
                         "source": f"Python {sys.version_info.major}.{sys.version_info.minor} docstrings of {m} (PSF-2.0)"})
    for k in range(160):
        d, qs = synthetic_report(g, paragraphs=_int(9, 24, g))
        q = _pick(qs, g)
        recs.append({"category": "long_input", "group": f"report{k}",
                     "turns": [_pick(LONG_ASKS, g).format(d=d, q=q, q_lower=q[0].lower() + q[1:])]})
    return recs


def build_broad(seed: int = 1, max_doc_chars: int = 11000) -> list[dict]:
    """Every broad prompt as {category, group, turns[, source]}, deterministic for a Python version.

    Long because it lists the categories in one place: code on real functions, code asks in eight languages,
    math word problems, long documents, rewriting / extraction, two-turn conversations."""
    g = torch.Generator().manual_seed(seed)
    recs: list[dict] = []
    ver = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    for m in STDLIB_MODULES:
        for fn in stdlib_functions(m):
            for cat, text in code_prompts(fn, g):
                recs.append({"category": cat, "group": f"fn:{m}", "turns": [text],
                             "source": f"{ver} standard library, {m}.{fn['name']} (PSF-2.0)"})
    for ti, task in enumerate(CODE_TASKS):
        for lang in LANGS:
            recs.append({"category": "code_write", "group": f"task{ti}",
                         "turns": [_pick(CODE_ASKS, g).format(lang=lang, task=task)]})
    for k in range(60):
        recs.append({"category": "code_write", "group": f"sql{k % 4}",
                     "turns": [SQL[k % 4].format(n=_int(3, 20, g), item=_pick(ITEMS, g))]})
    for _ in range(600):
        tid, text = math_problem(g)
        recs.append({"category": "math_word", "group": tid, "turns": [text]})
    recs += _long_records(g, max_doc_chars)
    for k in range(240):
        d, _ = synthetic_report(g, paragraphs=1)
        recs.append({"category": "rewriting", "group": f"rw{k % 6}", "turns": [REWRITE[k % 6].format(p=d)]})
    for t in TOPICS:
        for _ in range(3):
            first = _pick(FIRST_TURNS, g).format(t=t)
            recs.append({"category": "multi_turn", "group": f"topic:{t}", "turns": [first, _pick(FOLLOW_UPS, g)]})
    return recs


def split_by_group(recs: list[dict], g: torch.Generator, eval_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """Shuffle, then move whole groups (a module, a template, a document) to eval until every category holds at
    least ``eval_fraction`` of its prompts there. A group goes to one side only, across categories: the function
    explained in eval is not the one tested in train."""
    perm = torch.randperm(len(recs), generator=g).tolist()
    recs = [recs[i] for i in perm]
    groups = list(dict.fromkeys(r["group"] for r in recs))
    total: dict[str, int] = {}
    for r in recs:
        total[r["category"]] = total.get(r["category"], 0) + 1
    in_eval: dict[str, int] = dict.fromkeys(total, 0)
    chosen: set[str] = set()
    for cat in total:
        for grp in groups:
            if in_eval[cat] >= eval_fraction * total[cat]:
                break
            if grp in chosen or not any(r["group"] == grp and r["category"] == cat for r in recs):
                continue
            chosen.add(grp)
            for r in recs:
                if r["group"] == grp:
                    in_eval[r["category"]] += 1
    ev = [r for r in recs if r["group"] in chosen]
    tr = [r for r in recs if r["group"] not in chosen]
    return tr, ev
