import pytest
import torch


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
