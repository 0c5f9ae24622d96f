"""The hf_flash::fwd / hf_flash::bwd / hf_flash::fwd_kvcache custom ops: dispatch, fake shapes, autograd.

fwd and bwd take one argument list for dense ``(B, S, H, D)`` and varlen
``(T, H, D)`` inputs; fwd_kvcache is the inference forward against a KV cache.
They run the CUDA kernels (``hf_flash::_cuda_fwd`` / ``_cuda_bwd`` /
``_cuda_fwd_kvcache``, registered by ``csrc/binding.cpp``) when the extension is built,
the tensors are fp16/bf16 on an sm80+ GPU and the head dim is a compiled one;
otherwise the PyTorch reference (``hf_flash.reference``). ``backend_for`` says
which and why. As torch.library custom ops with fake implementations they are
opaque to ``torch.compile`` (no graph breaks) and safe under CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from . import _build, reference

logger = logging.getLogger("hf_flash")

KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# Query rows the split-KV decode kernel takes (kDecodeMaxSeqlenQ, csrc/flash.h): decode and speculative steps;
# longer queries against a KV cache (and prefill in transformers) run the forward kernel.
DECODE_MAX_SEQLEN_Q = 16
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def extension_status() -> tuple[bool, str]:
    """(loaded, detail) for the CUDA extension, built on first use (hf_flash._build): the first CUDA tensor."""
    loaded, detail = _build.load_extension()  # registers the hf_flash::_cuda_* ops
    if loaded:
        _register_cuda_fakes()
    return loaded, detail


def kernel_head_dim(d: int) -> Optional[int]:
    """Smallest compiled head dim >= d (the kernel that runs d)."""
    return next((k for k in KERNEL_HEAD_DIMS if k >= d), None)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def backend_for(q: Tensor) -> tuple[str, str]:
    """("cuda" | "reference", reason) for a query tensor."""
    if not q.is_cuda:
        return "reference", f"tensors on {q.device.type}"
    loaded, detail = extension_status()
    if not loaded:
        return "reference", detail
    if q.dtype not in KERNEL_DTYPES:
        return "reference", f"{q.dtype} (kernels take float16/bfloat16)"
    major, minor = _capability(q.device)
    if major < 8:
        return "reference", f"compute capability {major}.{minor} (kernels need 8.0+)"
    if kernel_head_dim(q.shape[-1]) is None:
        return "reference", f"head dim {q.shape[-1]} > {KERNEL_HEAD_DIMS[-1]}"
    return "cuda", f"CUDA kernels ({q.dtype}, sm{major}{minor})"


@functools.lru_cache(maxsize=None)
def _log_backend_once(backend: str, reason: str) -> None:
    logger.info("hf_flash: using the %s path: %s", backend, reason)


def uses_kernels(q: Tensor) -> bool:
    backend, reason = backend_for(q)
    _log_backend_once(backend, reason)
    return backend == "cuda"


def _for_kernel(x, exact_head_dim: bool):
    """Q/K/V-like tensors as the kernels take them: 16-byte aligned rows whose head dim is a compiled one
    (``exact_head_dim``: the forward and backward kernels) or a multiple of 8 (the decode kernel zero-fills the
    columns up to the next compiled head dim itself, so a KV cache of head dim 80 is read in place); zero
    padding changes neither q.k nor the output's first d columns. int32 lengths contiguous."""
    if isinstance(x, Tensor) and x.dtype == torch.int32:
        return x.contiguous()
    if not isinstance(x, Tensor) or x.dim() < 3 or x.dtype not in KERNEL_DTYPES:
        return x
    d = x.shape[-1]
    kd = kernel_head_dim(d) if exact_head_dim else -(-d // 8) * 8
    if kd != d:
        return torch.nn.functional.pad(x, (0, kd - d))
    # 16-byte cp.async loads need aligned base pointers and row/head/batch strides.
    aligned = x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in x.stride()[:-1])
    return x if x.stride(-1) == 1 and aligned else x.contiguous()


def _lse_shape(q: Tensor, varlen: bool):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("hf_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
        rng_state: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """Attention forward: (out like q, lse float32). ``deterministic`` is for the backward."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    if not uses_kernels(q):
        return reference.fwd(*args)
    d = q.shape[-1]
    out, lse = torch.ops.hf_flash._cuda_fwd(*(_for_kernel(x, exact_head_dim=True) for x in args))
    return out[..., :d], lse


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, *rest):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op("hf_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
        rng_state: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward from the saved output and LSE: (dq, dk, dv)."""
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    if not uses_kernels(q):
        return reference.bwd(*args)
    d = q.shape[-1]
    dq, dk, dv = torch.ops.hf_flash._cuda_bwd(*(_for_kernel(x, exact_head_dim=True) for x in args), deterministic)
    return dq[..., :d], dk[..., :d], dv[..., :d]


@bwd.register_fake
def _(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, cache_leftpad: Optional[Tensor],
                 softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                 alibi_slopes: Optional[Tensor], num_splits: int) -> tuple[Tensor, Tensor]:
    """Inference forward against a KV cache (B, S_cache, H_k, D), strided views welcome: row b attends to
    cache rows [cache_leftpad[b], cache_seqlens[b]). Returns (out like q, lse float32 (B, H, Sq)). On the
    GPU, up to 16 query rows run the split-KV decode kernel (``num_splits``: 0 = heuristic), more the
    forward kernel."""
    args = (q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_left, window_right,
            softcap, alibi_slopes, num_splits)
    if not uses_kernels(q):
        return reference.fwd_kvcache(*args)
    d, exact = q.shape[-1], q.shape[1] > DECODE_MAX_SEQLEN_Q  # the forward kernel takes compiled head dims only
    out, lse = torch.ops.hf_flash._cuda_fwd_kvcache(*(_for_kernel(x, exact) for x in args))
    return out[..., :d], lse


def _fwd_kvcache_fake(q, *rest):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, False), dtype=torch.float32)


fwd_kvcache = torch.library.custom_op("hf_flash::fwd_kvcache", mutates_args=())(_fwd_kvcache)
fwd_kvcache.register_fake(_fwd_kvcache_fake)


def run_fwd_kvcache(*args) -> tuple[Tensor, Tensor]:
    """fwd_kvcache's arguments and result. The op is what torch.compile traces; eager calls run its body
    directly: the custom-op dispatch costs ~60 us of host time a call on the H100 host (three times the
    kernel launch), and eager decode steps are host-bound. The body is the same, graph capture included."""
    return (fwd_kvcache if torch.compiler.is_compiling() else _fwd_kvcache)(*args)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, causal, wl, wr, softcap, alibi, p, rng, det) = inputs
    if seqused_k is not None:
        ctx.mark_non_differentiable(*output)  # KV-cache decode is inference only
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, rng)
    ctx.attrs = (max_q, max_k, scale, causal, wl, wr, softcap, p, det)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi, rng = ctx.saved_tensors
    max_q, max_k, scale, causal, wl, wr, softcap, p, det = ctx.attrs
    # No dout.contiguous(): bwd passes it through _for_kernel, which copies only what the kernel cannot read.
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr,
                     softcap, alibi, p, rng, det)
    return dq, dk, dv, *([None] * 14)


fwd.register_autograd(_backward, setup_context=_setup_context)


def _register_cuda_fakes() -> None:
    """Fake implementations of the compiled ops, so opcheck and compile can trace them."""
    @torch.library.register_fake("hf_flash::_cuda_fwd")
    def _(q, k, v, cu_seqlens_q, *rest):
        return torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)

    torch.library.register_fake("hf_flash::_cuda_fwd_kvcache")(_fwd_kvcache_fake)

    @torch.library.register_fake("hf_flash::_cuda_bwd")
    def _(dout, q, k, v, *rest):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
