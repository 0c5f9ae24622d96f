"""Timings of the build on PYTHONPATH next to SDPA cuDNN (GQA through enable_gqa, as transformers calls it),
backward (default) or forward, in one process; prints CSV lines TAG,case,backend,ms,tflops (scripts/bwd_ab.sh
compares builds; PASS=fwd there times the forward).

    python scripts/bwd_ab.py TAG [bwd|fwd]
"""
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_flash  # noqa: F401

# (name, batch, seqlen, heads, kv heads, head dim, causal): the e2e benchmark's Llama layer, then the paper grid.
CASES = [("llama 2x4096", 2, 4096, 16, 8, 128, True), ("llama 1x16384", 1, 16384, 16, 8, 128, True),
         ("llama 8x1024", 8, 1024, 16, 8, 128, True),
         ("d128 causal 2k", 8, 2048, 16, 16, 128, True), ("d128 causal 16k", 1, 16384, 16, 16, 128, True),
         ("d128 full 2k", 8, 2048, 16, 16, 128, False), ("d128 full 16k", 1, 16384, 16, 16, 128, False),
         ("d64 causal 2k", 8, 2048, 32, 32, 64, True), ("d64 causal 16k", 1, 16384, 32, 32, 64, True),
         ("d64 full 16k", 1, 16384, 32, 32, 64, False)]

tag, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bwd"
for name, b, s, h, hk, d, causal in CASES:
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    flops = (2.5 if mode == "bwd" else 1.0) * 4 * b * s * s * h * d / (2 if causal else 1)
    opts = (d**-0.5, causal, -1, 0 if causal else -1, 0.0, None, 0.0, None)
    out, lse = torch.ops.hf_flash.fwd(q, k, v, None, None, None, s, s, *opts, False)
    ours = lambda: torch.ops.hf_flash.bwd(dout, q, k, v, out, lse, None, None, s, s, *opts, False)  # noqa: E731
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                           enable_gqa=h != hk)
    cudnn = lambda: o.backward(dout.transpose(1, 2), retain_graph=True)  # noqa: E731
    if mode == "fwd":
        ours = lambda: torch.ops.hf_flash.fwd(q, k, v, None, None, None, s, s, *opts, False)  # noqa: E731
        qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk)
    for backend, fn in (("hf_flash", ours), ("cudnn", cudnn)):
        ms = triton.testing.do_bench(fn, warmup=100, rep=300, grad_to_none=[q, k, v], return_mode="median")
        print(f"{tag},{name},{backend},{ms:.4f},{flops / ms * 1e-9:.1f}", flush=True)
    del q, k, v, dout, out, lse, o
    torch.cuda.empty_cache()
