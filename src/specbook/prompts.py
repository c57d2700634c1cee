"""The project's own prompt set: templates x topics, in Spec-Bench's jsonl format.

    python -m specbook.prompts build        # writes data/prompts/{train,eval}.jsonl

Categories follow what speculative decoding is usually measured on (Spec-Bench): multi-turn
chat, writing, translation, summarization of a given passage, QA, math reasoning, code and
retrieval-augmented answers with a context passage. Passages are synthetic (invented towns,
companies, species) so that nothing is copied and nothing claims to be a fact.

Each record: {"question_id": str, "category": str, "turns": [str, ...]} — the same shape as
Spec-Bench's question.jsonl, so every tool reads both. ``eval`` is never trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT_DIR = ROOT / "data" / "prompts"

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system", "climate change",
    "the printing press", "the Roman Empire", "electric cars", "solar panels", "machine learning",
    "the internet", "bees", "coral reefs", "sleep", "coffee", "chess", "jazz music", "the Moon landing",
    "earthquakes", "vaccines", "recycling", "bicycles", "the stock market", "inflation", "democracy",
    "the human heart", "rainbows", "glaciers", "DNA", "gravity", "magnets", "tea ceremonies", "origami",
    "marathon running", "public libraries", "bridges", "trains", "honey", "deserts", "rainforests",
    "the ocean tides", "batteries", "plastic pollution", "the Olympic Games", "music theory",
    "friendship", "remote work", "urban gardening", "time management", "learning a language",
    "video games", "museums", "volunteering", "healthy breakfasts", "camping", "the solar system",
    "antibiotics", "wind turbines", "3D printing", "smartphones", "penguins", "wolves", "mushrooms",
]

WRITING = [
    "Write a short poem about {t}.", "Write a haiku about {t}.", "Write a short story that involves {t}.",
    "Write a persuasive paragraph about why people should learn about {t}.",
    "Write a product description for a children's book about {t}.",
    "Write a friendly email inviting a colleague to a talk on {t}.",
    "Write a limerick about {t}.", "Write a blog post introduction about {t}.",
    "Write a tweet announcing a new documentary about {t}.",
    "Write a short speech for a school assembly about {t}.",
]
QA = [
    "What is {t}?", "Explain {t} in simple terms.", "Why is {t} important?",
    "What are three interesting facts about {t}?", "How does {t} work?",
    "Explain {t} to a ten-year-old.", "What are the pros and cons of {t}?",
    "Give me a short history of {t}.", "What is a common misconception about {t}?",
    "How would you teach {t} to a beginner?",
]
CHAT = [
    ("I want to learn more about {t}. Where should I start?", "Can you suggest a simple first project or exercise?"),
    ("Tell me something surprising about {t}.", "Interesting! Can you explain why that happens?"),
    ("I have a presentation on {t} tomorrow. Help me outline it.", "Now write a catchy opening sentence for it."),
    ("What are the main ideas behind {t}?", "Summarize your answer in one sentence."),
    ("Can you recommend three questions to discuss about {t}?", "Which of these is the hardest, and why?"),
]
SENTENCES = [
    "The weather is beautiful today.", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "My brother plays the guitar every evening.", "The library opens at nine in the morning.",
    "We are going to the beach this weekend.", "This book is more interesting than the film.",
    "Could you help me carry these boxes?", "The children are playing in the garden.",
    "I forgot my umbrella at the office.", "She has lived in this city for ten years.",
    "The meeting was moved to Thursday afternoon.", "Please close the window when you leave.",
    "He is learning to cook Italian food.", "The museum is closed on Mondays.",
    "Our team won the match last night.", "I need to buy bread and milk.", "The train was delayed by twenty minutes.",
    "They planted apple trees behind the house.", "Thank you for your kind letter.",
]
LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]
TRANSLATE = ["Translate to {l}: {s}", "How do you say \"{s}\" in {l}?", "Translate the following sentence into {l}.\n{s}"]

# Synthetic passages: invented entities, composed from parts.
PLACES = ["Bramford", "Elswick", "Tarnhollow", "Quillby", "Marrowdale", "Osterlund", "Fenwick Cross", "Halvercombe",
          "Lindqvist Bay", "Pemberly Fork", "Rookham", "Vesselton"]
INDUSTRY = ["wool weaving", "clockmaking", "salt harvesting", "glassblowing", "apple cider", "shipbuilding",
            "paper milling", "cheese making", "copper mining", "ceramic tiles"]
RIVERS = ["Elwin", "Saxe", "Morrow", "Tellen", "Ashby", "Corrin"]
FEATURES = ["a stone bridge with seven arches", "an old lighthouse", "a covered market", "a clock tower",
            "a botanical garden", "a narrow-gauge railway", "a windmill museum", "a lake with floating houses"]
EVENTS = ["a great flood", "a fire in the old quarter", "the arrival of the railway", "a long drought",
          "the opening of a university", "a famous music festival"]
SUMMARIZE = ["Summarize the following passage in two sentences.\n\n{p}", "Give a one-sentence summary of this text:\n\n{p}",
             "Read the passage and list its three main points.\n\n{p}", "TL;DR:\n\n{p}"]
RAG = ["Use only the context to answer.\nContext: {p}\nQuestion: {q}",
       "Answer the question based on the passage below.\n\nPassage: {p}\n\nQuestion: {q}",
       "{p}\n\nAccording to the text above, {q_lower}"]
RAG_QS = ["What is the town known for?", "Which river flows through the town?", "When was the town founded?",
          "What happened in {y}?", "What can visitors see in the town?", "How many people live there?"]

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonah", "Kira", "Liam"]
ITEMS = ["apples", "pencils", "marbles", "books", "stickers", "cookies", "coins", "shells"]
MATH = [
    "{a} has {x} {i}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {i} does {a} have now? Think step by step.",
    "A shop sells {i} at {x} dollars each. {a} buys {y} of them and pays with a {w}-dollar note. How much change does {a} get?",
    "{a} reads {x} pages a day. How many pages does {a} read in {y} weeks? Explain your reasoning.",
    "What is {x} times {y}, plus {z}? Show your work.",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} and {b} share {w} {i} so that {a} gets {x} more than {b}. How many does each get?",
    "Solve for n: {x}n + {y} = {w}.",
    "A train travels {w} km in {x} hours. What is its average speed?",
]
CODE = [
    "Write a Python function that {task}.", "Write a Python function that {task}. Include a docstring and an example.",
    "Write a JavaScript function that {task}.", "Write a Rust function that {task}.", "Write a C function that {task}.",
    "Explain step by step how to write a Python function that {task}.",
    "Write a Python function that {task}, then write two unit tests for it.",
]
TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "sorts a list of dictionaries by a key", "finds the largest element in a list",
    "removes duplicates from a list while keeping order", "computes the factorial of a number",
    "checks whether a string is a palindrome", "merges two sorted lists", "converts Celsius to Fahrenheit",
    "counts word frequencies in a text", "flattens a nested list", "computes the average of a list of numbers",
    "reads a CSV file and prints each row", "finds the greatest common divisor of two numbers",
    "generates all subsets of a list", "validates an email address with a regular expression",
    "implements binary search", "transposes a matrix",
]


# the categories of the template set (build(broad=False)); every other category comes from broad_prompts
TEMPLATE_CATEGORIES = ("coding", "math_reasoning", "multi_turn", "qa", "rag", "summarization", "translation", "writing")


def _pick(seq, g: torch.Generator):
    return seq[int(torch.randint(len(seq), (1,), generator=g))]


def _passage(g: torch.Generator) -> tuple[str, dict]:
    town, ind, river = _pick(PLACES, g), _pick(INDUSTRY, g), _pick(RIVERS, g)
    feat, ev = _pick(FEATURES, g), _pick(EVENTS, g)
    year = 1400 + int(torch.randint(500, (1,), generator=g))
    ev_year = year + 50 + int(torch.randint(300, (1,), generator=g))
    pop = 2000 + 500 * int(torch.randint(80, (1,), generator=g))
    text = (f"{town} is a small town on the river {river}, founded in {year}. For centuries it was known for "
            f"{ind}, and many families still work in that trade. In {ev_year} the town was changed by {ev}, "
            f"which the older residents still talk about. Today about {pop:,} people live there, and visitors "
            f"come to see {feat}.")
    return text, {"y": ev_year}


def build(seed: int = 0, eval_fraction: float = 0.1, broad: bool = True) -> tuple[list[dict], list[dict]]:
    """All prompts, deterministically, split into (train, eval): the template set, then (``broad``) the prompts
    of ``broad_prompts`` (real code, math word problems, long documents, rewriting, follow-up turns), split by
    source so that no evaluated document or function is trained on."""
    g = torch.Generator().manual_seed(seed)
    recs: list[dict] = []

    def add(cat, *turns):
        recs.append({"category": cat, "turns": list(turns)})

    for t in TOPICS:
        for tpl in WRITING:
            add("writing", tpl.format(t=t))
        for tpl in QA:
            add("qa", tpl.format(t=t))
        for a, b in CHAT:
            add("multi_turn", a.format(t=t), b)
    for s in SENTENCES:
        for lang in LANGS:
            for tpl in TRANSLATE:
                add("translation", tpl.format(l=lang, s=s))
    for _ in range(500):
        p, info = _passage(g)
        add("summarization", _pick(SUMMARIZE, g).format(p=p))
        q = _pick(RAG_QS, g).format(**info)
        add("rag", _pick(RAG, g).format(p=p, q=q, q_lower=q[0].lower() + q[1:]))
    for _ in range(700):
        a, b = _pick(NAMES, g), _pick(NAMES, g)
        x, y, z = (int(torch.randint(2, 40, (1,), generator=g)) for _ in range(3))
        w = x + y + z + int(torch.randint(5, 60, (1,), generator=g))
        add("math_reasoning", _pick(MATH, g).format(a=a, b=b if b != a else "Sam", x=x, y=y, z=z, w=w, i=_pick(ITEMS, g)))
    for task in TASKS:
        for tpl in CODE:
            add("coding", tpl.format(task=task))
    # dedupe (math templates can collide) and shuffle with the seeded generator
    seen, uniq = set(), []
    for r in recs:
        key = tuple(r["turns"])
        if key not in seen:
            seen.add(key)
            uniq.append(r)
    perm = torch.randperm(len(uniq), generator=g).tolist()
    uniq = [uniq[i] for i in perm]
    for i, r in enumerate(uniq):
        r["question_id"] = f"sb-{i:05d}"
    n_eval = int(round(len(uniq) * eval_fraction))
    ev, tr = uniq[:n_eval], uniq[n_eval:]
    if broad:
        from .broad_prompts import build_broad, split_by_group

        tr_b, ev_b = split_by_group(build_broad(), g, eval_fraction)
        for i, r in enumerate(ev_b + tr_b):
            r["question_id"] = f"bp-{i:05d}"
        tr, ev = tr + tr_b, ev + ev_b
    return tr, ev


def load_prompts(spec: str | Path = "eval", limit: int | None = None) -> list[dict]:
    """Read a Spec-Bench-format jsonl. ``spec``: "train", "eval", or a path."""
    path = PROMPT_DIR / f"{spec}.jsonl" if spec in ("train", "eval") else Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} not found" + (
            "; run `python -m specbook.prompts build`" if spec in ("train", "eval") else ""))
    recs = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e})") from e
            if not isinstance(r.get("turns"), list) or not r["turns"] or not all(isinstance(t, str) for t in r["turns"]):
                raise ValueError(f"{path}:{ln}: expected a Spec-Bench record with a non-empty 'turns' list of strings")
            recs.append(r)
            if limit is not None and len(recs) >= limit:
                break
    if not recs:
        raise ValueError(f"{path}: no prompts in file")
    return recs


def _write(recs: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in recs:
            extra = {k: r[k] for k in ("group", "source") if k in r}
            f.write(json.dumps({"question_id": r["question_id"], "category": r["category"], "turns": r["turns"], **extra})
                    + "\n")


def main(argv=None):
    import argparse
    from collections import Counter

    ap = argparse.ArgumentParser(prog="python -m specbook.prompts")
    ap.add_argument("cmd", choices=["build"])
    ap.add_argument("--out", default=str(PROMPT_DIR))
    a = ap.parse_args(argv)
    tr, ev = build()
    _write(tr, Path(a.out) / "train.jsonl")
    _write(ev, Path(a.out) / "eval.jsonl")
    print(f"train {len(tr)}  eval {len(ev)}  categories {dict(Counter(r['category'] for r in tr + ev))}")


if __name__ == "__main__":
    main()
