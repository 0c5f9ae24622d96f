"""Public-API backward vs the bare op: where the extra time goes (device only).

    python scripts/bwd_api_profile.py  ->  timings (ms) and the profiler's CUDA kernel table
"""
import torch
import triton
from torch.profiler import ProfilerActivity, profile

import hf_flash

for d, s, causal in ((128, 2048, True), (64, 2048, True), (128, 4096, False)):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = hf_flash.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    dout_t = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # strided (B,S,H,D)
    lse = torch.ops.hf_flash.fwd(q, k, v, None, None, None, s, s, d**-0.5, causal, -1, 0 if causal else -1, 0.0,
                                 None, 0.0, None, False)[1]
    args = (q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, s, s, d**-0.5, causal, -1,
            0 if causal else -1, 0.0, None, 0.0, None)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
    t_raw = bench(lambda: torch.ops.hf_flash._cuda_bwd(dout, *args, False))
    t_op = bench(lambda: torch.ops.hf_flash.bwd(dout, *args, False))
    t_ag = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    t_ag_t = bench(lambda: torch.autograd.grad(out, (q, k, v), dout_t, retain_graph=True))
    print(f"d{d} S{s} causal={causal}: _cuda_bwd {t_raw:.3f} ms, hf_flash::bwd {t_op:.3f}, autograd {t_ag:.3f}, "
          f"autograd strided dout {t_ag_t:.3f}")
    if d == 128 and causal:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                torch.autograd.grad(out, (q, k, v), dout_t, retain_graph=True)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
