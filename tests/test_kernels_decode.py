"""The split-KV decode kernel (csrc/decode, seqlen_q <= 16) and the forward kernel's KV-cache path
through flash_attn_with_kvcache (needs a GPU and the built extension).

Rules as in test_kernels_fwd: per row, max|ours - ref| <= 2 * max|naive_in_input_dtype - ref| + 1e-5
with ref = naive attention in float32 over that row's cache rows [leftpad, end); the LSE against the
float32 reference (hf_flash.reference.fwd_kvcache), +inf on rows with no visible key. Caches are
stored (B, H_k, S, D) and passed transposed, as transformers keeps them.
"""

import pytest
import torch

from hf_flash import checks, flash_attn_with_kvcache, reference
from hf_flash.reference import naive_attention
from helpers import assert_close, assert_lse, capture_graph, poison_allocator, randn

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16)


def make_cache(b, s_cache, h_k, d, dtype):
    storage = randn(2, b, h_k, s_cache, d, dtype=dtype)
    return storage[0].transpose(1, 2), storage[1].transpose(1, 2)


def ragged(b, s_cache, gen, empty_row=True):
    """Per-row (ends, starts): full, single-key and random rows, one all-padding row (start == end)."""
    ends = [s_cache, 1] + torch.randint(1, s_cache + 1, (b,), generator=gen).tolist()
    ends = ends[:b]
    starts = [int(torch.randint(0, e, (), generator=gen)) if i > 1 else 0 for i, e in enumerate(ends)]
    if empty_row and b > 2:
        starts[-1] = ends[-1]
    return ends, starts


def check(q, k_cache, v_cache, ends, starts, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
          num_splits=0):
    seqlens = torch.tensor(ends, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(starts, dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                       causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
                                       num_splits=num_splits, return_softmax_lse=True)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    for i, (s, e) in enumerate(zip(starts, ends)):
        args = (q[i:i + 1], k_cache[i:i + 1, s:e], v_cache[i:i + 1, s:e])
        ref = naive_attention(*(t.float() for t in args), **kw)
        pt = naive_attention(*args, **kw)
        assert_close(out[i:i + 1], ref, pt, what=f"row {i} (keys {s}..{e})")
        if s == e:
            assert out[i].eq(0).all() and lse[i].isposinf().all()
    _, lse_ref = reference.fwd_kvcache(q.float(), k_cache.float(), v_cache.float(), seqlens, leftpad,
                                       q.shape[-1] ** -0.5, causal, window[0], window[1], softcap, alibi, 0)
    assert_lse(lse, lse_ref)
    return out, lse


def generator():
    return torch.Generator().manual_seed(torch.initial_seed() % 2**31)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_cache", [1, 77, 1000, 4099])
@pytest.mark.parametrize("h,h_k", [(8, 8), (8, 2), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("sq", [1, 4])
def test_ragged_cache(dtype, d, s_cache, h, h_k, sq):
    b = 3
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, dtype)
    ends, starts = ragged(b, s_cache, generator(), empty_row=s_cache > 1)
    check(randn(b, sq, h, d, dtype=dtype), k_cache, v_cache, ends, starts, causal=sq > 1)


@pytest.mark.parametrize("b,s_cache", [(1, 65536), (8, 32768 + 77)])
def test_long_cache_split_vs_unsplit(b, s_cache):
    dtype, d, h, h_k = torch.bfloat16, 128, 16, 2
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, dtype)
    ends, starts = ragged(b, s_cache, generator())
    q = randn(b, 1, h, d, dtype=dtype)
    auto, lse_auto = check(q, k_cache, v_cache, ends, starts, causal=True)
    one, lse_one = check(q, k_cache, v_cache, ends, starts, causal=True, num_splits=1)
    # Both passed the float32 bound; the split partials change only rounding.
    torch.testing.assert_close(auto.float(), one.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_auto, lse_one, atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [1, 4, 16])
@pytest.mark.parametrize("causal,window,softcap,alibi", [
    (True, (-1, -1), 0.0, False), (False, (100, 0), 0.0, False), (True, (37, 0), 30.0, False),
    (False, (-1, -1), 20.0, False), (True, (-1, -1), 0.0, True), (False, (64, 3), 0.0, True)])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_masks_softcap_alibi(dtype, sq, causal, window, softcap, alibi, num_splits):
    b, s_cache, h, h_k, d = 3, 700, 8, 2, 128
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, dtype)
    ends, starts = ragged(b, s_cache, generator())
    q = randn(b, sq, h, d, dtype=dtype, scale=3.0 if softcap else 1.0)
    slopes = torch.rand(h, device="cuda") * 0.2 if alibi else None
    check(q, k_cache, v_cache, ends, starts, causal=causal, window=window, softcap=softcap, alibi=slopes,
          num_splits=num_splits)


# 40 / 80 / 136 run in place on the d64 / d96 / d192 kernels (columns past d zero-filled, never stored);
# 20 is padded to 24 (16-byte rows) and runs on the d32 kernel. num_splits 3: the fp32 partials (rows of d).
@pytest.mark.parametrize("d", [20, 32, 40, 80, 96, 136, 256])
@pytest.mark.parametrize("sq,num_splits", [(1, 0), (1, 3), (16, 0)])
def test_head_dims(d, sq, num_splits):
    b, s_cache, h, h_k = 3, 1500, 8, 1
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, torch.bfloat16)
    ends, starts = ragged(b, s_cache, generator())
    check(randn(b, sq, h, d, dtype=torch.bfloat16), k_cache, v_cache, ends, starts, causal=True,
          num_splits=num_splits)


# past the decode kernel (more query rows, or a head dim above kDecodeMaxHeadDim): the forward kernel
@pytest.mark.parametrize("sq,d", [(17, 64), (64, 64), (17, 80), (1, 512), (5, 400)])
def test_forward_kernel_leftpad(sq, d):
    b, s_cache, h, h_k = 3, 900, 8, 2
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, torch.float16)
    ends, starts = ragged(b, s_cache, generator())
    check(randn(b, sq, h, d, dtype=torch.float16), k_cache, v_cache, ends, starts, causal=True)


def test_append_with_leftpad():
    b, s_cache, h, h_k, d = 4, 300, 8, 2, 128
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, torch.bfloat16)
    seqlens = torch.tensor([0, 10, 200, 296], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 4, 150, 0], dtype=torch.int32, device="cuda")
    q, k_new, v_new = randn(b, 4, h, d, dtype=torch.bfloat16), randn(b, 4, h_k, d, dtype=torch.bfloat16), \
        randn(b, 4, h_k, d, dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                  causal=True)
    for i, (s, n) in enumerate(zip(leftpad.tolist(), seqlens.tolist())):
        assert torch.equal(k_cache[i, n:n + 4], k_new[i]) and torch.equal(v_cache[i, n:n + 4], v_new[i])
        args = (q[i:i + 1], k_cache[i:i + 1, s:n + 4], v_cache[i:i + 1, s:n + 4])
        assert_close(out[i:i + 1], naive_attention(*(t.float() for t in args), causal=True),
                     naive_attention(*args, causal=True), what=f"row {i}")


# ---- torch integration: CUDA graphs, torch.compile, opcheck ----------------------------------


def _decode_inputs(b=2, s_cache=4096, h=8, h_k=2, d=128):
    k_cache, v_cache = make_cache(b, s_cache, h_k, d, torch.bfloat16)
    q, k_new, v_new = randn(b, 1, h, d, dtype=torch.bfloat16), randn(b, 1, h_k, d, dtype=torch.bfloat16), \
        randn(b, 1, h_k, d, dtype=torch.bfloat16)
    seqlens = torch.tensor([1000, 3000], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 17], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, k_new, v_new, seqlens, leftpad


def test_cuda_graph_capture_and_replay():
    q, k_cache, v_cache, k_new, v_new, seqlens, leftpad = _decode_inputs()

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       cache_leftpad=leftpad, causal=True)

    graph, out = capture_graph(step)
    for pos in ([1500, 4000], [7, 2500]):  # new lengths and inputs, same graph
        seqlens.copy_(torch.tensor(pos, dtype=torch.int32))
        for t in (q, k_new, v_new):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        for i, n in enumerate(pos):
            assert torch.equal(k_cache[i, n], k_new[i, 0])
        eager = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens + 1, cache_leftpad=leftpad,
                                        causal=True)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_no_host_sync(monkeypatch):
    """The default path (values unchecked: HF_FLASH_CHECK unset) never syncs."""
    monkeypatch.setattr(checks, "CHECK_VALUES", False)
    q, k_cache, v_cache, k_new, v_new, seqlens, leftpad = _decode_inputs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                causal=True, return_softmax_lse=True)
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1000, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compile_fullgraph():
    q, k_cache, v_cache, k_new, v_new, seqlens, leftpad = _decode_inputs()

    def step(q, k_cache, v_cache, seqlens, leftpad):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                       causal=True, return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(q, k_cache, v_cache, seqlens, leftpad), step(q, k_cache, v_cache, seqlens, leftpad)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("rel_bias", [False, True])
def test_opcheck_fwd_kvcache(rel_bias):
    q, k_cache, v_cache, _, _, seqlens, leftpad = _decode_inputs(s_cache=512)
    seqlens = torch.tensor([300, 512], dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, seqlens, leftpad, 0.088, True, -1, -1, 0.0, None, 0)
    if rel_bias:
        args = (*args, None, torch.randn(q.shape[-2], 2 * 33 + 1, device="cuda"))
    torch.library.opcheck(torch.ops.hf_flash.fwd_kvcache.default, args)


@pytest.mark.parametrize("d", [80, 128])
def test_decode_reads_the_kv_cache_in_place(d):
    """A decode step allocates nothing of the cache's size: any multiple-of-8 head dim (here d80, run by the
    d96 kernel) is read in place, never padded or copied."""
    b, s_cache, hk = 2, 8192, 4
    k_cache, v_cache = (torch.randn(b, hk, s_cache, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                        for _ in range(2))
    q = torch.randn(b, 1, 8, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([s_cache, 100], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.ops.hf_flash.fwd_kvcache(q, k_cache, v_cache, seqlens, None, d**-0.5, True, -1, -1, 0.0, None, 0)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < k_cache.numel() * k_cache.element_size() // 4
