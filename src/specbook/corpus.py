"""The self-distilled corpus: what the target itself answers to the train prompts.

    python -m specbook.corpus generate [--target smollm2-135m-instruct] [--max-new-tokens 320]
                                       [--batch 96] [--dtype bf16] [--passes 1] [--limit N]
    python -m specbook.corpus info

Drafters learn the *target's* distribution, so the training text is the target's own output
(Medusa's self-distillation). Generation runs through our batched AR loop (``decoding.generate``,
left padding + KV cache), sorted by prompt length to waste little padding. A prompt with several
turns is a real conversation: turn k is asked after the target's own answers to turns < k.

Storage (committed, a few MB):
    data/corpus/tokens.npy    uint16/uint32 [T]   prompt ids followed by response ids, record after record
    data/corpus/index.npy     int64 [N, 3]        (offset, prompt_len, response_len) per record
    data/corpus/records.jsonl                     question_id, category, pass, turn per record (same order)
    data/corpus/manifest.json                     target fingerprint, settings, counts, sha256 of each file

Resumable: each finished batch is written atomically as a shard under data/corpus/.work/<key>/;
a rerun skips the shards that exist (no duplicates, no gaps) and ``finalize`` packs them. Records
the committed corpus already holds (same target, output settings and prompt ids) are reused, so
more prompts or more passes generate only what is new.
A prompt that does not fit the context with max_new_tokens is skipped and counted, never truncated.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
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
    max_prompt_tokens: int = 3072  # long-document prompts reach ~2.7k tokens
    batch: int = 96
    batch_tokens: int = 16384  # padded prompt tokens per batch: long documents run a few at a time
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


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template of ``messages`` with the generation prompt, as a list of ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tokenize_prompts(tokenizer, recs: list[dict], max_prompt_tokens: int) -> tuple[list[tuple[dict, list[int]]], int]:
    """Chat-template the first turn of each record. Returns (kept, n_skipped_too_long)."""
    kept, skipped = [], 0
    for r in recs:
        ids = chat_ids(tokenizer, [{"role": "user", "content": r["turns"][0]}])
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        kept.append((r, ids))
    return kept, skipped


def follow_up_ids(tokenizer, rec: dict, turn: int, answers: list[list[int]]) -> list[int]:
    """Turn ``turn`` of a conversation: the user's earlier turns with the target's own answers to them."""
    msgs = []
    for k in range(turn):
        msgs.append({"role": "user", "content": rec["turns"][k]})
        msgs.append({"role": "assistant", "content": tokenizer.decode(answers[k], skip_special_tokens=True).strip()})
    msgs.append({"role": "user", "content": rec["turns"][turn]})
    return chat_ids(tokenizer, msgs)


def plan_batches(lengths: list[int], batch: int, batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches of at most ``batch`` rows and ``batch_tokens`` padded prompt
    tokens (long documents go a few at a time; short prompts ``batch`` at a time)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) == batch or lengths[i] * (len(cur) + 1) > batch_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


# fields that decide what the target answers; a record made under the same ones is reused as it is
OUTPUT_FIELDS = ("max_new_tokens", "dtype", "temperature", "later_pass_temperature", "seed")


def reusable_records(out_dir: Path, settings: "CorpusSettings", fp: str, limit: int | None) -> tuple[dict, str]:
    """Records of the corpus already finalized in ``out_dir`` that this run would reproduce: same target
    fingerprint and output settings. Keyed by (question_id, pass, turn) -> (prompt ids, response ids); a record
    is reused only where its prompt ids equal this run's (checked by the caller). Returns (records, corpus sha):
    a clean clone holds the committed corpus but no ``.work``, so more passes or more prompts generate only
    what is new."""
    if limit or not (Path(out_dir) / "manifest.json").exists():
        return {}, "none"
    try:
        old = load_corpus(Path(out_dir))
        same = all(old.manifest["settings"].get(f) == getattr(settings, f) for f in OUTPUT_FIELDS)
    except (CorpusError, KeyError):
        return {}, "none"  # unreadable or of another kind: generate everything
    if not same or old.manifest["target_fingerprint"] != fp:
        return {}, "none"
    out = {}
    for i, r in enumerate(old.records):
        seq, pl = old.sequence(i).tolist(), old.prompt_len(i)
        out[(r["question_id"], r.get("pass", 0), r.get("turn", 0))] = (seq[:pl], seq[pl:])
    return out, old.sha


def generate_corpus(settings: CorpusSettings, out_dir: Path = CORPUS_DIR, limit: int | None = None,
                    progress: bool = True, model=None, tokenizer=None, stop_after: int | None = None) -> dict | None:
    """Generate (or resume) and finalize the corpus. Returns the manifest.

    Turn by turn (a follow-up turn needs the target's answer to the previous one), pass by pass: the records
    a finalized corpus in ``out_dir`` already holds are reused, the rest is generated in length-sorted batches,
    each saved as a shard under ``.work`` so an interrupted run resumes. ``model``/``tokenizer`` override
    loading ``settings.target`` (tests use a tiny model); ``stop_after`` ends the run after that many new
    batches without finalizing (simulates an interruption; returns None).
    """
    from tqdm.auto import tqdm

    from .models import fingerprint, load_model

    if model is None:
        model, tok = load_model(settings.target, dtype=settings.dtype)
    else:
        tok = tokenizer
    fp = fingerprint(model)
    recs = load_prompts(settings.prompts, limit=limit)
    max_prompt = min(settings.max_prompt_tokens, int(model.config.max_position_embeddings) - settings.max_new_tokens)
    items, skipped = tokenize_prompts(tok, recs, max_prompt)
    if not items:
        raise ValueError("no prompt fits the context; nothing to generate")
    reuse, old_sha = reusable_records(out_dir, settings, fp, limit)
    work = out_dir / ".work" / (settings.key(fp) + (f"-limit{limit}" if limit else "") + f"-from-{old_sha}")
    work.mkdir(parents=True, exist_ok=True)
    run = _Run(model, tok, settings, work, reuse, stop_after,
               tqdm(desc="corpus", unit="batch", disable=not progress))
    answers: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}  # (pass, turn, item) -> (prompt, resp)
    for turn in range(max(len(r["turns"]) for r, _ in items)):
        for p in range(settings.passes):
            prompts = {}
            for i, (r, ids) in enumerate(items):
                if turn >= len(r["turns"]) or (turn and (p, turn - 1, i) not in answers):
                    continue
                ids = ids if turn == 0 else follow_up_ids(tok, r, turn, [answers[p, k, i][1] for k in range(turn)])
                if len(ids) > max_prompt:
                    skipped += 1
                    continue
                prompts[i] = ids
            if not run.answer(p, turn, items, prompts, answers):
                run.bar.close()
                return None
    run.bar.close()
    if skipped:
        print(f"[corpus] skipped {skipped} prompts longer than {max_prompt} tokens (not truncated)", file=sys.stderr)
    if run.reused:
        print(f"[corpus] reused {run.reused} records of the corpus in {out_dir}", file=sys.stderr)
    return finalize(settings, items, answers, out_dir, fp, skipped, run.seconds, tok)


class _Run:
    """The batches of one generation run: reuse, resume from shards, or generate (and save a shard)."""

    def __init__(self, model, tok, settings, work: Path, reuse: dict, stop_after, bar):
        self.model, self.tok, self.s, self.work, self.reuse, self.bar = model, tok, settings, work, reuse, bar
        self.stop_after, self.new_batches, self.reused, self.seconds, self.made = stop_after, 0, 0, 0.0, 0

    def answer(self, p: int, turn: int, items, prompts: dict[int, list[int]], answers: dict) -> bool:
        """Fill ``answers[p, turn, i]`` for every prompt; False when ``stop_after`` batches were generated."""
        from .decoding import generate, pad_left
        from .sampling import SamplingConfig

        todo = []
        for i, ids in prompts.items():
            old = self.reuse.get((items[i][0]["question_id"], p, turn))
            if old is not None and old[0] == ids:
                answers[p, turn, i] = old
                self.reused += 1
            else:
                todo.append(i)
        batches = [[todo[j] for j in b] for b in plan_batches([len(prompts[i]) for i in todo], self.s.batch,
                                                                  self.s.batch_tokens)]
        self.bar.total = (self.bar.total or 0) + len(batches)
        self.bar.refresh()
        for b, idx in enumerate(batches):
            path = self.work / f"t{turn}_p{p}_b{b:05d}.npz"
            if path.exists() and np.load(path)["item"].tolist() != idx:
                path.unlink()  # a shard of another plan (cannot happen unless .work was edited): regenerate it
            if not path.exists():
                if self.stop_after is not None and self.new_batches >= self.stop_after:
                    return False
                t0 = time.perf_counter()
                ids, mask = pad_left([prompts[i] for i in idx], self.tok.pad_token_id)
                cfg = SamplingConfig(temperature=self.s.temperature if p == 0 else self.s.later_pass_temperature)
                gen = None if cfg.greedy else torch.Generator().manual_seed(
                    self.s.seed * 1_000_003 + p * 10_007 + turn * 7_919 + b)
                res = generate(self.model, ids.to(self.model.device), mask.to(self.model.device), sampling=cfg,
                               max_new_tokens=self.s.max_new_tokens, generator=gen, eos_token_id=self.tok.eos_token_id)
                _save_shard(path, idx, res.tokens)
                self.new_batches += 1
                self.seconds += time.perf_counter() - t0
                self.made += res.stats.new_tokens
                self.bar.set_postfix(tok_s=f"{self.made / max(self.seconds, 1e-9):.0f}")
            z = np.load(path)
            pos = 0
            for i, n in zip(z["item"].tolist(), z["lens"].tolist()):
                answers[p, turn, i] = (prompts[i], z["resp"][pos:pos + n].tolist())
                pos += n
            self.bar.update(1)
        return True


def _save_shard(path: Path, idx: list[int], resp: list) -> None:
    resp = [np.asarray(r, dtype=np.int64) for r in resp]
    _atomic_save_npz(path, item=np.asarray(idx, dtype=np.int64), lens=np.asarray([len(r) for r in resp], dtype=np.int64),
                     resp=np.concatenate(resp) if resp else np.zeros(0, np.int64))


def finalize(settings, items, answers: dict, out_dir: Path, fp: str, skipped: int, gen_seconds: float, tok) -> dict:
    """Pack every answer into the committed corpus files: pass by pass, turn by turn, prompts by length."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]))
    recs = []
    for p, turn in sorted({(p, t) for p, t, _ in answers}):
        for i in order:
            if (p, turn, i) in answers:
                r = items[i][0]
                pids, resp = answers[p, turn, i]
                recs.append((pids, resp, {"question_id": r["question_id"], "category": r.get("category", ""),
                                          "pass": p, "turn": turn}))
    cmd = "python -m specbook.corpus generate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["generate"] else ""
    return write_corpus(out_dir, recs, vocab_size=len(tok), target=settings.target, fingerprint=fp,
                        settings=asdict(settings), extra={"skipped_too_long": skipped,
                                                          "generation_seconds_this_run": round(gen_seconds, 1),
                                                          "command": cmd})


def category_counts(index: np.ndarray, records: list[dict]) -> dict:
    """{category: {records, prompt_tokens, response_tokens}} over (offset, prompt_len, response_len) rows."""
    out: dict = {}
    for (_, pl, rl), m in zip(index, records):
        c = out.setdefault(m.get("category") or "?", {"records": 0, "prompt_tokens": 0, "response_tokens": 0})
        c["records"] += 1
        c["prompt_tokens"] += int(pl)
        c["response_tokens"] += int(rl)
    return dict(sorted(out.items()))


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
        "categories": category_counts(idx, meta),
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
    for f in ("max_new_tokens", "max_prompt_tokens", "batch", "batch_tokens", "passes", "seed"):
        g.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(d, f))
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")
    g.add_argument("--out", default=str(CORPUS_DIR))
    i = sub.add_parser("info")
    i.add_argument("--corpus", default=str(CORPUS_DIR))
    i.add_argument("--records", type=int, default=None,
                   help="the sha of N evenly spaced records instead (the subset `train --records N` trains on)")
    a = ap.parse_args(argv)
    if a.cmd == "info" and a.records is not None and a.records < 1:
        ap.error(f"--records {a.records}: a subset needs at least 1 record")
    if a.cmd == "generate":
        s = CorpusSettings(target=a.target, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                           max_prompt_tokens=a.max_prompt_tokens, batch=a.batch, batch_tokens=a.batch_tokens, dtype=a.dtype,
                           temperature=a.temperature, passes=a.passes, seed=a.seed)
        m = generate_corpus(s, Path(a.out), limit=a.limit)
    else:
        c = load_corpus(Path(a.corpus))
        if a.records:
            with tempfile.TemporaryDirectory() as tmp:  # the sha and counts outlive the subset's files
                c = subset(c, a.records, Path(tmp), spread=True)
        m = {**c.manifest, "sha": c.sha, "categories": category_counts(c.index, c.records)}
    print(json.dumps({k: m[k] for k in ("sha", "records", "prompt_tokens", "response_tokens", "skipped_too_long",
                                        "generation_seconds_this_run", "categories") if k in m}, indent=1))


if __name__ == "__main__":
    main()
