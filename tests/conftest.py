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
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA extension (hf_flash/_build.py)")
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


class _Counts(dict):
    """kind -> count, read as ints (the values are tensors bumped in place)."""

    def __getitem__(self, kind):
        return int(super().__getitem__(kind))

    def __eq__(self, other):
        return {kind: self[kind] for kind in self} == other


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts hf_flash's forward calls on the CPU path (hf_flash.reference.fwd) and the backward passes through
    their outputs (autograd differentiates the reference; a hook on each output counts), so that a model silently
    running eager/sdpa math instead cannot pass a test. The counters are tensors bumped in place: under
    torch.compile the bump is part of the graph, so compiled steps count too (and cause no recompiles)."""
    import hf_flash.reference

    calls = _Counts(fwd=torch.zeros((), dtype=torch.int64), bwd=torch.zeros((), dtype=torch.int64))
    original = hf_flash.reference.fwd

    def count_bwd(grad):
        dict.__getitem__(calls, "bwd").add_(1)

    def spy(*args, **kwargs):
        dict.__getitem__(calls, "fwd").add_(1)
        out, lse = original(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(count_bwd)
        return out, lse

    monkeypatch.setattr(hf_flash.reference, "fwd", spy)
    return calls
