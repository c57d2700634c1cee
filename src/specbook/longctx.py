"""Speculation at long context: deterministic long prompts, every drafter's tau and speedup against context
length, and what one verification forward costs as the context grows.

    python -m specbook.longctx --lengths 256,1024,2048,4096,6144,8000 --out docs/bench/cpu_longctx_t0.json

``--per-length N`` draws N reports (seeds 0..N-1) for every length, so each point pools N prompts.

The long prompts are built from the project's own synthetic reports (``broad_prompts.synthetic_report``:
invented towns, one paragraph each, from a seeded generator): the report is cut at a paragraph boundary to the
longest prefix whose chat-encoded prompt fits ``n_tokens``, and followed by a request to summarize it. The
report for a shorter length is a prefix of the one for a longer length, so the curve varies the context and
nothing else. Our drafters were trained on corpus windows of a few hundred tokens: the sweep shows whether,
and where, they stop working.
"""

from __future__ import annotations

import argparse
import sys

import torch

ASK = "{d}\n\nSummarize the report above in five bullet points."


def _paragraphs(n: int, seed: int) -> list[str]:
    from .broad_prompts import synthetic_report

    text, _ = synthetic_report(torch.Generator().manual_seed(seed), paragraphs=n)
    return text.split("\n\n")


def _encoded_len(tokenizer, text: str) -> int:
    from .decoding import encode

    ids, _ = encode(tokenizer, text)
    return int(ids.shape[1])


def long_prompt(tokenizer, n_tokens: int, *, max_new_tokens: int = 64, context: int = 8192, seed: int = 0) -> dict:
    """A bench prompt of at most ``n_tokens`` chat-encoded tokens (the closest paragraph cut below it):
    ``{"category": str(n_tokens), "turns": [text], "tokens": exact length}``. The prompt plus ``max_new_tokens``
    must fit ``context`` (an error names both, nothing is cut to make it fit)."""
    if n_tokens + max_new_tokens > context:
        raise ValueError(f"a {n_tokens}-token prompt + max_new_tokens {max_new_tokens} exceeds the model context "
                         f"{context}; ask for at most {context - max_new_tokens} tokens")
    paras = _paragraphs(n_tokens // 60 + 4, seed)  # a paragraph is ~110 tokens: always more than enough
    lo, hi, length = 0, len(paras), 0  # the largest m with len(prompt(paras[:m])) <= n_tokens, by bisection
    while lo < hi:
        m = (lo + hi + 1) // 2
        n = _encoded_len(tokenizer, ASK.format(d="\n\n".join(paras[:m])))
        if n <= n_tokens:
            lo, length = m, n
        else:
            hi = m - 1
    if lo == 0:
        raise ValueError(f"n_tokens={n_tokens} is shorter than one paragraph of the report plus the request; "
                         "ask for at least 256 tokens")
    text = ASK.format(d="\n\n".join(paras[:lo]))
    return {"category": str(n_tokens), "turns": [text], "tokens": length, "paragraphs": lo}


def long_prompts(tokenizer, lengths: list[int], per_length: int = 1, **kw) -> list[dict]:
    """``per_length`` prompts for each length, from the reports of seeds 0..per_length-1 (seed 0 is the report
    of a one-prompt sweep), grouped by length: the bench's category is the length asked for."""
    if per_length < 1:
        raise ValueError(f"per_length must be >= 1, got {per_length}")
    return [long_prompt(tokenizer, n, seed=s, **kw) for n in lengths for s in range(per_length)]


def context_cost(model, contexts: list[int], ks=(1, 8, 32, 64), repeats: int = 2) -> dict[int, dict[int, float]]:
    """Seconds of one target forward over k new tokens (a chain or a tree of k nodes costs the same matmuls) on
    top of each context: {context: {k: s}}. Attention reads the whole cache, so the cost grows with it."""
    from .roofline import profile_latency_vs_k

    return {int(c): profile_latency_vs_k(model, ks, context=int(c), repeats=repeats) for c in contexts}


def main(argv=None):
    from .bench import markdown_table, run_bench, write_result
    from .models import load_model
    from .specbench import METHODS

    ap = argparse.ArgumentParser(prog="python -m specbook.longctx", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,1024,2048,4096,6144,8000", help="prompt lengths in tokens")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--per-length", type=int, default=1,
                    help="prompts per length (reports of different seeds); each length's tau pools them")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fast")
    ap.add_argument("--cost-k", default="1,8,32,64", help="forward sizes for the cost-vs-context grid")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    model, tok = load_model("smollm2-135m-instruct", dtype=a.dtype)
    prompts = long_prompts(tok, lengths, per_length=a.per_length, max_new_tokens=a.max_new_tokens,
                           context=int(model.config.max_position_embeddings))
    res = run_bench([m.strip() for m in a.methods.split(",") if m.strip()], prompts, model=model, tokenizer=tok,
                    max_new_tokens=a.max_new_tokens, temperature=0.0)
    res["settings"]["command"] = "python -m specbook.longctx " + " ".join(argv if argv is not None else sys.argv[1:])
    res["settings"]["prompt_tokens"] = {str(n): round(sum(p["tokens"] for p in prompts if p["category"] == str(n))
                                                      / a.per_length) for n in lengths}  # mean over a length's prompts
    res["context_cost_s"] = {str(c): {str(k): v for k, v in d.items()} for c, d in context_cost(
        model, lengths, ks=[int(x) for x in a.cost_k.split(",")]).items()}
    print(markdown_table(res))
    write_result(res, a.out)


if __name__ == "__main__":
    main()
