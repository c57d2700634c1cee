"""Autoregressive decoding with a KV cache: the baseline every speculative method is measured against.

    prefill:  one forward over the (left-padded) prompts, cache filled, logits of the last position
    decode:   one forward per new token over [B, 1] with the cache, sample, append, stop on EOS

The speculative loops (``speculative_generate``, batch 1 with trees; ``speculative_generate_batch``, B rows
of chains) live here too. Every loop shares ``check_request`` (argument validation), ``eos_set`` (one or several
EOS ids) and ``emit`` (EOS / budget truncation); the two speculative loops share ``commit_step``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from .models import cache_kw, sync
from .sampling import SamplingConfig, probs_from, sample


@dataclass
class DecodeStats:
    """What one generate call did. Times are wall-clock seconds."""

    prefill_time: float = 0.0
    step_times: list[float] = field(default_factory=list)  # one per decode forward
    target_forwards: int = 0  # prefill included
    new_tokens: int = 0  # emitted tokens summed over rows (EOS included, padding excluded)
    rows: int = 1

    @property
    def decode_time(self) -> float:
        return float(sum(self.step_times))

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward per row, the prefill (which emits the first token)
        included: exactly 1.0 for plain decoding at batch 1."""
        return self.new_tokens / max(self.target_forwards * self.rows, 1)


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row (stops after EOS, EOS kept)
    stats: DecodeStats


def encode(tokenizer, prompts: list[str] | str, *, chat: bool = True, max_new_tokens: int = 0,
           max_length: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> left-padded ``input_ids [B, L]`` and ``attention_mask [B, L]``.

    chat=True applies the tokenizer's chat template (a user turn + generation prompt) when it
    has one. A prompt that does not fit ``max_length`` (default: the model's context) together
    with ``max_new_tokens`` is an error, never silently truncated.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("encode() got no prompts")
    ids = []
    for p in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            t = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
            if isinstance(t, dict) or hasattr(t, "keys"):
                t = t["input_ids"]
        else:
            t = tokenizer(p, add_special_tokens=True)["input_ids"]
        ids.append(list(t))
    return pad_left(ids, tokenizer.pad_token_id, max_new_tokens=max_new_tokens, max_length=max_length,
                    device=device)


def pad_left(ids: list[list[int]], pad_id: int, *, max_new_tokens: int = 0, max_length: int | None = None,
             device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded ``input_ids [B, L]``, ``attention_mask [B, L]``."""
    L = max(len(t) for t in ids)
    if max_length is not None:
        for i, t in enumerate(ids):
            if len(t) + max_new_tokens > max_length:
                raise ValueError(
                    f"prompt {i} has {len(t)} tokens; with max_new_tokens={max_new_tokens} it exceeds the "
                    f"context of {max_length}. Shorten the prompt or lower max_new_tokens (nothing is truncated)."
                )
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), L), dtype=torch.long)
    for i, t in enumerate(ids):
        if len(t) == 0:
            raise ValueError(f"prompt {i} is empty after tokenisation")
        input_ids[i, L - len(t):] = torch.tensor(t)
        mask[i, L - len(t):] = 1
    return input_ids.to(device), mask.to(device)


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))


def check_fits(model, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    ctx = context_length(model)
    if input_ids.shape[1] + max_new_tokens > ctx:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model context "
            f"{ctx}; shorten the prompt or lower max_new_tokens (nothing is truncated)."
        )


def check_request(model, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                  generator: torch.Generator | None) -> None:
    """What every loop refuses up front: no budget, sampling without a generator, a prompt that does not fit."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not sampling.greedy and generator is None:
        raise ValueError("sampling with temperature > 0 needs an explicit torch.Generator (generator=...)")
    check_fits(model, input_ids, max_new_tokens)


def eos_set(eos_token_id, model) -> frozenset[int]:
    """The token ids that end a sequence: ``eos_token_id`` (an int or a list, as Llama-3 / Qwen configs
    have), or the model config's when None. An empty set (e.g. ``eos_token_id=-1`` or a config without
    one) never matches: the loop runs to ``max_new_tokens``."""
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        return frozenset()
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    return frozenset(int(i) for i in ids if int(i) >= 0)


def emit(tokens: list[int], eos: frozenset[int], budget: int) -> list[int]:
    """The tokens a step may emit: up to and including the first EOS, at most ``budget`` of them."""
    for i, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: i + 1]
            break
    return tokens[:budget]


def new_cache(model, capacity: int | None = None, batch: int = 1):
    """The target's KV cache for one call: a preallocated ``fastpath.StaticKVCache`` holding ``capacity``
    positions when ``model`` is a ``fastpath.FastTarget`` and the caller knows how far the sequence can grow;
    otherwise transformers' ``DynamicCache``."""
    from .fastpath import FastTarget

    if capacity is not None and isinstance(model, FastTarget):
        return model.new_cache(capacity, batch=batch)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


MAX_BLOCK = 256  # room a batch-1 speculative loop's static cache keeps for one verification block (draft + root)


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache):
    """One forward over the prompts. Returns last-position logits [B, V] and position ids [B, L]."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # left padding: real tokens start at 0
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                **cache_kw(cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], position_ids


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
) -> GenerateResult:
    """Plain autoregressive decoding. input_ids [B, L] (left-padded), attention_mask [B, L].

    Greedy when ``sampling.temperature == 0``; otherwise samples through ``generator``
    (required, so every random number comes from an explicit source). Rows that reached EOS are dropped
    from the batch (and the KV cache) once a quarter of it has finished, so long batches do not keep
    computing finished answers.
    """
    check_request(model, input_ids, max_new_tokens, sampling, generator)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    eos = eos_set(eos_token_id, model)
    dev = input_ids.device
    B = input_ids.shape[0]
    stats = DecodeStats(rows=B)
    cache = new_cache(model, capacity=input_ids.shape[1] + max_new_tokens, batch=B)

    # 1. prefill
    sync(dev)
    t0 = time.perf_counter()
    logits, pos = prefill(model, input_ids, attention_mask, cache)
    next_tok = sample(probs_from(logits, sampling), generator)  # [B]
    sync(dev)
    stats.prefill_time = time.perf_counter() - t0
    stats.target_forwards = 1

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else min(eos, default=0)
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=dev)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)  # the original row of each row still in the batch
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # finished rows not yet dropped from the batch
    next_pos = pos[:, -1:] + 1  # [B, 1]
    mask = attention_mask
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=dev)
    for t in range(max_new_tokens):
        # 2. record the token; finished rows keep emitting padding (ignored) until they are dropped
        next_tok = torch.where(done, torch.full_like(next_tok, pad), next_tok)
        out[rows, t] = next_tok
        hit = torch.isin(next_tok, eos_ids) & ~done
        lengths[rows[hit]] = t + 1
        done = done | hit
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if int(done.sum()) * 4 >= len(rows):  # a quarter of the batch finished: drop those rows (and their cache)
            keep = (~done).nonzero().flatten()
            cache.batch_select_indices(keep)
            rows, next_tok, next_pos, mask, done = rows[keep], next_tok[keep], next_pos[keep], mask[keep], done[keep]
        # 3. one decode forward over the new token
        t0 = time.perf_counter()
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=dev)], dim=1)
        o = model(input_ids=next_tok[:, None], attention_mask=mask, position_ids=next_pos,
                  **cache_kw(cache), use_cache=True)
        next_tok = sample(probs_from(o.logits[:, -1, :], sampling), generator)
        next_pos = next_pos + 1
        sync(dev)
        stats.step_times.append(time.perf_counter() - t0)
        stats.target_forwards += 1

    lengths_l = lengths.tolist()
    outs = out.tolist()
    tokens = [row[: min(n, t + 1)] for row, n in zip(outs, lengths_l)]
    stats.new_tokens = sum(len(r) for r in tokens)
    return GenerateResult(tokens=tokens, stats=stats)


# =========================================================================== speculative decoding


@dataclass
class SpecStats(DecodeStats):
    """DecodeStats plus what speculation did. ``tau`` counts the prefill as one forward emitting one token."""

    draft_time: float = 0.0
    verify_time: float = 0.0
    draft_forwards: int = 0
    drafted: int = 0  # draft nodes proposed
    accept_hist: dict = field(default_factory=dict)  # accepted nodes per step -> count
    pos_tested: dict = field(default_factory=dict)  # depth -> nodes tested at that depth
    pos_accepted: dict = field(default_factory=dict)  # depth -> of which accepted

    def conditional_acceptance(self) -> dict[int, float]:
        """Per-position acceptance given that the previous positions were accepted."""
        return {d: self.pos_accepted.get(d, 0) / n for d, n in sorted(self.pos_tested.items()) if n}

    def record(self, drafted: int, res) -> None:
        """Count one verified draft (``res``: verify.VerifyResult)."""
        self.drafted += drafted
        self.accept_hist[res.n_accepted] = self.accept_hist.get(res.n_accepted, 0) + 1
        for d, ok in res.tested:
            self.pos_tested[d] = self.pos_tested.get(d, 0) + 1
            self.pos_accepted[d] = self.pos_accepted.get(d, 0) + int(ok)


@dataclass
class SpecState:
    """What a drafter may read. ``tokens`` = prompt + everything emitted so far (one sequence).

    Invariant: the target cache holds ``tokens[:-1]``; the newest token is fed with the next draft.
    ``target_hidden`` [n, H']: the target's hidden states (the drafter's ``hidden_layers``; by default the last
    layer's, after the final norm) of the tokens committed in the last step, when the drafter asked for them
    (``needs_hidden``).
    """

    tokens: list[int]
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    target: object
    target_hidden: torch.Tensor | None = None


class Drafter:
    """The protocol every method implements; only drafting differs between methods.

    begin(state)                  a new sequence starts (reset caches)
    propose(state) -> DraftTree   guess continuations of state.tokens
    update(state, draft, result)  the verification result is known and state.tokens extended

    ``needs_hidden``: the loop passes the target's hidden states in ``state.target_hidden``: those of
    ``hidden_layers`` (``output_hidden_states`` indices: 0 = embeddings, l = after l decoder layers, -1 = the
    final hidden state after the last norm), concatenated along the feature axis.
    ``forwards``: the drafter's own forward passes so far (the loops report the difference per call).
    ``confidences``: its drafts carry ``DraftTree.confidence`` = the survival a_j of each position (serving.py's
    confidence policies need it).
    """

    needs_hidden: bool = False
    confidences: bool = False
    hidden_layers: tuple[int, ...] = (-1,)
    forwards: int = 0

    def begin(self, state: SpecState) -> None:  # pragma: no cover - protocol
        pass

    def propose(self, state: SpecState):  # pragma: no cover - protocol
        raise NotImplementedError

    def update(self, state: SpecState, draft, result) -> None:  # pragma: no cover - protocol
        pass

    @staticmethod
    def propose_batch(drafters: list["Drafter"], states: list[SpecState]) -> list:
        """``propose`` for several sequences at once (serving.py); a drafter class may batch its forwards here."""
        return [d.propose(s) for d, s in zip(drafters, states)]


def shared_sampling(states: list[SpecState]) -> bool:
    """Whether every sequence samples with the same config and the same generator (a ``propose_batch`` may then
    draw all their tokens in one call, one uniform per row in row order)."""
    return all(s.sampling == states[0].sampling and s.generator is states[0].generator for s in states)


@dataclass(frozen=True)
class Typical:
    """Medusa's typical acceptance with its two knobs (Cai et al. 2024, sec. 2.3.1; the paper's defaults): a token
    is typical if p(x) > min(eps, delta * exp(-H(p))). ``acceptance="typical"`` means ``Typical()``. LOSSY at T > 0."""

    eps: float = 0.09
    delta: float = 0.3

    def __post_init__(self):
        if not (0 < self.eps <= 1 and 0 < self.delta):
            raise ValueError(f"typical acceptance needs 0 < eps <= 1 and delta > 0, got eps={self.eps}, "
                             f"delta={self.delta}")


Acceptance = Literal["exact", "typical"]
ACCEPTANCE = get_args(Acceptance)


def accept(logits: torch.Tensor, draft, sampling: SamplingConfig, generator,
           acceptance: Acceptance | Typical = "exact"):
    """Verify one draft against the target's logits [N + 1, V]: "exact" = greedy / lossless rejection
    (verify.verify); "typical" or a ``Typical(eps, delta)`` = Medusa's typical acceptance (verify.typical_accept),
    LOSSY at T > 0."""
    from .verify import typical_accept, verify

    if acceptance == "exact":
        return verify(logits, draft, sampling, generator)
    t = acceptance if isinstance(acceptance, Typical) else Typical()
    return typical_accept(logits, draft, sampling, eps=t.eps, delta=t.delta, generator=generator)


def fit_draft(draft, past: int, ctx: int):
    """The draft cut to the model context: the root sits at position ``past``, a node of depth d at
    ``past + 1 + d``, so only depths below ``ctx - past - 1`` fit (the rest are dropped before the forward,
    never verified). Requests that fit (prompt + max_new_tokens <= ctx) always keep the root's bonus token."""
    room = ctx - past - 1
    return draft if len(draft) == 0 or room > int(draft.depths.max()) else draft.truncate_depth(room)


def commit_step(state: SpecState, new: list[int], drafter: Drafter, draft, res, eos: frozenset[int],
                max_new_tokens: int, stats: SpecStats) -> list[int]:
    """After one verification: emit the accepted path + the next token (cut at EOS and at the budget),
    extend the sequence, let the drafter roll its state back, count the step. Returns the emitted tokens."""
    emitted = emit([int(draft.tokens[i]) for i in res.path] + [res.next_token], eos, max_new_tokens - len(new))
    state.tokens.extend(emitted)
    new.extend(emitted)
    drafter.update(state, draft, res)
    stats.record(len(draft), res)
    return emitted


def done(new: list[int], eos: frozenset[int], max_new_tokens: int) -> bool:
    return len(new) >= max_new_tokens or new[-1] in eos


def drafter_hidden(out, drafter: Drafter) -> torch.Tensor:
    """The hidden states ``drafter`` reads from a target forward's output: [B, S, H * len(hidden_layers)]."""
    hs = [out.hidden_states[layer] for layer in drafter.hidden_layers]
    return hs[0] if len(hs) == 1 else torch.cat(hs, dim=-1)


def _target_block(target, cache, root: int, draft, past: int, hidden: bool):
    """ONE target forward over [root] + draft tokens after ``past`` cached positions: causal for a chain,
    tree attention (tree.block_inputs) otherwise."""
    from .tree import block_inputs

    dev = target.device
    block = torch.tensor([[root] + draft.tokens.tolist()], device=dev)
    if draft.is_chain:
        pos = torch.arange(past, past + len(draft) + 1, device=dev)[None]
        return target(input_ids=block, position_ids=pos, **cache_kw(cache), use_cache=True,
                      output_hidden_states=hidden)
    mask4d, pos = block_inputs(draft.parents.cpu(), past, dtype=target.dtype, device=dev)
    return target(input_ids=block, attention_mask=mask4d, position_ids=pos, **cache_kw(cache), use_cache=True,
                  output_hidden_states=hidden)


def _start(target, input_ids: torch.Tensor, cache, sampling: SamplingConfig, generator, stats: SpecStats,
           attention_mask: torch.Tensor | None = None, hidden: bool = False) -> tuple[list[int], object]:
    """Step 0, the prefill: the first token of every row comes from its prompt's last position, as in plain
    decoding. Returns (first tokens, the forward's output)."""
    dev = input_ids.device
    sync(dev)
    t0 = time.perf_counter()
    if attention_mask is None:
        out = target(input_ids=input_ids, **cache_kw(cache), use_cache=True, logits_to_keep=1,
                     output_hidden_states=hidden)
    else:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # left padding: real tokens start at 0
        out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     **cache_kw(cache), use_cache=True, logits_to_keep=1)
    first = sample(probs_from(out.logits[:, -1, :], sampling), generator).tolist()
    sync(dev)
    stats.prefill_time = time.perf_counter() - t0
    stats.target_forwards = 1
    return first, out


@torch.inference_mode()
def speculative_generate(
    target,
    drafter: Drafter,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    trace: list | None = None,
    acceptance: Acceptance | Typical = "exact",
) -> GenerateResult:
    """The one speculative loop. input_ids [1, L]; any Drafter (chains and trees); lossless when the
    drafter's q is the distribution it sampled from (verify.py).

    ``acceptance``: "exact" (greedy / lossless rejection, verify.verify) or "typical" / ``Typical(eps, delta)`` —
    Medusa's typical acceptance (verify.typical_accept), which is LOSSY: the output is no longer the target's
    distribution.

    ``trace``: if a list is given, one dict per step is appended (draft tokens and parents, the accepted path,
    next token, bonus?, the drafter's confidences or None) — what notebook 01 colours and notebook 03's
    reliability diagram reads.
    """
    from .cache import crop_to, keep_positions

    if not isinstance(acceptance, Typical) and acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be 'exact' (lossless), 'typical' or Typical(eps, delta) (Medusa, lossy), "
                         f"got {acceptance!r}")
    if input_ids.shape[0] != 1:
        raise ValueError("speculative_generate runs one sequence (batch 1); use speculative_generate_batch for B > 1")
    check_request(target, input_ids, max_new_tokens, sampling, generator)
    eos = eos_set(eos_token_id, target)
    dev = input_ids.device
    stats = SpecStats(rows=1)
    cache = new_cache(target, capacity=input_ids.shape[1] + max_new_tokens + MAX_BLOCK)
    ctx = context_length(target)
    first, out = _start(target, input_ids, cache, sampling, generator, stats, hidden=drafter.needs_hidden)
    state = SpecState(tokens=input_ids[0].tolist() + first, prompt_len=input_ids.shape[1], sampling=sampling,
                      generator=generator, target=target,
                      target_hidden=drafter_hidden(out, drafter)[0] if drafter.needs_hidden else None)
    new = list(first)
    drafter.begin(state)
    f0 = drafter.forwards
    while not done(new, eos, max_new_tokens):
        # 1. draft (cut to the context if it would run past it)
        t0 = time.perf_counter()
        past = len(state.tokens) - 1
        draft = fit_draft(drafter.propose(state), past, ctx)
        sync(dev)
        t1 = time.perf_counter()
        # 2. one target forward over [last token] + draft
        out = _target_block(target, cache, state.tokens[-1], draft, past, drafter.needs_hidden)
        # 3. verify: accepted path + correction/bonus
        res = accept(out.logits[0], draft, sampling, generator, acceptance)
        # 4. keep only the accepted path in the target cache; commit
        if draft.is_chain:
            crop_to(cache, past + 1 + res.n_accepted)
        else:
            keep_positions(cache, past + 1, torch.tensor(res.path, dtype=torch.long))
        if drafter.needs_hidden:
            rows = torch.tensor([0] + [i + 1 for i in res.path], device=dev)
            state.target_hidden = drafter_hidden(out, drafter)[0].index_select(0, rows)
        emitted = commit_step(state, new, drafter, draft, res, eos, max_new_tokens, stats)
        if trace is not None:
            trace.append({"draft": draft.tokens.tolist(), "parents": draft.parents.tolist(), "path": res.path,
                          "next": res.next_token, "bonus": res.bonus, "emitted": emitted,
                          "confidence": None if draft.confidence is None else draft.confidence.tolist()})
        sync(dev)
        t2 = time.perf_counter()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.step_times.append(t2 - t0)
        stats.target_forwards += 1
    stats.draft_forwards = drafter.forwards - f0
    stats.new_tokens = len(new)
    return GenerateResult(tokens=[new], stats=stats)


def _batch_block(drafts: list, roots: list[int], valid: list[int], pad: int, ctx: int):
    """Row r: [root] + its draft, padded to the longest -> input ids [B, n + 1], the block's 2D mask [B, n + 1]
    (1 = a real slot) and position ids [B, n + 1] continuing each row's own count of real tokens."""
    B, n_max = len(drafts), max(len(d) for d in drafts if d is not None)
    block = torch.full((B, n_max + 1), pad, dtype=torch.long)
    bmask = torch.zeros((B, n_max + 1), dtype=torch.long)
    pos = torch.zeros((B, n_max + 1), dtype=torch.long)
    for r, d in enumerate(drafts):
        n = len(d) if d is not None else 0
        block[r, 0] = roots[r]
        if n:
            block[r, 1:n + 1] = d.tokens
        bmask[r, :n + 1] = 1
        pos[r] = (valid[r] + torch.arange(n_max + 1)).clamp_max(ctx - 1)  # padded slots: any valid position
    return block, bmask, pos


def _chain_only(draft, r: int):
    if not draft.is_chain:
        raise ValueError(f"row {r}: speculative_generate_batch verifies chains only (its rollback leaves rejected "
                         "slots as masked holes, which is wrong for trees); run tree drafters through "
                         "speculative_generate one sequence at a time")
    return draft


@torch.inference_mode()
def speculative_generate_batch(
    target,
    drafters: list[Drafter],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
) -> GenerateResult:
    """Chain speculation for B rows at once, each row accepting a different number of tokens.

    One drafter per row (its own cache); ONE batched target forward verifies all rows' drafts.
    Instead of cropping a ragged cache, rejected draft slots stay in the target cache and are
    masked out forever in the 2D attention mask ("holes"); each row keeps its own position ids.
    Rows are verified independently, so each row's output is what it would get alone (exactly so
    in greedy fp32 up to batched-matmul rounding). Chains only, and drafters that read the target's
    hidden states (Medusa, EAGLE) are refused: both need the batch-1 loop.
    """
    B = input_ids.shape[0]
    if len(drafters) != B:
        raise ValueError(f"need one drafter per row: {B} rows, {len(drafters)} drafters")
    hidden = [type(d).__name__ for d in drafters if d.needs_hidden]
    if hidden:
        raise ValueError(f"speculative_generate_batch does not pass the target's hidden states; {hidden[0]} needs "
                         "them (needs_hidden): run it through speculative_generate one sequence at a time")
    check_request(target, input_ids, max_new_tokens, sampling, generator)
    eos = eos_set(eos_token_id, target)
    dev = input_ids.device
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    ctx = context_length(target)
    stats = SpecStats(rows=B)
    cache = new_cache(target, capacity=input_ids.shape[1] + max_new_tokens + MAX_BLOCK, batch=B)
    first, _ = _start(target, input_ids, cache, sampling, generator, stats, attention_mask)
    mask = attention_mask.clone()
    valid = attention_mask.sum(-1).tolist()  # real tokens of each row in the cache
    states, new = [], []
    for r in range(B):
        prompt = input_ids[r][attention_mask[r].bool()].tolist()
        states.append(SpecState(tokens=prompt + [first[r]], prompt_len=len(prompt), sampling=sampling,
                                generator=generator, target=target))
        new.append([first[r]])
        drafters[r].begin(states[r])
    f0 = [d.forwards for d in drafters]
    active = [not done(new[r], eos, max_new_tokens) for r in range(B)]
    while any(active):
        # 1. draft every active row (cut to the context)
        t0 = time.perf_counter()
        drafts = [_chain_only(fit_draft(drafters[r].propose(states[r]), valid[r], ctx), r) if active[r] else None
                  for r in range(B)]
        t1 = time.perf_counter()
        # 2. one batched forward; finished rows still feed one harmless query (masked out afterwards)
        block, bmask, pos = _batch_block(drafts, [s.tokens[-1] for s in states], valid, pad, ctx)
        if getattr(cache, "capacity", None) is not None and mask.shape[1] + block.shape[1] > cache.capacity:
            mask = cache.compact_rows(mask.bool())  # a static cache full of holes: every row's real slots kept
        mask = torch.cat([mask, bmask.to(dev)], dim=1)
        out = target(input_ids=block.to(dev), attention_mask=mask, position_ids=pos.to(dev), **cache_kw(cache),
                     use_cache=True)
        base = mask.shape[1] - block.shape[1]
        # 3. verify each row; 4. rejected and padded slots become holes; commit
        for r, d in enumerate(drafts):
            if d is None:
                mask[r, base:] = 0
                continue
            res = accept(out.logits[r, :len(d) + 1], d, sampling, generator)
            mask[r, base + 1 + res.n_accepted:] = 0
            valid[r] += 1 + res.n_accepted
            commit_step(states[r], new[r], drafters[r], d, res, eos, max_new_tokens, stats)
            active[r] = not done(new[r], eos, max_new_tokens)
        sync(dev)
        t2 = time.perf_counter()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.step_times.append(t2 - t0)
        stats.target_forwards += 1
    stats.draft_forwards = sum(d.forwards - f for d, f in zip(drafters, f0))
    stats.new_tokens = sum(len(x) for x in new)
    return GenerateResult(tokens=new, stats=stats)
