"""Logits -> probabilities (temperature, top-k, top-p) and sampling with an explicit Generator.

Everything here is a small pure function on tensors whose last dimension is the vocabulary.
Probabilities are always computed in float32 (a q you did not sample from, or one
computed in another precision than you sampled in, breaks losslessness).

temperature == 0 means greedy: the "distribution" is one-hot at the argmax, so the same
verification code covers greedy and sampled decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How to turn target/draft logits into a distribution.

    temperature: 0 -> greedy (one-hot argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens (0 or None = off).
    top_p: keep the smallest set whose mass reaches top_p (1.0 = off); must be in (0, 1].
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        validate(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def validate(temperature: float, top_k: int | None, top_p: float) -> None:
    """Raise ValueError naming the bad argument and the accepted range."""
    if not isinstance(temperature, (int, float)) or temperature != temperature:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be a non-negative int (0/None = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {top_p!r}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits to -inf (ties with the k-th are kept, as in transformers).
    logits [..., V] -> [..., V]."""
    if not k or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest prefix (by probability) with mass >= p.

    The most likely token is always kept. logits [..., V] -> [..., V].
    """
    if p >= 1.0:
        return logits
    # stable: among tied logits the lower index comes first, as in argmax, so the greedy token is always kept
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=True, stable=True)  # [..., V]
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted = mass_before >= p  # token i is needed only if the mass before it is < p
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """logits [..., V] (any dtype) -> float32 probabilities [..., V].

    temperature 0 -> one-hot at the argmax (ties: lowest index, like torch.argmax).
    """
    validate(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    logits = top_k_filter(logits, top_k or 0)
    logits = top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)


def probs_from(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """``logits_to_probs`` with a SamplingConfig."""
    return logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs [..., V] -> tokens [...] (int64).

    Uses the inverse-CDF of a single uniform per row drawn from ``generator``, so a seed fixes
    the output on any device and the number of random numbers consumed is exactly one per row.
    A one-hot row (greedy) always returns its argmax regardless of the uniform.
    """
    flat = probs.reshape(-1, probs.shape[-1]).float()  # [R, V]
    if generator is None:  # only one-hot rows (greedy) may be "sampled" without a generator
        if not bool(((flat == 0) | (flat == 1)).all()):
            raise ValueError("sampling needs an explicit torch.Generator (no global RNG); pass generator=...")
        return flat.argmax(-1).reshape(probs.shape[:-1])
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device)  # [R, 1]
    cdf = flat.cumsum(-1)
    cdf = cdf / cdf[:, -1:]  # guard against sum != 1 by rounding
    tok = torch.searchsorted(cdf, u, right=True).clamp_max(flat.shape[-1] - 1)  # [R, 1]
    # Never return a zero-probability token (possible only through rounding at the boundary).
    bad = flat.gather(-1, tok) <= 0
    if bad.any():
        tok = torch.where(bad, flat.argmax(-1, keepdim=True), tok)
    return tok.reshape(probs.shape[:-1])


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A seeded torch.Generator on ``device`` (the only source of randomness in specbook)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def gumbel_top_k(q: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct tokens drawn WITHOUT replacement from q [V], in draw order (the Gumbel-top-k trick: the
    order of log q + Gumbel noise is a sequential draw without replacement; Kool et al. 2019). Only tokens
    with q > 0 can be drawn, so fewer than ``k`` come back when q's support is smaller. -> [k'] long"""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)
    keys = q.double().log() - (-u.log()).log()
    keys = keys.masked_fill(q <= 0, float("-inf"))
    k = min(k, int((q > 0).sum()))
    return keys.topk(k).indices


def without_replacement_rows(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The distribution each draw of a without-replacement sequence came from: row i = q with tokens[:i]
    removed, renormalized. q [V], tokens [k] -> [k, V] float32 (what verification divides by)."""
    rows, cur = [], q.float()
    for t in tokens.tolist():
        rows.append(cur)
        cur = cur.clone()
        cur[t] = 0
        s = cur.sum()
        cur = cur / s if s > 0 else cur
    return torch.stack(rows) if rows else q.float()[:0]
