"""hf_flash: FlashAttention-2 CUDA kernels as a transformers attention backend.

    import hf_flash
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_flash")
"""

from .env import env_report
from .integration import register as _register_with_transformers
from .interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .patches import UnsupportedModelError, patch

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "env_report", "patch",
           "UnsupportedModelError", "__version__"]

_register_with_transformers()
