"""Which path runs an attention call, and the fake implementations of the hf_flash ops.

The ops ``hf_flash::fwd`` / ``bwd`` / ``fwd_kvcache`` are defined once, in C++ (``csrc/binding.cpp``: schemas,
argument checks, CUDA implementations, fwd's autograd), and registered when the extension hf_flash._C is
imported; eager calls pay only the C++ dispatcher. Their fake implementations below let ``torch.compile`` and
``opcheck`` trace them without a GPU kernel, so compiled code sees each op as one opaque node (no graph breaks,
safe under CUDA graphs). ``run_fwd`` / ``run_fwd_kvcache`` call the op when the kernels can run (extension
built, fp16/bf16 on an sm80+ GPU) and the PyTorch reference (``hf_flash.reference``) otherwise, as plain
differentiable torch code that needs no op registration; ``backend_for`` says which and why.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from . import _build, reference

logger = logging.getLogger("hf_flash")

# Query rows the split-KV decode kernel takes (kDecodeMaxSeqlenQ, csrc/flash.h): decode and speculative steps;
# longer queries against a KV cache (and prefill in transformers) run the forward kernel.
DECODE_MAX_SEQLEN_Q = 16
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def extension_status() -> tuple[bool, str]:
    """(loaded, detail) for the CUDA extension, built on first use (hf_flash._build): the first CUDA tensor."""
    loaded, detail = _build.load_extension()  # registers the hf_flash::fwd / bwd / fwd_kvcache ops
    if loaded:
        _register_fakes()
    return loaded, detail


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def backend_for(q: Tensor) -> tuple[str, str]:
    """("cuda" | "reference", reason) for a query tensor. The kernels take every head dim the API accepts
    (1..512: the C++ ops zero-pad it to a compiled one)."""
    return _backend(q.device, q.dtype)


@functools.lru_cache(maxsize=None)
def _backend(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    if device.type != "cuda":
        return "reference", f"tensors on {device.type}"
    loaded, detail = extension_status()
    if not loaded:
        return "reference", detail
    if dtype not in KERNEL_DTYPES:
        return "reference", f"{dtype} (kernels take float16/bfloat16)"
    major, minor = _capability(device)
    if major < 8:
        return "reference", f"compute capability {major}.{minor} (kernels need 8.0+)"
    return "cuda", f"CUDA kernels ({dtype}, sm{major}{minor})"


@functools.lru_cache(maxsize=None)
def _log_backend_once(backend: str, reason: str) -> None:
    logger.info("hf_flash: using the %s path: %s", backend, reason)


@torch.compiler.assume_constant_result  # torch.compile calls it once while tracing and keeps the answer
def _uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    backend, reason = _backend(device, dtype)
    _log_backend_once(backend, reason)
    return backend == "cuda"


def uses_kernels(q: Tensor) -> bool:
    return _uses_kernels(q.device, q.dtype)


def _lse_shape(q: Tensor, varlen: bool):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def run_fwd(*args, sinks: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """hf_flash::fwd's arguments and result (out, lse), on the kernels or the reference; differentiable.
    ``sinks`` (H,): learned attention sinks, in every row's softmax denominator (the LSE includes them) and
    with a gradient (``reference.sink_rescale`` states the rule; the kernels add the sink in their epilogues and
    the backward op returns d sinks). ``rel_bias`` (H, 2R+1): a relative position bias table (T5), added to the
    scaled logits at column ``reference.relative_positions`` (the kernels read it per element; the backward op
    returns its gradient)."""
    if not uses_kernels(args[0]):
        return reference.fwd(*args, sinks=sinks, rel_bias=rel_bias)
    return torch.ops.hf_flash.fwd.default(*args, sinks, rel_bias)


def run_fwd_kvcache(*args, sinks: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """hf_flash::fwd_kvcache's arguments and result (out, lse), on the kernels or the reference (inference)."""
    if not uses_kernels(args[0]):
        return reference.fwd_kvcache(*args, sinks=sinks, rel_bias=rel_bias)
    return torch.ops.hf_flash.fwd_kvcache.default(*args, sinks, rel_bias)


def _register_fakes() -> None:
    """Output shapes and strides of the C++ ops (outputs like their inputs, LSE float32), for compile and opcheck."""
    @torch.library.register_fake("hf_flash::fwd")
    def _(q, k, v, cu_seqlens_q, *rest):
        return torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)

    @torch.library.register_fake("hf_flash::bwd")
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
          window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic, sinks=None,
          rel_bias=None):
        dsinks = q.new_empty((q.shape[-2] if sinks is not None else 0,), dtype=torch.float32)
        drel_bias = q.new_empty(rel_bias.shape if rel_bias is not None else (0, 0), dtype=torch.float32)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks, drel_bias

    @torch.library.register_fake("hf_flash::fwd_kvcache")
    def _(q, *rest):
        return torch.empty_like(q), q.new_empty(_lse_shape(q, False), dtype=torch.float32)

