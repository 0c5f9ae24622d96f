"""The Hopper forward and backward kernels under compute-sanitizer (GPU machine, reduced grid):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_sm90.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_sm90.py

Dense and varlen, lengths off the tiles, seqlen_q != seqlen_k (fully masked causal rows), GQA, d64 / d128,
bf16 / fp16: every call runs the wgmma kernels (flash_attn_func with default options on CC 9.0).
"""
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func

torch.manual_seed(0)
for d, dtype, causal, (sq, sk), (h, hk) in [(64, torch.bfloat16, False, (77, 150), (4, 2)),
                                            (128, torch.float16, True, (150, 77), (4, 1)),
                                            (128, torch.bfloat16, True, (200, 200), (2, 2))]:
    q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    flash_attn_func(q, k, v, causal=causal).backward(torch.randn(2, sq, h, d, device="cuda", dtype=dtype))
lens = torch.tensor([0, 5, 0, 130, 64], device="cuda")
cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int()
total = int(cu[-1])
for d in (64, 128):
    q, k, v = (torch.randn(total, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()), causal=True)
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize_sm90: done")
