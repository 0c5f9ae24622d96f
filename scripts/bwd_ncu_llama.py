"""One Llama-layer backward (16 query / 8 KV heads, d128, causal, bf16), hf_flash then SDPA cuDNN with
enable_gqa, for ncu on the device (benchmarks/NOTES-sm90.md, "dQ by TMA reduction"):

    ncu --clock-control none --set full --import-source no -k regex:"main_kernel|bprop" -c 2 -o bwd \\
        python3 scripts/bwd_ncu_llama.py 1x16384
    ncu -i bwd.ncu-rep --page source --csv --print-source sass -k regex:main_kernel > sass.csv
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_flash  # noqa: F401

b, s = (int(x) for x in sys.argv[1].split("x"))
h, hk, d = 16, 8, 128
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
opts = (d**-0.5, True, -1, 0, 0.0, None, 0.0, None)
out, lse = torch.ops.hf_flash.fwd(q, k, v, None, None, None, s, s, *opts, False)
torch.ops.hf_flash.bwd(dout, q, k, v, out, lse, None, None, s, s, *opts, False)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
    o.backward(dout.transpose(1, 2))
torch.cuda.synchronize()
