"""Tiny forward cases for compute-sanitizer memcheck (ragged tails, empty sequences, windows)."""
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func

for d in (32, 96, 128, 256):
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(2, s, 3, d, device="cuda", dtype=dtype) for s in (77, 130, 130))
        flash_attn_func(q, k, v, causal=True)
        flash_attn_func(q, k, v, window_size=(20, 3), softcap=10.0, dropout_p=0.2)
lens = [0, 5, 129, 1]
cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, max(lens), max(lens), causal=True)
torch.cuda.synchronize()
print("sanitize cases ran")
