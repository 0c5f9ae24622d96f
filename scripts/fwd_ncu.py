"""Our Hopper forward and SDPA cuDNN's on the paper grid's 2k shape (B 8, H 16, d128, non-causal, bf16), for ncu
on the device (benchmarks/NOTES-sm90.md, forward, "Where the rest is"):

    ncu --clock-control none --set full --import-source no -k regex:"fwd_sm90|fprop" -s 2 -c 2 -o fwd \\
        python3 scripts/fwd_ncu.py
    ncu -i fwd.ncu-rep --page source --csv --print-source sass -k regex:fwd_sm90 > sass.csv
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_flash  # noqa: F401

b, s, h, d = 8, 2048, 16, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
opts = (d**-0.5, False, -1, -1, 0.0, None, 0.0, None)
for _ in range(3):  # ncu -s 2 skips the first call of each
    torch.ops.hf_flash.fwd(q, k, v, None, None, None, s, s, *opts, False)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
torch.cuda.synchronize()
