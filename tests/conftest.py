import os

import pytest
import torch

from specbook.models import tiny_llama


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (vocab 48, 2 layers) in float32: exact, instant."""
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_feature_batch(tiny):
    """A training Batch of random tokens on the tiny model with its own final hidden states as features."""
    from specbook.training import Batch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny.config.vocab_size, (4, 16), generator=g)
    with torch.no_grad():
        feats = tiny(tokens, output_hidden_states=True).hidden_states[-1][:, :, None, :]
    return Batch(tokens, feats, torch.ones(4, 16, dtype=torch.bool))


@pytest.fixture(scope="session")
def fit():
    """fit(objective, batch, lr, steps=60) -> (first loss, last loss): a few AdamW steps on one batch."""

    def run(obj, batch, lr, steps=60):
        opt = torch.optim.AdamW(obj.module.parameters(), lr=lr)
        first = float(obj.loss(batch)[0].detach())
        for _ in range(steps):
            loss, _ = obj.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return first, float(loss.detach())

    return run


@pytest.fixture(scope="session")
def real():
    """The bundled SmolLM2-135M-Instruct in float32 (provisioned by scripts/setup.sh)."""
    from specbook.models import load_model

    return load_model("smollm2-135m-instruct", dtype="fp32", device="cpu")


def pytest_configure(config):
    """Threads per test process: SPECBOOK_TEST_THREADS, else the cores shared out among pytest-xdist's workers
    (``-n``). Two processes each running torch on every core slow each other 10-20x on a 2-core machine, so a
    worker keeps to its share, and the notebook kernels it starts inherit the same share through OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, int(os.environ.get("SPECBOOK_TEST_THREADS", torch.get_num_threads() // workers)))
    torch.set_num_threads(threads)
    if workers > 1:
        os.environ["OMP_NUM_THREADS"] = str(threads)
