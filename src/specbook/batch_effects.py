"""Batch effects: does acceptance survive many requests at once, and when does batching change greedy output?

Two measurements behind notebook 08's batch section:

- ``acceptance_vs_concurrency``: the same requests served one at a time and c at a time (``serving.serve``, every
  running request's draft verified in ONE packed forward); per request, tau and whether its tokens equal its
  concurrency-1 tokens. A KV-slot mix-up between requests (the cause of the batch-size collapses users report)
  shows up here as lower tau and changed tokens; ``tests/test_failure_modes.py`` checks the loops against it.
- ``batch_divergence``: greedy decoding of each prompt alone and inside left-padded batches of B prompts, in
  bf16 and in fp32; the share of prompts whose output changes and the first position that changes. Reductions
  over a different batch shape round differently; bf16's 8-bit mantissa turns that into different argmaxes far
  more often than fp32 does, which is why the exactness tests run in fp32.
"""

from __future__ import annotations

import torch


def acceptance_vs_concurrency(target, drafter, prompts: list[list[int]], levels=(1, 4, 8, 16),
                              max_new_tokens: int = 32, gamma: int = 4, progress: bool = False) -> list[dict]:
    """Greedy serving at each concurrency in ``levels`` with a fixed block of ``gamma`` drafted tokens:
    [{"concurrency", "tau" (mean over requests of tokens per step that request took part in), "tau_per_request",
    "same_tokens" (requests whose output equals the first level's)}]."""
    from .serving import closed_loop, serve

    if not levels:
        raise ValueError("levels must name at least one concurrency")
    rows, ref = [], None
    for c in levels:
        out = serve(target, closed_loop(prompts, max_new_tokens), policy=f"fixed:{gamma}", drafter=drafter,
                    concurrency=int(c), eos_token_id=-1, progress=progress)
        res = sorted(out.requests, key=lambda r: r.rid)
        toks = [r.tokens for r in res]
        ref = toks if ref is None else ref
        taus = [(r.accepted + r.steps) / r.steps for r in res if r.steps]
        rows.append({"concurrency": int(c), "tau": sum(taus) / len(taus), "tau_per_request": taus,
                     "same_tokens": sum(a == b for a, b in zip(toks, ref)), "requests": len(res)})
    return rows


def batch_divergence(model, tokenizer, texts: list[str], batch_sizes=(1, 4, 16), max_new_tokens: int = 48) -> list[dict]:
    """Greedy output of every text inside batches of each size (consecutive texts, left padded) against its
    batch-1 output in the model's own dtype: [{"batch", "changed", "prompts", "first_change" (positions)}]."""
    from .decoding import encode, generate

    if 1 not in batch_sizes:
        batch_sizes = (1, *batch_sizes)
    outs: dict[int, list[list[int]]] = {}
    for b in batch_sizes:
        got = []
        for i in range(0, len(texts), b):
            ids, mask = encode(tokenizer, texts[i:i + b], device=model.device)
            got += generate(model, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=-1).tokens
        outs[b] = got
    rows = []
    for b in batch_sizes:
        firsts = [next((j for j, (x, y) in enumerate(zip(a, r)) if x != y), None) for a, r in zip(outs[b], outs[1])]
        rows.append({"batch": b, "dtype": str(model.dtype).replace("torch.", ""), "prompts": len(texts),
                     "changed": sum(f is not None for f in firsts), "first_change": [f for f in firsts if f is not None]})
    return rows


@torch.inference_mode()
def logit_gap(model, tokenizer, texts: list[str], max_new_tokens: int = 48) -> list[float]:
    """The gap between the top two logits at every greedy step, in the model's dtype (give it an fp32 model to
    see the gaps bf16 rounding competes with): how close the argmax comes to a tie.
    A rounding error larger than the gap flips the token; bf16's error is ~2^-8 of a logit's size."""
    from .decoding import encode, generate

    gaps = []
    for t in texts:
        ids, mask = encode(tokenizer, t, device=model.device)
        out = generate(model, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=-1).tokens[0]
        full = torch.cat([ids[0], torch.tensor(out, device=ids.device)])[None]
        logits = model(full).logits[0, ids.shape[1] - 1:-1].float()
        top = logits.topk(2, dim=-1).values
        gaps += (top[:, 0] - top[:, 1]).tolist()
    return gaps
