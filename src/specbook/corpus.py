"""The self-distilled corpus: what the target itself answers to the train prompts.

    python -m specbook.corpus generate [--target smollm2-135m-instruct] [--max-new-tokens 320]
                                       [--batch 96] [--dtype bf16] [--passes 1] [--limit N]
    python -m specbook.corpus info

Drafters learn the *target's* distribution, so the training text is the target's own output
(Medusa's self-distillation). Generation runs through our batched AR loop (``decoding.generate``,
left padding + KV cache), sorted by prompt length to waste little padding.

Storage (committed, a few MB):
    data/corpus/tokens.npy    uint16/uint32 [T]   prompt ids followed by response ids, record after record
    data/corpus/index.npy     int64 [N, 3]        (offset, prompt_len, response_len) per record
    data/corpus/records.jsonl                     question_id, category, pass per record (same order)
    data/corpus/manifest.json                     target fingerprint, settings, counts, sha256 of each file

Resumable: each finished batch is written atomically as a shard under data/corpus/.work/<key>/;
a rerun skips the shards that exist (no duplicates, no gaps) and ``finalize`` packs them.
A prompt that does not fit the context with max_new_tokens is skipped and counted, never truncated.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .models import machine_info
from .prompts import ROOT, load_prompts

CORPUS_DIR = ROOT / "data" / "corpus"
FILES = ("tokens.npy", "index.npy", "records.jsonl")


@dataclass(frozen=True)
class CorpusSettings:
    target: str = "smollm2-135m-instruct"
    prompts: str = "train"
    max_new_tokens: int = 320
    max_prompt_tokens: int = 1024
    batch: int = 96
    dtype: str = "bf16"
    temperature: float = 0.0  # pass 0 is greedy (what T=0 benchmarks see); later passes sample
    later_pass_temperature: float = 0.8
    passes: int = 1
    seed: int = 0

    def key(self, fingerprint: str) -> str:
        # `passes` is not part of the key: rerunning with more passes reuses the finished ones.
        d = {k: v for k, v in asdict(self).items() if k != "passes"}
        blob = json.dumps({**d, "fp": fingerprint}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def _atomic_save_npz(path: Path, **arrays) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def tokenize_prompts(tokenizer, recs: list[dict], max_prompt_tokens: int) -> tuple[list[tuple[dict, list[int]]], int]:
    """Chat-template the first turn of each record. Returns (kept, n_skipped_too_long)."""
    kept, skipped = [], 0
    for r in recs:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        kept.append((r, list(ids)))
    return kept, skipped


def generate_corpus(settings: CorpusSettings, out_dir: Path = CORPUS_DIR, limit: int | None = None,
                    progress: bool = True, model=None, tokenizer=None, stop_after: int | None = None) -> dict | None:
    """Generate (or resume) and finalize the corpus. Returns the manifest.

    ``model``/``tokenizer`` override loading ``settings.target`` (tests use a tiny model);
    ``stop_after`` ends the run after that many new batches without finalizing (simulates an
    interruption; returns None).
    """
    from tqdm.auto import tqdm

    from .decoding import generate, pad_left
    from .models import fingerprint, load_model
    from .sampling import SamplingConfig

    if model is None:
        model, tok = load_model(settings.target, dtype=settings.dtype)
    else:
        tok = tokenizer
    fp = fingerprint(model)
    recs = load_prompts(settings.prompts, limit=limit)
    ctx = int(model.config.max_position_embeddings)
    max_prompt = min(settings.max_prompt_tokens, ctx - settings.max_new_tokens)
    items, skipped = tokenize_prompts(tok, recs, max_prompt)
    if skipped:
        print(f"[corpus] skipped {skipped} prompts longer than {max_prompt} tokens (not truncated)", file=sys.stderr)
    if not items:
        raise ValueError("no prompt fits the context; nothing to generate")
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]))
    batches = [order[i:i + settings.batch] for i in range(0, len(order), settings.batch)]
    key = settings.key(fp) + (f"-limit{limit}" if limit else "")
    work = out_dir / ".work" / key
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(p, b) for p in range(settings.passes) for b in range(len(batches))]
    restored = restore_shards(out_dir, key, items, batches, jobs, work, settings, fp, limit)
    if restored:
        print(f"[corpus] reused {restored} finished batches from the corpus in {out_dir}", file=sys.stderr)
    todo = [(p, b) for p, b in jobs if not (work / f"p{p}_b{b:05d}.npz").exists()]
    t_start = time.perf_counter()
    made = done_now = 0
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="corpus", unit="batch", disable=not progress)
    for p, b in todo:
        idx = batches[b]
        ids, mask = pad_left([items[i][1] for i in idx], tok.pad_token_id)
        temp = settings.temperature if p == 0 else settings.later_pass_temperature
        cfg = SamplingConfig(temperature=temp)
        gen = None if cfg.greedy else torch.Generator().manual_seed(settings.seed * 1_000_003 + p * 10_007 + b)
        res = generate(model, ids.to(model.device), mask.to(model.device), max_new_tokens=settings.max_new_tokens,
                       sampling=cfg, generator=gen, eos_token_id=tok.eos_token_id)
        made += res.stats.new_tokens
        _save_shard(work / f"p{p}_b{b:05d}.npz", idx, res.tokens)
        bar.update(1)
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t_start):.0f}")
        done_now += 1
        if stop_after is not None and done_now >= stop_after:
            bar.close()
            return None
    bar.close()
    gen_seconds = time.perf_counter() - t_start
    return finalize(settings, items, jobs, work, out_dir, fp, skipped, gen_seconds, tok)


def _save_shard(path: Path, idx: list[int], resp: list) -> None:
    resp = [np.asarray(r, dtype=np.int64) for r in resp]
    _atomic_save_npz(path, item=np.asarray(idx, dtype=np.int64), lens=np.asarray([len(r) for r in resp], dtype=np.int64),
                     resp=np.concatenate(resp) if resp else np.zeros(0, np.int64))


def restore_shards(out_dir: Path, key: str, items, batches, jobs, work: Path, settings, fp: str,
                   limit: int | None) -> int:
    """Rebuild missing shards from the corpus already finalized in ``out_dir`` when it was made with the same
    key (target fingerprint + settings except ``passes``): a clean clone has the committed corpus but no
    ``.work``, and ``--passes 2`` should then generate pass 1 only. A shard is restored only if every one of
    its prompts has a record of that pass with the same prompt ids; anything else is generated."""
    if limit or not (Path(out_dir) / "manifest.json").exists():
        return 0
    try:
        old = load_corpus(Path(out_dir))
        same = CorpusSettings(**{k: v for k, v in old.manifest["settings"].items()
                                 if k in CorpusSettings.__dataclass_fields__}).key(old.manifest["target_fingerprint"])
    except (CorpusError, TypeError, KeyError):
        return 0  # unreadable or of another kind: generate everything
    if same != key or old.manifest["target_fingerprint"] != fp:
        return 0
    where = {(r["question_id"], r.get("pass", 0)): i for i, r in enumerate(old.records)}
    n = 0
    for p, b in jobs:
        path = work / f"p{p}_b{b:05d}.npz"
        rows = [where.get((items[i][0]["question_id"], p)) for i in batches[b]]
        if path.exists() or None in rows:
            continue
        seqs = [old.sequence(r).tolist() for r in rows]
        pls = [old.prompt_len(r) for r in rows]
        if any(seq[:pl] != items[i][1] for seq, pl, i in zip(seqs, pls, batches[b])):
            continue
        _save_shard(path, batches[b], [seq[pl:] for seq, pl in zip(seqs, pls)])
        n += 1
    return n


def finalize(settings, items, jobs, work: Path, out_dir: Path, fp: str, skipped: int, gen_seconds: float, tok) -> dict:
    """Pack the finished shards (in job order) into the committed corpus files."""
    recs = []
    for p, b in jobs:
        z = np.load(work / f"p{p}_b{b:05d}.npz")
        pos = 0
        for i, n in zip(z["item"].tolist(), z["lens"].tolist()):
            r, pids = items[i]
            recs.append((pids, z["resp"][pos:pos + n].tolist(),
                         {"question_id": r["question_id"], "category": r.get("category", ""), "pass": p}))
            pos += n
    cmd = "python -m specbook.corpus generate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["generate"] else ""
    return write_corpus(out_dir, recs, vocab_size=len(tok), target=settings.target, fingerprint=fp,
                        settings=asdict(settings), extra={"skipped_too_long": skipped,
                                                          "generation_seconds_this_run": round(gen_seconds, 1),
                                                          "command": cmd})


def write_corpus(out_dir: Path, recs: list[tuple[list[int], list[int], dict]], *, vocab_size: int, target: str,
                 fingerprint: str, settings: dict, extra: dict | None = None) -> dict:
    """Write (prompt ids, response ids, meta) records as tokens/index/records + manifest (sha256 of each file)."""
    dt = np.uint16 if vocab_size <= 65535 else np.uint32
    toks, index, meta = [], [], []
    off = 0
    for pids, resp, m in recs:
        toks += [np.asarray(pids, dtype=dt), np.asarray(resp, dtype=dt)]
        index.append((off, len(pids), len(resp)))
        off += len(pids) + len(resp)
        meta.append(m)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "tokens.npy", np.concatenate(toks) if toks else np.zeros(0, dt))
    np.save(out_dir / "index.npy", np.asarray(index, dtype=np.int64).reshape(-1, 3))
    with open(out_dir / "records.jsonl", "w") as f:
        for m in meta:
            f.write(json.dumps(m) + "\n")
    idx = np.asarray(index, dtype=np.int64).reshape(-1, 3)
    manifest = {
        "target": target, "target_fingerprint": fingerprint, "settings": settings, "records": len(index),
        "prompt_tokens": int(idx[:, 1].sum()), "response_tokens": int(idx[:, 2].sum()),
        "skipped_too_long": 0, "generation_seconds_this_run": 0.0, "machine": machine_info(),
        **(extra or {}),
        "files": {f: {"sha256": _sha(out_dir / f), "bytes": (out_dir / f).stat().st_size} for f in FILES},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


@dataclass
class Corpus:
    """Read-only view of a finalized corpus."""

    tokens: np.ndarray  # [T]
    index: np.ndarray  # [N, 3] (offset, prompt_len, response_len)
    records: list[dict]
    manifest: dict

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, i: int) -> np.ndarray:
        off, pl, rl = self.index[i]
        return self.tokens[off:off + pl + rl].astype(np.int64)

    def prompt_len(self, i: int) -> int:
        return int(self.index[i, 1])

    @property
    def sha(self) -> str:
        """One hash for the whole corpus (of the per-file sha256s), keys the feature cache."""
        blob = json.dumps({f: self.manifest["files"][f]["sha256"] for f in FILES}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def subset(corpus: "Corpus", n: int, out_dir: Path, spread: bool = False) -> "Corpus":
    """``n`` records as a corpus of their own: the first ``n`` (quick runs: notebooks in FAST mode, smoke
    tests) or, with ``spread``, ``n`` evenly spaced records (every category; training on a slow machine)."""
    recs = []
    n = min(n, len(corpus))
    picks = np.linspace(0, len(corpus) - 1, n).round().astype(int).tolist() if spread else range(n)
    for i in picks:
        seq = corpus.sequence(i).tolist()
        pl = corpus.prompt_len(i)
        recs.append((seq[:pl], seq[pl:], corpus.records[i]))
    m = corpus.manifest
    write_corpus(out_dir, recs, vocab_size=65535 if corpus.tokens.dtype == np.uint16 else 1 << 31, target=m["target"],
                 fingerprint=m["target_fingerprint"],
                 settings={**m["settings"], "subset_of": corpus.sha, "n": n, "spread": spread})
    return load_corpus(out_dir)


def top_tokens(corpus: "Corpus", n: int) -> tuple[np.ndarray, float]:
    """The ``n`` most frequent response tokens (a reduced draft vocabulary) and the share of response
    tokens they cover."""
    counts = np.zeros(int(corpus.tokens.max()) + 1, dtype=np.int64)
    for off, pl, rl in corpus.index:
        np.add.at(counts, corpus.tokens[off + pl:off + pl + rl].astype(np.int64), 1)
    order = np.argsort(-counts, kind="stable")[:n]
    return np.sort(order), float(counts[order].sum() / max(counts.sum(), 1))


class CorpusError(RuntimeError):
    pass


def load_corpus(path: Path = CORPUS_DIR, verify: bool = True) -> Corpus:
    """Load and (by default) check every file against the manifest's sha256."""
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.exists():
        raise CorpusError(f"no corpus at {path} (manifest.json missing); run `python -m specbook.corpus generate`")
    manifest = json.loads(mpath.read_text())
    if verify:
        for f in FILES:
            if not (path / f).exists():
                raise CorpusError(f"{path / f} missing; regenerate the corpus")
            if _sha(path / f) != manifest["files"][f]["sha256"]:
                raise CorpusError(f"{path / f}: sha256 differs from manifest.json (corrupt or edited); regenerate")
    tokens = np.load(path / "tokens.npy", mmap_mode="r")
    index = np.load(path / "index.npy")
    records = [json.loads(x) for x in (path / "records.jsonl").read_text().splitlines() if x.strip()]
    if len(records) != len(index):
        raise CorpusError(f"{path}: {len(records)} records but {len(index)} index rows")
    return Corpus(tokens=tokens, index=index, records=records, manifest=manifest)


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specbook.corpus", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    d = CorpusSettings()
    for f in ("target", "prompts", "dtype"):
        g.add_argument(f"--{f}", default=getattr(d, f))
    for f in ("max_new_tokens", "max_prompt_tokens", "batch", "passes", "seed"):
        g.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(d, f))
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")
    g.add_argument("--out", default=str(CORPUS_DIR))
    sub.add_parser("info")
    a = ap.parse_args(argv)
    if a.cmd == "generate":
        s = CorpusSettings(target=a.target, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                           max_prompt_tokens=a.max_prompt_tokens, batch=a.batch, dtype=a.dtype,
                           temperature=a.temperature, passes=a.passes, seed=a.seed)
        m = generate_corpus(s, Path(a.out), limit=a.limit)
    else:
        m = load_corpus().manifest
    print(json.dumps({k: m[k] for k in ("records", "prompt_tokens", "response_tokens", "skipped_too_long",
                                        "generation_seconds_this_run")}, indent=1))


if __name__ == "__main__":
    main()
