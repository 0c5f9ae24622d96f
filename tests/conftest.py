import os

import pytest
import torch

# Index-tensor values are checked on the GPU too (hf_flash.checks reads this once, at import).
os.environ.setdefault("HF_FLASH_CHECK", "1")


def kernels_available() -> bool:
    from hf_flash.ops import extension_status

    return torch.cuda.is_available() and extension_status()[0]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only with a CUDA GPU and the compiled extension."""
    if kernels_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the compiled hf_flash._C extension")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run, but reproducible within one run when it fails."""
    import random

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    yield seed


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts hf_flash's forward/backward calls on the CPU path (hf_flash.reference),
    so that a model silently running eager/sdpa math instead cannot pass a test."""
    import hf_flash.reference

    calls = {"fwd": 0, "bwd": 0}
    for kind in calls:
        original = getattr(hf_flash.reference, kind)

        def spy(*args, _kind=kind, _original=original, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(hf_flash.reference, kind, spy)
    return calls
