"""Autoregressive decoding with a KV cache: the baseline every speculative method is measured against.

    prefill:  one forward over the (left-padded) prompts, cache filled, logits of the last position
    decode:   one forward per new token over [B, 1] with the cache, sample, append, stop on EOS

The speculative loop (``speculative_generate``) lives here too once drafters land; both share
``encode`` / ``prefill`` and the stats dataclass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache):
    """One forward over the prompts. Returns last-position logits [B, V] and position ids [B, L]."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # left padding: real tokens start at 0
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
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
    eos_token_id: int | None = None,
) -> GenerateResult:
    """Plain autoregressive decoding. input_ids [B, L] (left-padded), attention_mask [B, L].

    Greedy when ``sampling.temperature == 0``; otherwise samples through ``generator``
    (required, so every random number comes from an explicit source).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not sampling.greedy and generator is None:
        raise ValueError("sampling with temperature > 0 needs an explicit torch.Generator (generator=...)")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_fits(model, input_ids, max_new_tokens)
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    if isinstance(eos_token_id, (list, tuple)):
        eos_token_id = eos_token_id[0]
    dev = input_ids.device
    B = input_ids.shape[0]
    stats = DecodeStats(rows=B)
    cache = new_cache(model)

    # 1. prefill
    _sync(dev)
    t0 = time.perf_counter()
    logits, pos = prefill(model, input_ids, attention_mask, cache)
    next_tok = sample(probs_from(logits, sampling), generator)  # [B]
    _sync(dev)
    stats.prefill_time = time.perf_counter() - t0
    stats.target_forwards = 1

    out = torch.empty((B, max_new_tokens), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)
    next_pos = pos[:, -1:] + 1  # [B, 1]
    mask = attention_mask
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos_token_id
    for t in range(max_new_tokens):
        # 2. record the token; rows that finished keep emitting padding (ignored)
        next_tok = torch.where(done, torch.full_like(next_tok, pad), next_tok)
        out[:, t] = next_tok
        if eos_token_id is not None:
            hit = (next_tok == eos_token_id) & ~done
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            done = done | hit
        if t == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        # 3. one decode forward over the new token
        t0 = time.perf_counter()
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
        o = model(input_ids=next_tok[:, None], attention_mask=mask, position_ids=next_pos,
                  past_key_values=cache, use_cache=True)
        next_tok = sample(probs_from(o.logits[:, -1, :], sampling), generator)
        next_pos = next_pos + 1
        _sync(dev)
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

    @property
    def mean_accepted(self) -> float:
        steps = sum(self.accept_hist.values())
        return sum(k * v for k, v in self.accept_hist.items()) / steps if steps else 0.0


@dataclass
class SpecState:
    """What a drafter may read. ``tokens`` = prompt + everything emitted so far (batch 1).

    Invariant: the target cache holds ``tokens[:-1]``; the newest token is fed with the next draft.
    ``target_hidden`` [n, H]: the target's last-layer hidden states (after the final norm) of the
    tokens committed in the last step, when the drafter asked for them (``needs_hidden``).
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
    """

    needs_hidden: bool = False
    forwards: int = 0

    def begin(self, state: SpecState) -> None:  # pragma: no cover - protocol
        pass

    def propose(self, state: SpecState):  # pragma: no cover - protocol
        raise NotImplementedError

    def update(self, state: SpecState, draft, result) -> None:  # pragma: no cover - protocol
        pass


@torch.inference_mode()
def speculative_generate(
    target,
    drafter: Drafter,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    trace: list | None = None,
    acceptance: str = "exact",
) -> GenerateResult:
    """The one speculative loop (design.md). input_ids [1, L]; any Drafter; lossless when the
    drafter's q is the distribution it sampled from (verify.py).

    ``acceptance``: "exact" (greedy / lossless rejection, verify.verify) or "typical" — Medusa's typical
    acceptance (verify.typical_accept), which is LOSSY: the output is no longer the target's distribution.

    ``trace``: if a list is given, one dict per step is appended (draft tokens, accepted count,
    next token, bonus?) — what notebook 01 colours.
    """
    from .cache import crop_to, keep_positions
    from .tree import block_inputs
    from .verify import typical_accept, verify

    if acceptance not in ("exact", "typical"):
        raise ValueError(f"acceptance must be 'exact' (lossless) or 'typical' (Medusa, lossy), got {acceptance!r}")
    if input_ids.shape[0] != 1:
        raise ValueError("speculative_generate runs one sequence (batch 1); use speculative_generate_batch for B > 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not sampling.greedy and generator is None:
        raise ValueError("sampling with temperature > 0 needs an explicit torch.Generator (generator=...)")
    check_fits(target, input_ids, max_new_tokens)
    if eos_token_id is None:
        eos_token_id = target.config.eos_token_id
    dev = input_ids.device
    stats = SpecStats(rows=1)
    cache = new_cache(target)
    ctx = context_length(target)

    # 0. prefill: the first token comes from the prompt's last position, as in plain decoding
    _sync(dev)
    t0 = time.perf_counter()
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=drafter.needs_hidden)
    first = int(sample(probs_from(out.logits[:, -1, :], sampling), generator)[0])
    _sync(dev)
    stats.prefill_time = time.perf_counter() - t0
    stats.target_forwards = 1
    state = SpecState(tokens=input_ids[0].tolist() + [first], prompt_len=input_ids.shape[1], sampling=sampling,
                      generator=generator, target=target,
                      target_hidden=out.hidden_states[-1][0] if drafter.needs_hidden else None)
    new = [first]
    drafter.begin(state)
    f0 = drafter.forwards
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        # 1. draft
        t0 = time.perf_counter()
        draft = drafter.propose(state)
        _sync(dev)
        t1 = time.perf_counter()
        n = len(draft)
        past = len(state.tokens) - 1
        if past + 1 + n > ctx:
            raise ValueError(f"sequence would exceed the model context ({ctx}); lower max_new_tokens")
        # 2. one target forward over [last token] + draft (tree attention unless it is a chain)
        block = torch.tensor([[state.tokens[-1]] + draft.tokens.tolist()], device=dev)
        if draft.is_chain:
            pos = torch.arange(past, past + n + 1, device=dev)[None]
            out = target(input_ids=block, position_ids=pos, past_key_values=cache, use_cache=True,
                         output_hidden_states=drafter.needs_hidden)
        else:
            mask4d, pos = block_inputs(draft.parents.cpu(), past, dtype=target.dtype, device=dev)
            out = target(input_ids=block, attention_mask=mask4d, position_ids=pos, past_key_values=cache,
                         use_cache=True, output_hidden_states=drafter.needs_hidden)
        # 3. verify: accepted path + correction/bonus
        if acceptance == "exact":
            res = verify(out.logits[0], draft, sampling, generator)
        else:  # lossy
            res = typical_accept(out.logits[0], draft, sampling, generator=generator)
        # 4. keep only the accepted path in the target cache
        if draft.is_chain:
            crop_to(cache, past + 1 + res.n_accepted)
        else:
            keep_positions(cache, past + 1, torch.tensor(res.path, dtype=torch.long))
        emitted = [int(draft.tokens[i]) for i in res.path] + [res.next_token]
        if eos_token_id in emitted:  # an EOS inside the draft ends the sequence: nothing after it
            emitted = emitted[: emitted.index(eos_token_id) + 1]
        emitted = emitted[: max_new_tokens - len(new)]
        if drafter.needs_hidden:
            rows = torch.tensor([0] + [i + 1 for i in res.path], device=dev)
            state.target_hidden = out.hidden_states[-1][0].index_select(0, rows)
        state.tokens.extend(emitted)
        new.extend(emitted)
        drafter.update(state, draft, res)
        if trace is not None:
            trace.append({"draft": draft.tokens.tolist(), "parents": draft.parents.tolist(), "path": res.path,
                          "next": res.next_token, "bonus": res.bonus, "emitted": emitted})
        _sync(dev)
        t2 = time.perf_counter()
        # stats
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.step_times.append(t2 - t0)
        stats.target_forwards += 1
        stats.drafted += n
        stats.accept_hist[res.n_accepted] = stats.accept_hist.get(res.n_accepted, 0) + 1
        for d, ok in res.tested:
            stats.pos_tested[d] = stats.pos_tested.get(d, 0) + 1
            stats.pos_accepted[d] = stats.pos_accepted.get(d, 0) + int(ok)
    stats.draft_forwards = drafter.forwards - f0
    stats.new_tokens = len(new)
    return GenerateResult(tokens=[new], stats=stats)


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
    eos_token_id: int | None = None,
) -> GenerateResult:
    """Chain speculation for B rows at once, each row accepting a different number of tokens.

    One drafter per row (its own cache); ONE batched target forward verifies all rows' drafts.
    Instead of cropping a ragged cache, rejected draft slots stay in the target cache and are
    masked out forever in the 2D attention mask ("holes"); each row keeps its own position ids.
    Rows are verified independently, so each row's output is what it would get alone (exactly so
    in greedy fp32 up to batched-matmul rounding).
    """
    from .verify import verify

    B = input_ids.shape[0]
    if len(drafters) != B:
        raise ValueError(f"need one drafter per row: {B} rows, {len(drafters)} drafters")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not sampling.greedy and generator is None:
        raise ValueError("sampling with temperature > 0 needs an explicit torch.Generator (generator=...)")
    check_fits(target, input_ids, max_new_tokens)
    if eos_token_id is None:
        eos_token_id = target.config.eos_token_id
    dev = input_ids.device
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    stats = SpecStats(rows=B)
    cache = new_cache(target)
    t0 = time.perf_counter()
    logits, _ = prefill(target, input_ids, attention_mask, cache)
    first = sample(probs_from(logits, sampling), generator).tolist()
    stats.prefill_time = time.perf_counter() - t0
    stats.target_forwards = 1
    mask = attention_mask.clone()
    valid = attention_mask.sum(-1).tolist()  # real tokens of each row in the cache
    states, new = [], []
    for r in range(B):
        prompt = input_ids[r][attention_mask[r].bool()].tolist()
        states.append(SpecState(tokens=prompt + [first[r]], prompt_len=len(prompt), sampling=sampling,
                                generator=generator, target=target))
        new.append([first[r]])
        drafters[r].begin(states[r])
    active = [max_new_tokens > 1 and first[r] != eos_token_id for r in range(B)]
    while any(active):
        t0 = time.perf_counter()
        drafts = [drafters[r].propose(states[r]) if active[r] else None for r in range(B)]
        t1 = time.perf_counter()
        n_max = max(len(d) for d in drafts if d is not None)
        block = torch.full((B, n_max + 1), pad, dtype=torch.long)
        bmask = torch.zeros((B, n_max + 1), dtype=mask.dtype)
        pos = torch.zeros((B, n_max + 1), dtype=torch.long)
        for r, d in enumerate(drafts):
            n = len(d) if d is not None else 0
            block[r, 0] = states[r].tokens[-1]
            if n:
                block[r, 1:n + 1] = d.tokens
            bmask[r, :n + 1] = 1  # finished rows still feed one harmless query (masked out afterwards)
            pos[r] = valid[r] + torch.arange(n_max + 1)
        mask = torch.cat([mask, bmask.to(dev)], dim=1)
        out = target(input_ids=block.to(dev), attention_mask=mask, position_ids=pos.to(dev), past_key_values=cache,
                     use_cache=True)
        base = mask.shape[1] - (n_max + 1)
        for r, d in enumerate(drafts):
            if d is None:
                mask[r, base:] = 0
                continue
            n = len(d)
            res = verify(out.logits[r, :n + 1], d, sampling, generator)
            k = res.n_accepted
            mask[r, base + 1 + k:] = 0  # rejected and padded slots become holes
            valid[r] += 1 + k
            emitted = [int(d.tokens[i]) for i in res.path] + [res.next_token]
            if eos_token_id in emitted:
                emitted = emitted[: emitted.index(eos_token_id) + 1]
            emitted = emitted[: max_new_tokens - len(new[r])]
            states[r].tokens.extend(emitted)
            new[r].extend(emitted)
            drafters[r].update(states[r], d, res)
            stats.drafted += n
            stats.accept_hist[k] = stats.accept_hist.get(k, 0) + 1
            for dd, ok in res.tested:
                stats.pos_tested[dd] = stats.pos_tested.get(dd, 0) + 1
                stats.pos_accepted[dd] = stats.pos_accepted.get(dd, 0) + int(ok)
            if len(new[r]) >= max_new_tokens or new[r][-1] == eos_token_id:
                active[r] = False
        _sync(dev)
        t2 = time.perf_counter()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.step_times.append(t2 - t0)
        stats.target_forwards += 1
    stats.draft_forwards = sum(d.forwards for d in drafters)
    stats.new_tokens = sum(len(x) for x in new)
    return GenerateResult(tokens=new, stats=stats)
