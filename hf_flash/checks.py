"""Checks of the public functions' index tensors (``cu_seqlens_*``, ``cache_seqlens``, ``cache_leftpad``) and
the notice for inputs the kernels do not take. One rule in one place; ``hf_flash.interface`` calls these.

* dtype, device, shape and contiguity: always (tensor attributes, no device sync, well under 1 us each).
* Values (offsets start at 0, never decrease and end at the row count; ``max_seqlen`` covers the longest
  sequence; ``0 <= cache_leftpad <= cache_seqlens + new keys <= cache length``): on CPU tensors always (no sync
  to pay there), on a GPU only with ``HF_FLASH_CHECK=1`` (one device-to-host copy, i.e. a sync, per index
  tensor), never under ``torch.compile`` or CUDA graph capture. Without it a GPU call with bad values stays in
  bounds (the kernels clamp every range to the tensors they were given) but its result is meaningless.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from torch import Tensor

# Read once at import: the per-call cost of a disabled check is one attribute test.
CHECK_VALUES = os.environ.get("HF_FLASH_CHECK", "0") == "1"


def index_tensor(name: str, t, length: int, device, what: str) -> Tensor:
    """``t`` as a contiguous int32 ``(length,)`` tensor on ``device`` (``what`` names the entries), or raise."""
    if not isinstance(t, Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32 tensor of shape ({length},) ({what}), got {got}")
    if t.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},) ({what}), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a strided view of int32 offsets was passed)")
    return t


def _check_values(t: Tensor) -> bool:
    """Whether to look at the values of ``t``: free on CPU, opt-in on a GPU, impossible when traced."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    return CHECK_VALUES and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def cu_seqlens(name: str, cu, total: int, max_seqlen: int, device, batch: Optional[int] = None) -> int:
    """``cu`` are ``batch + 1`` offsets into ``total`` packed rows, no sequence longer than ``max_seqlen``;
    ``batch`` defaults to the one ``cu`` implies (at least 1). Returns the batch size."""
    if batch is None:
        batch = max(cu.shape[0] - 1, 1) if isinstance(cu, Tensor) and cu.dim() == 1 else 1
    index_tensor(name, cu, batch + 1, device, "batch + 1 offsets")
    if not _check_values(cu):
        return batch
    lengths = cu[1:] - cu[:-1]
    first, last, shortest, longest = torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()]).tolist()
    if first != 0:
        raise ValueError(f"{name}[0]={first}: offsets must start at 0")
    if shortest < 0:
        i = int((lengths < 0).nonzero()[0, 0]) + 1
        raise ValueError(f"{name}[{i}]={int(cu[i])} < {name}[{i - 1}]={int(cu[i - 1])}: offsets must be non-decreasing")
    if last != total:
        raise ValueError(f"{name}[{batch}]={last}: the last offset must equal the number of rows, {total}")
    if longest > max_seqlen:
        i = int(lengths.argmax())
        raise ValueError(f"max_seqlen_{name[-1]}={max_seqlen} < {name}[{i + 1}] - {name}[{i}] = {longest}: "
                         f"max_seqlen_{name[-1]} must be at least the longest sequence")
    return batch


def cache_ranges(seqlens: Tensor, leftpad, s_new: int, s_cache: int) -> None:
    """``0 <= cache_leftpad[b] <= cache_seqlens[b] + s_new <= s_cache`` for every row ``b``."""
    if not _check_values(seqlens):
        return
    end = seqlens + s_new
    bad = (seqlens < 0) | (end > s_cache)
    if leftpad is not None:
        bad |= (leftpad < 0) | (leftpad > end)
    if not bool(bad.any()):
        return
    b = int(bad.nonzero()[0, 0])
    n, lp = int(seqlens[b]), None if leftpad is None else int(leftpad[b])
    if n < 0:
        raise ValueError(f"cache_seqlens[{b}]={n} < 0")
    if n + s_new > s_cache:
        raise ValueError(f"cache_seqlens[{b}]={n} + {s_new} new keys > cache length {s_cache}")
    raise ValueError(f"cache_leftpad[{b}]={lp} must be in [0, cache_seqlens[{b}] + new keys = {n + s_new}]")


def cache_length(value: int, s_new: int, s_cache: int) -> None:
    """An int ``cache_seqlens`` (the same length for every row): checked on the host, free."""
    if value < 0 or value + s_new > s_cache:
        raise ValueError(f"cache_seqlens={value} (+ {s_new} new keys) must be in [0, cache length {s_cache}]")


_WIDE = (torch.float32, torch.float64)
_warned_wide = False


def _is_cuda(t: Tensor) -> bool:
    return t.is_cuda  # a function, so that CPU tests can pretend to be on a GPU


def note_reference_dtype(q: Tensor) -> None:
    """Once per process: float32/float64 on a GPU run the PyTorch reference, far slower than the kernels."""
    global _warned_wide
    if q.dtype not in _WIDE or _warned_wide or not _is_cuda(q) or torch.compiler.is_compiling():
        return
    _warned_wide = True
    name = str(q.dtype).removeprefix("torch.")
    warnings.warn(f"hf_flash: {name} inputs on a GPU run the PyTorch reference path (hf_flash.reference), not the "
                  f"CUDA kernels, which take float16/bfloat16: cast q/k/v (or the model) to torch.bfloat16 or "
                  f"torch.float16, or run under torch.autocast('cuda', dtype=torch.bfloat16). Shown once.",
                  UserWarning, stacklevel=3)
