"""Cached target features: the target's hidden states over the corpus, computed once.

Every drafter is trained against what the target computes on the corpus: its final (post-norm)
hidden state gives the target's next-token distribution (through the frozen LM head), and
low/mid/high layers feed EAGLE-3 / DSpark. Running the target once and memory-mapping the result
makes training cost only the drafter's own forward/backward.

Layer indices follow ``output_hidden_states``: 0 = embeddings, l = output of decoder layer l-1,
-1 = the final hidden state after the last norm (what the LM head reads).

Stored under ``$SPECBOOK_CACHE/features/<key>/`` (not committed): ``feats.bin`` (bf16 bits,
[T, n_layers, H], row t = token t of corpus.tokens) + ``meta.json``. The key hashes the target
fingerprint, the corpus sha and the layers; ``load_or_build`` rebuilds a stale or partial cache
and refuses a store whose metadata does not match (never silently the wrong features).

The target's next-token statistics per corpus token can be kept too (``load_or_build_teacher``:
``teacher-<key>/lse.bin`` fp32 + ``arg.bin`` int32 + ``teacher.json``, 8 bytes a token, read from any store that
holds the final state): the log-sum-exp and the argmax of the full-vocabulary logits. A drafter whose loss reads the target only
through its draft-vocabulary rows (EAGLE-3, DFlash / DSpark) then computes those rows each step instead of all V.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import Corpus


class StaleFeatures(RuntimeError):
    pass


def feature_key(fingerprint: str, corpus_sha: str, layers: tuple[int, ...]) -> str:
    return hashlib.sha256(json.dumps([fingerprint, corpus_sha, list(layers)]).encode()).hexdigest()[:16]


@dataclass
class FeatureStore:
    path: Path
    meta: dict
    data: np.ndarray  # int16 view of bf16, [T, n_stored_layers, H]
    cols: tuple[int, ...] | None = None  # a view of some stored layers (a store built for more layers), else all

    @property
    def layers(self) -> tuple[int, ...]:
        stored = tuple(self.meta["layers"])
        return stored if self.cols is None else tuple(stored[c] for c in self.cols)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Features of corpus tokens [start, stop) -> bf16 tensor [stop - start, n_layers, H]."""
        x = self.data[start:stop] if self.cols is None else self.data[start:stop][:, list(self.cols)]
        return torch.from_numpy(np.array(x)).view(torch.bfloat16)

    def select(self, layers: tuple[int, ...]) -> "FeatureStore":
        """The same store restricted to ``layers`` (each must be stored), in that order."""
        stored = list(self.meta["layers"])
        missing = [x for x in layers if x not in stored]
        if missing:
            raise StaleFeatures(f"{self.path} holds layers {stored}, not {missing}")
        return FeatureStore(self.path, self.meta, self.data, tuple(stored.index(x) for x in layers))

    def check(self, fingerprint: str, corpus_sha: str, layers: tuple[int, ...]) -> None:
        want = {"target_fingerprint": fingerprint, "corpus_sha": corpus_sha, "layers": list(layers)}
        got = {**{k: self.meta.get(k) for k in want}, "layers": list(self.layers)}
        if got != want:
            raise StaleFeatures(f"feature cache {self.path} was built for {got}, not {want}; rebuild it "
                                "(specbook.features.load_or_build does so automatically)")


def store_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``layers`` with index ``num_layers`` written -1: transformers' output_hidden_states[L] is its
    last_hidden_state (after the final norm; fastpath does the same), so the one tensor has one name and a store
    that holds the final state serves a tap at L."""
    return tuple(-1 if x == num_layers else x for x in layers)


def _root() -> Path:
    from .models import cache_dir

    return cache_dir() / "features"


def open_store(path: Path) -> FeatureStore:
    meta_p = path / "meta.json"
    if not meta_p.exists():
        raise StaleFeatures(f"{path}: meta.json missing (partial build)")
    meta = json.loads(meta_p.read_text())
    shape = tuple(meta["shape"])
    f = path / "feats.bin"
    if not f.exists() or f.stat().st_size != int(np.prod(shape)) * 2:
        raise StaleFeatures(f"{f}: missing or wrong size (partial build)")
    return FeatureStore(path, meta, np.memmap(f, dtype=np.int16, mode="r", shape=shape))


@torch.inference_mode()
def build(target, corpus: Corpus, layers: tuple[int, ...], out: Path, batch_tokens: int = 8192,
          progress: bool = True, save_every_s: float = 60.0) -> FeatureStore:
    """Run the target over every corpus sequence once; write features to ``out`` atomically. Resumable: an
    interrupted build (``out``.tmp, its progress.json naming the same target, corpus, layers and batching) goes on
    from the last batch it recorded (progress is saved every ``save_every_s`` seconds, not per batch: each save
    waits for the memory map to reach the disk) instead of starting over."""
    from tqdm.auto import tqdm

    from .models import fingerprint

    H = target.config.hidden_size
    T = int(corpus.tokens.shape[0])
    tmp = out.with_name(out.name + ".tmp")
    job = {"target_fingerprint": fingerprint(target), "corpus_sha": corpus.sha, "layers": list(layers),
           "shape": [T, len(layers), H], "batch_tokens": batch_tokens}
    done = _resumable(tmp, job)
    if done == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    mm = np.memmap(tmp / "feats.bin", dtype=np.int16, mode="r+" if done else "w+", shape=(T, len(layers), H))
    order = sorted(range(len(corpus)), key=lambda i: int(corpus.index[i, 1] + corpus.index[i, 2]))
    batches, cur, cur_len = [], [], 0
    for i in order:  # group similar lengths; right padding needs no mask (below)
        n = int(corpus.index[i, 1] + corpus.index[i, 2])
        if cur and max(cur_len, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len = max(cur_len, n)
    if cur:
        batches.append(cur)
    dev = target.device
    saved = time.monotonic()
    for k, b in enumerate(tqdm(batches[done:], desc="features", disable=not progress, initial=done,
                               total=len(batches)), start=done):
        seqs = [corpus.sequence(i) for i in b]
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(b), L, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.from_numpy(s)
        # no attention mask: under causal attention a real token never sees the padding after it, and without a
        # mask SDPA runs its causal kernel instead of a masked one (1.5x faster at 2k tokens; same real-token rows)
        o = target.model(input_ids=ids.to(dev), output_hidden_states=True)
        hs = [o.last_hidden_state if i == -1 else o.hidden_states[i] for i in layers]
        stacked = torch.stack(hs, dim=2).to(torch.bfloat16).cpu()  # [B, L, n_layers, H]
        for r, (i, s) in enumerate(zip(b, seqs)):
            off = int(corpus.index[i, 0])
            mm[off:off + len(s)] = stacked[r, :len(s)].view(torch.int16).numpy()
        if time.monotonic() - saved >= save_every_s:
            mm.flush()  # what progress.json names is on disk
            _write_json(tmp / "progress.json", {**job, "batches_done": k + 1})
            saved = time.monotonic()
    mm.flush()
    del mm
    (tmp / "progress.json").unlink(missing_ok=True)
    meta = {**{k: v for k, v in job.items() if k != "batch_tokens"}, "dtype": "bfloat16-bits-as-int16",
            "target_dtype": str(target.dtype)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return open_store(out)


def teacher_stats(final: torch.Tensor, W: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """final [..., H] (the target's final states), W [V, H] (its LM head) -> (log-sum-exp [...] fp32, argmax [...]
    long) of the full-vocabulary logits final @ W.T in fp32, ``chunk`` rows at a time (never [N, V] at once)."""
    x = final.reshape(-1, final.shape[-1])
    Wf = W.float()
    lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    arg = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for i in range(0, x.shape[0], chunk):
        z = x[i:i + chunk].float() @ Wf.T  # [n, V]
        lse[i:i + chunk], arg[i:i + chunk] = torch.logsumexp(z, -1), z.argmax(-1)
    return lse.view(final.shape[:-1]), arg.view(final.shape[:-1])


@dataclass
class TeacherStore:
    """Per corpus token: the target's log-sum-exp and argmax over its full vocabulary (see the module docstring)."""

    lse: np.ndarray  # float32 [T]
    arg: np.ndarray  # int32 [T]
    corpus_sha: str  # the corpus whose tokens the rows are (TrainData refuses another corpus's)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, stop) -> (lse [n] fp32, argmax [n] long)."""
        return torch.from_numpy(np.array(self.lse[start:stop])), torch.from_numpy(self.arg[start:stop].astype(np.int64))


def load_or_build_teacher(store: FeatureStore, W: torch.Tensor, progress: bool = True,
                          rows_per_pass: int = 65536) -> TeacherStore:
    """The teacher statistics of ``store``'s tokens under the LM head ``W`` [V, H] (fp32). They depend on the target,
    the corpus and the head only, so every store of one target and corpus shares them: ``teacher-<key>/`` beside
    the stores. Read when they name the same target, corpus, rows and head; else computed from the stored final
    states (one pass of the head over the corpus) and written atomically. The store must hold the final state."""
    from filelock import FileLock

    if -1 not in store.meta["layers"]:
        raise StaleFeatures(f"{store.path} holds layers {store.meta['layers']}, not the final state (-1) the teacher "
                            "reads; build the features with it (train.METHODS' eagle3 / dflash / dspark layers do)")
    T = int(store.meta["shape"][0])
    job = {"target_fingerprint": store.meta["target_fingerprint"], "corpus_sha": store.meta["corpus_sha"], "rows": T,
           "vocab": int(W.shape[0]), "head_sha": _tensor_sha(W)}
    where = store.path.parent / f"teacher-{hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]}"
    where.mkdir(parents=True, exist_ok=True)
    lse_p, arg_p, meta_p = (where / f for f in ("lse.bin", "arg.bin", "teacher.json"))
    with FileLock(str(where) + ".lock"):
        try:
            if json.loads(meta_p.read_text()) == job and lse_p.stat().st_size == arg_p.stat().st_size == 4 * T:
                return TeacherStore(np.memmap(lse_p, np.float32, "r", shape=(T,)),
                                    np.memmap(arg_p, np.int32, "r", shape=(T,)), job["corpus_sha"])
        except (OSError, ValueError):
            pass  # missing or partial: computed below
        lse, arg = _teacher_pass(store.select((-1,)), W, T, rows_per_pass, progress)
        meta_p.unlink(missing_ok=True)  # no description may name the files while they are replaced
        for path, arr in ((lse_p, lse), (arg_p, arg)):
            part = path.with_name(path.name + ".part")
            arr.tofile(part)
            os.replace(part, path)
        _write_json(meta_p, job)  # last: the files it names are complete
    return TeacherStore(lse, arg, job["corpus_sha"])


@torch.no_grad()
def _teacher_pass(final: FeatureStore, W: torch.Tensor, T: int, rows_per_pass: int, progress: bool):
    from tqdm.auto import tqdm

    lse, arg = np.empty(T, np.float32), np.empty(T, np.int32)
    for i in tqdm(range(0, T, rows_per_pass), desc="teacher", disable=not progress):
        l_, a_ = teacher_stats(final.rows(i, min(T, i + rows_per_pass))[:, 0].to(W.device), W)
        lse[i:i + len(l_)], arg[i:i + len(l_)] = l_.cpu().numpy(), a_.cpu().numpy()
    return lse, arg


def _tensor_sha(W: torch.Tensor) -> str:
    return hashlib.sha256(W.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _write_json(path: Path, obj: dict) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(obj))
    os.replace(part, path)


def _resumable(tmp: Path, job: dict) -> int:
    """Batches an interrupted build of this very job already wrote to ``tmp`` (0 = start over)."""
    try:
        prog = json.loads((tmp / "progress.json").read_text())
        size_ok = (tmp / "feats.bin").stat().st_size == int(np.prod(job["shape"])) * 2
    except (OSError, ValueError):
        return 0
    same = all(prog.get(k) == v for k, v in job.items())
    return int(prog.get("batches_done", 0)) if same and size_ok else 0


def load_or_build(target, corpus: Corpus, layers: tuple[int, ...] = (-1,), root: Path | None = None,
                  progress: bool = True, **kw) -> FeatureStore:
    """The feature store for (target, corpus, layers): reused when valid, rebuilt when stale or partial."""
    from filelock import FileLock

    from .models import fingerprint

    fp = fingerprint(target)
    root = Path(root) if root else _root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / feature_key(fp, corpus.sha, tuple(layers))
    with FileLock(str(path) + ".lock"):
        try:
            store = open_store(path)
            store.check(fp, corpus.sha, tuple(layers))
            return store
        except StaleFeatures:
            pass
        wider = _wider_store(root, fp, corpus.sha, tuple(layers))
        if wider is not None:
            return wider
        return build(target, corpus, tuple(layers), path, progress=progress, **kw)


def _wider_store(root: Path, fp: str, corpus_sha: str, layers: tuple[int, ...]) -> FeatureStore | None:
    """A complete store of the same target and corpus that holds every requested layer (EAGLE's final state
    is one of EAGLE-3's four), viewed as just those layers: no second pass of the target over the corpus."""
    for meta_p in sorted(root.glob("*/meta.json")):
        try:
            meta = json.loads(meta_p.read_text())
            if (meta.get("target_fingerprint"), meta.get("corpus_sha")) != (fp, corpus_sha):
                continue
            if not set(layers) <= set(meta.get("layers", [])):
                continue
            return open_store(meta_p.parent).select(layers)
        except (StaleFeatures, ValueError, OSError):
            continue
    return None
