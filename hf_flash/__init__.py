"""hf_flash: FlashAttention-2 CUDA kernels as a transformers attention backend.

    import hf_flash
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_flash")
"""


def _checkout_patches() -> None:
    """A checkout run from its root without installing (PYTHONPATH=.): patches/ sits beside the package, which
    pyproject.toml installs as hf_flash.patches (_build.csrc_dir finds csrc/ the same way); import it under that
    name."""
    import importlib.util
    import sys
    from pathlib import Path

    name = f"{__name__}.patches"
    src = Path(__file__).resolve().parent.parent / "patches"
    if importlib.util.find_spec(name) is not None or not (src / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(name, src / "__init__.py", submodule_search_locations=[str(src)])
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    globals()["patches"] = module  # as the import system binds a submodule it loads


_checkout_patches()

from .env import env_report  # noqa: E402
from .integration import register as _register_with_transformers  # noqa: E402
from .interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from .patches import UnsupportedModelError, patch  # noqa: E402

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "env_report", "patch",
           "UnsupportedModelError", "__version__"]

_register_with_transformers()
