import os

import pytest
import torch

from specbook.models import tiny_llama


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (vocab 48, 2 layers) in float32: exact, instant."""
    return tiny_llama()


@pytest.fixture(scope="session")
def real():
    """The bundled SmolLM2-135M-Instruct in float32 (provisioned by scripts/setup.sh)."""
    from specbook.models import load_model

    return load_model("smollm2-135m-instruct", dtype="fp32", device="cpu")


def pytest_configure(config):
    torch.set_num_threads(max(1, int(os.environ.get("SPECBOOK_TEST_THREADS", torch.get_num_threads()))))
