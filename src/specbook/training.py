"""The one training loop every drafter plugs into, and drafter checkpoints.

A drafter supplies an ``Objective``: its trainable module, ``loss(batch)`` and
``evaluate(batch)`` (held-out per-position acceptance). The loop supplies everything else:
AdamW, linear warmup + cosine decay, gradient clipping, bf16 autocast on GPU, a tqdm bar,
periodic held-out evaluation, resumable checkpoints and fixed seeds. Batches are windows of the
self-distilled corpus with the target's cached features (features.py); batch t is a pure
function of (seed, t), so a resumed run sees exactly the batches an uninterrupted run would.

Checkpoints: ``<name>.safetensors`` (trainable weights, bf16 by default) + ``<name>.json`` (the
card: drafter kind and config, target fingerprint, corpus sha, steps, held-out metrics, the
command that made it, the weights' sha256). Loading onto another target, or a truncated /
corrupt file, is a clear error.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

# --------------------------------------------------------------------------- data


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] long
    feats: torch.Tensor  # [B, S, n_layers, H] (target features at the same positions)
    mask: torch.Tensor  # [B, S] bool: response positions whose next token is in the window (loss positions)
    # the target's full-vocabulary log-sum-exp [B, S] fp32 and argmax [B, S] long at the same positions, when the
    # data carries a teacher store (features.load_or_build_teacher); None: an objective computes them from feats
    lse: torch.Tensor | None = None
    t_arg: torch.Tensor | None = None


def prompt_split(corpus, heldout_fraction: float = 0.03, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """The corpus's records grouped by prompt (``question_id``), the groups in a fixed random order (``seed``):
    (held-out groups, train groups), the first ``heldout_fraction`` of the prompts held out (at least one)."""
    groups: dict = {}  # prompt -> its records, prompts in order of first appearance
    for i, r in enumerate(corpus.records):
        groups.setdefault(r.get("question_id", f"#{i}"), []).append(i)
    if len(groups) < 2:
        raise ValueError(f"the corpus needs records of at least 2 prompts (train + held-out), got {len(groups)}")
    keys = list(groups)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(len(keys) * heldout_fraction))
    return [groups[keys[k]] for k in perm[:n_eval]], [groups[keys[k]] for k in perm[n_eval:]]


class TrainData:
    """Random windows over corpus records, split into train / held-out records by a fixed rule.

    The split is by *prompt* (``question_id``): a corpus with several passes holds several answers to one
    prompt, and they all fall on the same side, so the held-out numbers never read an answer to a prompt
    the drafter trained on. For a one-pass corpus this is the same split as one by record."""

    def __init__(self, corpus, store, seq_len: int = 256, heldout_fraction: float = 0.03, seed: int = 0,
                 pack: bool = False, train_fraction: float = 1.0, teacher=None):
        self.corpus, self.store, self.seq_len, self.pack = corpus, store, seq_len, pack
        if teacher is not None and teacher.corpus_sha != corpus.sha:
            raise ValueError(f"the teacher statistics are for corpus {teacher.corpus_sha}, not {corpus.sha}; build them "
                             "from this corpus's feature store (features.load_or_build_teacher)")
        self.teacher = teacher  # features.TeacherStore of the same corpus, or None
        held, train = prompt_split(corpus, heldout_fraction, seed)
        self.heldout = [i for grp in held for i in grp]
        # train_fraction < 1: the first part of the train prompts in this fixed random order, so fractions are
        # nested (1/4 inside 1/2 inside all) and every fraction is read against the same held-out prompts
        if not 0 < train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {train_fraction}")
        n_train = max(1, math.ceil(len(train) * train_fraction))
        self.train = [i for grp in train[:n_train] for i in grp]

    @property
    def train_tokens(self) -> int:
        """Tokens (prompt + response) of the train records: what a data-scaling curve puts on its x axis."""
        return int(self.corpus.index[self.train, 1:3].sum())  # index rows: (offset, prompt_len, response_len)

    def _window(self, rec: int, g: torch.Generator) -> tuple:
        _, pl, rl = (int(x) for x in self.corpus.index[rec])
        n = pl + rl
        S = self.seq_len
        # start anywhere such that the window contains at least one response position
        lo, hi = max(0, pl - S + 2), max(0, n - 2)
        start = lo if hi <= lo else lo + int(torch.randint(hi - lo + 1, (1,), generator=g))
        return self._span(rec, start, min(n, start + S))

    def _span(self, rec: int, start: int, stop: int) -> tuple:
        """Tokens [start, stop) of record ``rec``, their features, the loss mask, and with a teacher store the
        target's (lse, argmax) there (else None, None)."""
        off, pl, rl = (int(x) for x in self.corpus.index[rec])
        n = pl + rl
        toks = self.corpus.tokens[off + start:off + stop].astype(np.int64)
        feats = self.store.rows(off + start, off + stop)
        pos = np.arange(start, stop)
        mask = (pos >= pl - 1) & (pos < n - 1)  # predicting a response token from inside the window
        mask[-1] = False  # its next token is outside the window
        lse, arg = self.teacher.rows(off + start, off + stop) if self.teacher is not None else (None, None)
        return toks, feats, mask, lse, arg

    def batch(self, size: int, g: torch.Generator, heldout: bool = False) -> Batch:
        pool = self.heldout if heldout else self.train
        if self.pack:
            ws = [self._packed(pool, g) for _ in range(size)]
        else:
            ws = [self._window(pool[int(i)], g) for i in torch.randint(len(pool), (size,), generator=g)]
        S = max(len(w[0]) for w in ws)
        nl, H = ws[0][1].shape[1:]
        toks = torch.zeros(size, S, dtype=torch.long)
        feats = torch.zeros(size, S, nl, H, dtype=torch.bfloat16)
        mask = torch.zeros(size, S, dtype=torch.bool)
        lse, t_arg = (torch.zeros(size, S), torch.zeros(size, S, dtype=torch.long)) if self.teacher is not None else (None, None)
        for i, (t, f, m, l_, a_) in enumerate(ws):
            toks[i, :len(t)] = torch.from_numpy(t)
            feats[i, :len(t)] = f
            mask[i, :len(t)] = torch.from_numpy(m)
            if self.teacher is not None:
                lse[i, :len(t)], t_arg[i, :len(t)] = l_, a_
        return Batch(toks, feats, mask, lse, t_arg)

    def _packed(self, pool: list[int], g: torch.Generator) -> tuple:
        """One window of exactly seq_len tokens: whole records drawn at random from ``pool``, one after another
        (the last one cut), so the head trains on positions up to seq_len however short the records are.

        Simplification: each record's features come from the target's pass over that record alone, so a packed
        window teaches the head to attend over long spans and large position offsets, not the target's own
        hidden states at long context. No position predicts across a record boundary (the mask)."""
        parts, n = [], 0
        while n < self.seq_len:
            rec = pool[int(torch.randint(len(pool), (1,), generator=g))]
            length = int(self.corpus.index[rec, 1] + self.corpus.index[rec, 2])
            parts.append(self._span(rec, 0, min(length, self.seq_len - n)))  # a record's last position: no loss
            n += len(parts[-1][0])
        cat = lambda k: torch.cat([p[k] for p in parts]) if parts[0][k] is not None else None  # noqa: E731
        return (np.concatenate([p[0] for p in parts]), cat(1), np.concatenate([p[2] for p in parts]), cat(3), cat(4))


# --------------------------------------------------------------------------- the loop


@dataclass
class TrainConfig:
    steps: int = 600
    batch: int = 8  # windows per step
    seq_len: int = 256
    pack: bool = False  # True: fill each window with whole records one after another (TrainData._packed)
    train_fraction: float = 1.0  # < 1: train on that nested part of the train prompts (data-scaling runs)
    lr: float = 1e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    ckpt_every: int = 100
    seed: int = 0
    autocast: str = "auto"  # "auto": bf16 on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16); "off"

    def __post_init__(self):
        for k in ("steps", "batch", "seq_len", "eval_every", "ckpt_every", "eval_batches"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine to cfg.lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Objective:
    """What a drafter plugs into the loop."""

    kind: str = "objective"
    module: torch.nn.Module
    # card_config keys that shape only the training (e.g. DFlash's anchors per window), not the weights: a warm
    # start may change them
    training_only: tuple[str, ...] = ()
    # True: its batches should carry the target's per-token lse / argmax (Batch.lse, Batch.t_arg; train.teacher_for
    # builds them); it must still work without them (batches built by hand)
    reads_teacher: bool = False

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict]:  # pragma: no cover - protocol
        raise NotImplementedError

    def evaluate(self, batch: Batch) -> dict:  # pragma: no cover - protocol
        raise NotImplementedError

    def card_config(self) -> dict:
        return {}


@dataclass
class TrainResult:
    steps: int
    history: list[dict] = field(default_factory=list)  # {"step", "loss", "lr"} every step
    evals: list[dict] = field(default_factory=list)  # {"step", **metrics}
    seconds: float = 0.0


def evaluate(obj: Objective, data: TrainData, cfg: TrainConfig, device) -> dict:
    """Held-out metrics: ``cfg.eval_batches`` batches of held-out windows drawn from a fixed seed (the same
    windows at every evaluation of a run, and in any run with the same data and config)."""
    g = torch.Generator().manual_seed(cfg.seed + 999_983)
    acc: dict[str, list[float]] = {}
    obj.module.eval()
    with torch.no_grad():
        for _ in range(cfg.eval_batches):
            b = data.batch(cfg.batch, g, heldout=True)
            for k, v in obj.evaluate(_to(b, device)).items():
                acc.setdefault(k, []).append(float(v))
    obj.module.train()
    return {k: float(np.mean(v)) for k, v in acc.items()}


def _to(b: Batch, device) -> Batch:
    opt = lambda x: None if x is None else x.to(device)  # noqa: E731
    return Batch(b.tokens.to(device), b.feats.to(device), b.mask.to(device), opt(b.lse), opt(b.t_arg))


def train(obj: Objective, data: TrainData, cfg: TrainConfig, run_dir: Path | None = None, resume: bool = True,
          progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """Train ``obj.module`` for cfg.steps. With ``run_dir``, a resumable state is saved every
    ``ckpt_every`` steps and picked up again when ``resume``. ``stop_after`` interrupts early
    (tests use it to simulate a crash)."""
    from tqdm.auto import tqdm

    params = [p for p in obj.module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{obj.kind}: no trainable parameters")
    device = params[0].device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    res = TrainResult(steps=0)
    start = 0
    state_path = Path(run_dir) / "state.pt" if run_dir else None
    if state_path and resume and state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st["config"] != asdict(cfg) or st["kind"] != obj.kind:
            raise ValueError(f"{state_path} belongs to another run ({st['kind']}, {st['config']}); use another run_dir")
        obj.module.load_state_dict(st["module"])
        opt.load_state_dict(st["opt"])
        start, res.history, res.evals = st["step"], st["history"], st["evals"]
    autocast = _autocast(device, cfg.autocast)
    obj.module.train()
    t0 = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=f"train {obj.kind}", disable=not progress, initial=start, total=cfg.steps)
    for step in bar:
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, cfg)
        b = _to(data.batch(cfg.batch, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)), device)
        opt.zero_grad(set_to_none=True)  # before loss(): an objective may backward part of its graph there
        with autocast:
            loss, metrics = obj.loss(b)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        res.history.append({"step": step + 1, "loss": float(loss.detach()), "lr": lr_at(step, cfg), "grad_norm": float(gn),
                            **{k: float(v) for k, v in metrics.items()}})
        bar.set_postfix(loss=f"{res.history[-1]['loss']:.3f}")
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            ev = evaluate(obj, data, cfg, device)
            res.evals.append({"step": done, **ev})
            bar.write(f"[{obj.kind}] step {done}: " + " ".join(f"{k}={v:.3f}" for k, v in ev.items()
                                                              if not k.startswith("acc_")))
        if state_path and (done % cfg.ckpt_every == 0 or done == cfg.steps):
            state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_path.with_suffix(".tmp")
            torch.save({"kind": obj.kind, "config": asdict(cfg), "step": done, "module": obj.module.state_dict(),
                        "opt": opt.state_dict(), "history": res.history, "evals": res.evals}, tmp)
            os.replace(tmp, state_path)
        if stop_after is not None and done >= stop_after:
            break
    res.steps = len(res.history)
    res.seconds = time.perf_counter() - t0
    return res


def _autocast(device, mode: str):
    from .models import cpu_has_native_bf16

    if mode == "off":
        return _null()
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return _null()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# --------------------------------------------------------------------------- checkpoints


class CheckpointError(RuntimeError):
    pass


def _sha_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def save_checkpoint(path: str | Path, state: dict[str, torch.Tensor], card: dict, dtype=torch.bfloat16) -> Path:
    """Write ``path``.safetensors + ``path``.json atomically; the card gets the weights' sha256."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    st = path.with_suffix(".safetensors")
    tmp = st.with_suffix(".tmp")
    save_file({k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in state.items()},
              str(tmp))
    os.replace(tmp, st)
    card = {**card, "weights_sha256": _sha_file(st), "weights_dtype": str(dtype).replace("torch.", ""),
            "command": card.get("command") or " ".join(["python", "-m", *sys.argv[:1], *sys.argv[1:]])}
    path.with_suffix(".json").write_text(json.dumps(card, indent=1, default=str))
    return st


def load_checkpoint(path: str | Path, target=None, kind: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a checkpoint; refuse one made for another target / kind, or a corrupt file."""
    from safetensors.torch import load_file

    from .models import fingerprint

    path = Path(path)
    st, cj = path.with_suffix(".safetensors"), path.with_suffix(".json")
    if not st.exists() or not cj.exists():
        hint = f"; train one with `python -m specbook.train {kind}`" if kind else ""
        raise CheckpointError(f"checkpoint {path} needs both {st.name} and {cj.name}{hint}")
    try:
        card = json.loads(cj.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cj}: card is not valid JSON ({e})") from e
    if _sha_file(st) != card.get("weights_sha256"):
        raise CheckpointError(f"{st}: sha256 differs from its card (truncated or corrupt); re-download or retrain "
                              f"with: {card.get('command', 'the command in the card')}")
    if kind is not None and card.get("kind") != kind:
        raise CheckpointError(f"{path} is a {card.get('kind')!r} checkpoint, not {kind!r}")
    if target is not None and card.get("target_fingerprint") != fingerprint(target):
        raise CheckpointError(
            f"{path} was trained for target {card.get('target')!r} (fingerprint {card.get('target_fingerprint')}), "
            f"but this target's fingerprint is {fingerprint(target)}; train one for this target with "
            f"`python -m specbook.train {card.get('kind')} --target ...`")
    try:
        state = load_file(str(st))
    except Exception as e:  # safetensors raises several types for a damaged header
        raise CheckpointError(f"{st}: cannot be read ({e})") from e
    return state, card


def warm_start(obj: Objective, path: str | Path, target=None) -> dict:
    """Start ``obj`` from a checkpoint's trained weights (continued training, e.g. on a wider corpus).

    The checkpoint must be of obj's kind, for this target, with the same head config (``card_config`` less the
    objective's ``training_only`` keys) and the same tensors: a warm start never silently reshapes or drops a
    weight. A draft vocabulary of the same size but other tokens (the top tokens of another corpus) is taken only
    where no trained tensor is indexed by it, i.e. the vocabulary just picks rows of the target's frozen LM head
    (EAGLE, Medusa, MTP, DFlash); a head with rows of its own per draft token (DSpark's Markov head, EAGLE-3's LM
    head over its d2t vocabulary) is refused. Returns what the new card records about it (path, weights sha,
    steps, the corpus the weights had already seen, whether the vocabulary changed)."""
    state, card = load_checkpoint(path, target=target, kind=obj.kind)
    mine = obj.state()
    def shape(config: dict | None) -> str:  # the config less the keys a continued run may change
        return json.dumps({k: v for k, v in (config or {}).items() if k not in getattr(obj, "training_only", ())},
                          sort_keys=True)

    same_config = shape(card.get("config")) == shape(obj.card_config())
    if not same_config:
        raise CheckpointError(f"{path} has config {card.get('config')}, this run builds {obj.card_config()}; "
                              f"pass the settings the checkpoint was trained with (its command: {card.get('command')})")
    if set(state) != set(mine):
        raise CheckpointError(f"{path} holds tensors {sorted(set(state) ^ set(mine))} that this {obj.kind} head "
                              f"does not, or lacks them")
    index = [k for k, v in mine.items() if not v.is_floating_point()]  # the draft vocabulary: vocab, or d2t / t2d
    vocab_changed = any(not torch.equal(state[k].cpu(), mine[k].cpu()) for k in index)
    sizes = {len(mine[k]) for k in index}
    rows = [k for k, v in mine.items() if k not in index and sizes & set(v.shape)] if vocab_changed else []
    if rows:
        raise CheckpointError(f"{path} drafts from another vocabulary than this corpus's top tokens, and {rows[:3]} "
                              f"hold a row per draft token; keep the checkpoint's own vocabulary (`python -m "
                              f"specbook.train {obj.kind} --init {path} --keep-vocab`, checkpoint_vocab)")
    params = obj.module.state_dict()
    unknown = [k for k in mine if k not in index and k not in params]
    if unknown:
        raise CheckpointError(f"{obj.kind}: tensors {unknown[:3]} of its state are not its module's; "
                              f"this objective cannot be warm-started")
    with torch.no_grad():
        for k, v in state.items():
            if k not in index:  # the vocabulary stays this run's
                params[k].copy_(v.to(params[k].dtype))
    return {"path": str(path), "weights_sha256": card["weights_sha256"], "steps": card.get("steps"),
            "corpus_sha": card.get("corpus_sha"), "vocab_changed": bool(vocab_changed)}


def checkpoint_vocab(path: str | Path) -> torch.Tensor:
    """The target ids a checkpoint drafts from, in its draft-index order [Vd] (``vocab``, or EAGLE-3's offsets:
    id = index + d2t[index]). Continuing a head whose tensors hold a row per draft token on another corpus needs
    it: that corpus's own top tokens would give every row to another token (``warm_start`` refuses them)."""
    from .drafters.eagle3 import draft_ids

    state, card = load_checkpoint(path)
    if "vocab" in state:
        return state["vocab"].long()
    if "d2t" in state:
        return draft_ids(state["d2t"])
    raise CheckpointError(f"{path} ({card.get('kind')}) drafts from the target's full vocabulary: there is no draft "
                          f"vocabulary to keep; drop --keep-vocab (or pass --vocab 0)")


def interpolate(obj: Objective, start: str | Path, end: str | Path, alpha: float, target=None) -> dict:
    """Weight-space ensembling along a fine-tuning path (WiSE-FT, Wortsman et al. 2022): ``obj``'s weights become
    ``(1 - alpha) * start + alpha * end``, where ``end`` was warm-started from ``start`` (its card's ``init`` names
    start's weights). Continued training on a wider corpus moves a head towards the new data and away from some of
    what it knew; a point between the two keeps more of both, at no training cost. Only a checkpoint and its own
    continuation are mixed: two heads trained apart share no path, and their average is not a head of either kind.

    ``end`` is loaded by ``warm_start`` (kind, target, head config, tensors and vocabulary all checked there; the
    vocabulary stays ``obj``'s own). Returns what the card records: both ends and alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (0 = start's weights, 1 = end's), got {alpha}")
    ends = {"end": warm_start(obj, end, target)}
    b_card = json.loads(Path(end).with_suffix(".json").read_text())  # warm_start has just verified it and its weights
    a_state, a_card = load_checkpoint(start, target=target, kind=obj.kind)
    if (b_card.get("init") or {}).get("weights_sha256") != a_card["weights_sha256"]:
        raise CheckpointError(f"{end} was not warm-started from {start} (its card's init: {b_card.get('init')}); "
                              f"interpolate a checkpoint with one trained on from it (`python -m specbook.train "
                              f"{obj.kind} --init {start} ...`)")
    ends["start"] = {"path": str(start), "weights_sha256": a_card["weights_sha256"], "steps": a_card.get("steps"),
                     "corpus_sha": a_card.get("corpus_sha")}
    index = {k for k, v in obj.state().items() if not v.is_floating_point()}  # the draft vocabulary stays obj's
    params = obj.module.state_dict()
    with torch.no_grad():
        for k, v in a_state.items():
            if k not in index:
                params[k].copy_(torch.lerp(v.to(params[k].dtype), params[k], alpha))
    return {**ends, "alpha": alpha}
