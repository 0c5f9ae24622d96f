"""``python -m hf_flash env``: versions, GPU and which attention path runs, with the reason."""

from __future__ import annotations

import platform

import torch

from . import ops
from .integration import is_registered


def env_report() -> str:
    lines = [f"hf_flash {__import__('hf_flash').__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    try:
        import transformers

        lines.append(f"transformers {transformers.__version__}; attn_implementation='hf_flash' "
                     f"{'registered' if is_registered() else 'NOT registered'}")
    except ImportError:
        lines.append("transformers not installed")
    lines.append(f"extension: {ops.extension_status()[1]}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"GPU {i}: {name} (sm{major}{minor})")
        probe = torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    else:
        lines.append("GPU: none")
        probe = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        backend, reason = ops.backend_for(probe.to(dtype))
        lines.append(f"{str(dtype).removeprefix('torch.')} on {probe.device.type}: {backend} path ({reason})")
    return "\n".join(lines)
