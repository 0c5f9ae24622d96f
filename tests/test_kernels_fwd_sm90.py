"""The Hopper (wgmma) forward kernel: that it runs where it should, the edges of its tiles (128 query rows x 128
keys, 80 at d256, 64 rows x 64 keys at d512) and of sliding windows.
test_kernels_fwd.py runs the whole forward grid with it active on CC 9.0; these cases add tile edges and
compare it with the mma.sync kernel (HF_FLASH_DISABLE_SM90=1) on the same inputs."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_flash import flash_attn_func, flash_attn_varlen_func
from helpers import check_dense, cu_seqlens, randn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the Hopper kernel runs on compute capability 9.0"),
]


def assert_near_sm80(out, out80, atol):
    """Both kernels met the float32 reference (check_dense); their outputs may still round one 16-bit step apart,
    2^-7 of a value at most (0.031 at 4.6, seen at d512 with a two-key window)."""
    torch.testing.assert_close(out.float(), out80.float(), atol=atol, rtol=2**-7)


def forward_kernels(fn):
    """Names of the CUDA kernels fn launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run_sm80(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("HF_FLASH_DISABLE_SM90", "1")
        return fn()


@pytest.mark.parametrize("d,window,softcap,expect_sm90", [
    (128, (-1, -1), 0.0, True), (64, (-1, 0), 0.0, True),  # plain and causal
    (128, (64, 0), 0.0, True), (64, (32, 32), 0.0, True),  # sliding and local windows
    (256, (-1, 0), 0.0, True),  # d256: 80-key blocks
    (512, (-1, 0), 0.0, True),  # d512: both consumers on 64 rows, each half of d
    (96, (-1, -1), 0.0, False),  # other head dims
    (128, (-1, -1), 30.0, True), (256, (4096, 0), 50.0, True),  # softcap (Gemma 2: with a sliding window)
])
def test_dispatch(monkeypatch, d, window, softcap, expect_sm90):
    monkeypatch.delenv("HF_FLASH_DISABLE_SM90", raising=False)  # the mma.sync-only A/B runs set it
    q, k, v = (randn(1, 300, 2, d, dtype=torch.bfloat16) for _ in range(3))
    call = lambda: flash_attn_func(q, k, v, window_size=window, softcap=softcap)  # noqa: E731
    names = forward_kernels(call)
    assert any("fwd_sm90_kernel" in n for n in names) == expect_sm90, names
    assert not any("fwd_sm90_kernel" in n for n in run_sm80(monkeypatch, lambda: forward_kernels(call)))


# Lengths around the 128-row / 128-key (d256: 80-key; d512: 64 x 64) tiles: one row, fewer keys than a tile, one
# past a tile, many tiles.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("sq,sk", [(1, 1), (5, 127), (127, 5), (129, 129), (200, 64), (257, 1), (161, 81), (80, 241),
                                   (2049, 2047)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_edges(monkeypatch, dtype, d, sq, sk, causal):
    q, k, v = randn(2, sq, 4, d, dtype=dtype), randn(2, sk, 2, d, dtype=dtype), randn(2, sk, 2, d, dtype=dtype)
    out, lse = check_dense(q, k, v, causal=causal)
    out80, lse80 = run_sm80(monkeypatch, lambda: flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2])
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    assert_near_sm80(out, out80, atol=2e-2)


# Windows whose edges fall inside, on and across the 128-key blocks, a window past every key, a window of one key;
# sq != sk moves the diagonal (bottom-right aligned), so some rows see no key.
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("window", [(1, 0), (127, 0), (128, 0), (200, 64), (0, 0), (-1, 50), (3000, 0)])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (300, 700), (700, 300)])
def test_windows(monkeypatch, d, window, sq, sk):
    q = randn(1, sq, 4, d, dtype=torch.bfloat16)
    k, v = randn(1, sk, 2, d, dtype=torch.bfloat16), randn(1, sk, 2, d, dtype=torch.bfloat16)
    out, lse = check_dense(q, k, v, window=window)
    out80, lse80 = run_sm80(monkeypatch, lambda: flash_attn_func(q, k, v, window_size=window,
                                                                 return_attn_probs=True)[:2])
    assert torch.equal(lse.isposinf(), lse80.isposinf())
    assert_near_sm80(out, out80, atol=2e-2)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_large_logits_and_mqa(d):
    # Scores of magnitude ~100: the running max moves a lot between key blocks (O rescaling); one KV head.
    q = randn(1, 700, 8, d, dtype=torch.bfloat16, scale=8)
    k, v = randn(1, 901, 1, d, dtype=torch.bfloat16), randn(1, 901, 1, d, dtype=torch.bfloat16)
    check_dense(q, k, v, causal=True)
    check_dense(q, k, v, causal=False)


def test_strided_qkv():
    # q, k, v as views of one packed (b, s, 3, h, d) tensor, as in fused-QKV models.
    qkv = randn(2, 333, 3, 4, 128, dtype=torch.bfloat16)
    check_dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_sm80(monkeypatch, d, causal):
    lens_q, lens_k = [0, 128, 129, 1, 700, 0, 64], [3, 128, 0, 255, 700, 0, 1]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), 4, d, dtype=torch.float16)
    k, v = randn(sum(lens_k), 2, d, dtype=torch.float16), randn(sum(lens_k), 2, d, dtype=torch.float16)
    call = lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,  # noqa: E731
                                          return_attn_probs=True)[:2]
    out, lse = call()
    out80, lse80 = run_sm80(monkeypatch, call)
    assert torch.equal(lse.isposinf(), lse80.isposinf())
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    assert_near_sm80(out, out80, atol=1e-2)



# Scores that rise or fall along the keys, per head, in a sawtooth: at d256 / d512 a row keeps a stale max while a key
# block's exceeds it by at most 2^8 (FlashAttention-4's lazy rescale) and rescales O past that, so both happen many
# times in one walk (0.05 / 0.15 a key: 64 keys move the max by ~4.6 / ~14 in log2 units); d128 rescales exactly.
@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_moving_maxima(d, causal):
    b, s, h = 2, 700, 4
    u = torch.nn.functional.normalize(torch.randn(d, device="cuda"), dim=0)
    slope = torch.tensor([0.05, -0.05, 0.15, -0.15], device="cuda").view(1, 1, h, 1)
    ramp = (torch.arange(s, device="cuda") % 300).float().view(1, s, 1, 1)
    q = (u * d**0.5 + 0.3 * torch.randn(b, s, h, d, device="cuda")).bfloat16()  # q . u ~ sqrt(d): score ~ a_j
    k = (u * slope * ramp + 0.3 * torch.randn(b, s, h, d, device="cuda")).bfloat16()
    v = randn(b, s, h, d, dtype=torch.bfloat16)
    check_dense(q, k, v, causal=causal)


# d256 and d512 run one CTA a tile (no room for the persistent kernels' second Q buffer); sinks and T5's relative
# bias ride their 80- and 64-key blocks too.
@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", ["sinks", "rel_bias"])
def test_large_d_features(monkeypatch, d, causal, feature):
    q, k, v = randn(2, 333, 4, d, dtype=torch.bfloat16), *(randn(2, 419, 2, d, dtype=torch.bfloat16) for _ in "kv")
    extra = {"sinks": {"learnable_sink": torch.randn(4, device="cuda")},
             "rel_bias": {"rel_bias": torch.randn(4, 2 * 128 + 1, device="cuda")}}[feature]
    call = lambda: flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **extra)[:2]  # noqa: E731
    assert any("fwd_sm90_kernel" in n for n in forward_kernels(call))
    out, lse = call()
    out80, lse80 = run_sm80(monkeypatch, call)
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    assert_near_sm80(out, out80, atol=2e-2)


# Softcap (Gemma 2: 50, with sliding windows) is a compile-time variant of every Hopper forward: persistent (up to
# 2k keys, full or causal) and one CTA a tile. Scores of a few units against a cap of 5: tanh is far from linear.
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0)])
@pytest.mark.parametrize("sq,sk", [(300, 1000), (2500, 2500)])
def test_softcap(monkeypatch, d, window, sq, sk):
    q = randn(2, sq, 4, d, dtype=torch.bfloat16, scale=3)
    k, v = randn(2, sk, 2, d, dtype=torch.bfloat16), randn(2, sk, 2, d, dtype=torch.bfloat16)
    call = lambda: flash_attn_func(q, k, v, window_size=window, softcap=5.0, return_attn_probs=True)[:2]  # noqa: E731
    assert any("fwd_sm90_kernel" in n for n in forward_kernels(call))
    out, lse = check_dense(q, k, v, window=window, softcap=5.0)
    out80, lse80 = run_sm80(monkeypatch, call)
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    assert_near_sm80(out, out80, atol=2e-2)

# Full and causal attention over dense tensors with up to 2048 keys run persistent CTAs (fwd_sm90/launch.cuh): one
# CTA per SM walks couples of query blocks (the heaviest causal block with the lightest), or, where the couples'
# last round would leave SMs idle, every pair's blocks heaviest first dealt in a snake (sm90/schedule.cuh); the
# batch picks the deal. These shapes give every CTA several tiles, the last block of each sequence partial, and
# keys that are not a multiple of the 128-key block; the causal case has an odd block count (7: the middle couple is
# one block) and keys past its rows (bottom-right diagonal). d64 full attention is persistent up to 1k keys only.
# Compared with the mma.sync kernel. Learned sinks and T5's relative bias ride along (per tile: its head's sink and
# table rows).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", ["", "sinks", "rel_bias"])
@pytest.mark.parametrize("deal,batch", [("couples", 16), ("snake", 3)])
def test_persistent_tiles(monkeypatch, dtype, d, causal, feature, deal, batch):
    rows, keys = 850 if causal else 1000, 1000 if d == 64 else 1900  # 7 or 8 tiles of 128 rows, the last partial
    q = randn(batch, rows, 16, d, dtype=dtype)  # batch x 16 pairs x 4 couples
    k, v = randn(batch, keys, 4, d, dtype=dtype), randn(batch, keys, 4, d, dtype=dtype)
    extra = {"sinks": {"learnable_sink": torch.randn(16, device="cuda")},
             "rel_bias": {"rel_bias": torch.randn(16, 2 * 128 + 1, device="cuda")}}.get(feature, {})
    call = lambda: flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **extra)[:2]  # noqa: E731
    sms, couples = torch.cuda.get_device_properties(0).multi_processor_count, batch * 16 * 4
    snake = 10 * couples < 9 * -(-couples // sms) * sms  # sm90::snake_deal
    if snake != (deal == "snake") or couples < sms:
        pytest.skip(f"{batch} x 16 x 4 couples do not give this GPU's {sms} SMs the {deal} deal with several tiles")
    assert any("fwd_sm90_kernel" in n and "2, true," in n for n in forward_kernels(call))
    out, lse = call()
    out80, lse80 = run_sm80(monkeypatch, call)
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    assert_near_sm80(out, out80, atol=2e-2)
