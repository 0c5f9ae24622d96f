"""One backward call of hf_flash's kernels (for ncu / compute-sanitizer on the device).

    python scripts/bwd_profile.py D S CAUSAL(0/1) [DETERMINISTIC(0/1)]
bf16, B*S = 16k tokens, H*D = 2048, layout (B, S, H, D).
"""
import sys

import torch

import hf_flash  # noqa: F401

d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
det = len(sys.argv) > 4 and sys.argv[4] == "1"
b, h = 16384 // s, 2048 // d
q, k, v, o, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
lse = torch.randn(b, h, s, device="cuda").abs() + 5.0
torch.ops.hf_flash._cuda_bwd(dout, q, k, v, o, lse, None, None, s, s, d**-0.5, causal, -1, 0 if causal else -1, 0.0,
                             None, 0.0, None, det)
torch.cuda.synchronize()
