"""Host time of one decode-step attention call, layer by layer of the call stack (GPU machine).

    python scripts/decode_overhead.py [--batch 8] [--cache 1152]

Dynamic-cache generation is host-bound (a step of the 8-layer benchmark model takes ~9 ms of which the
GPU is busy a fraction), so what each attention call costs on the CPU decides tokens/s. Each entry is
called 2000 times without synchronising; the kernels (~10-30 us) queue behind the launches, so wall time
per call is host time. Shapes as ``python -m hf_flash.bench generate``: 16 query / 8 KV heads, d 128,
bf16, one new token, a left-padded 2-D mask.
"""
import argparse
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_flash
from hf_flash import integration, ops

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--cache", type=int, default=1152)
args = p.parse_args()

b, s, h, hk, d = args.batch, args.cache, 16, 8, 128
dev, dt = "cuda", torch.bfloat16
q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
k = torch.randn(b, hk, s, d, device=dev, dtype=dt)
v = torch.randn_like(k)
mask2d = torch.ones(b, s, dtype=torch.long, device=dev)
mask2d[1:, :7] = 0  # left padding on all rows but the first
mask4d = torch.zeros(b, 1, 1, s, device=dev, dtype=dt).masked_fill(~mask2d.bool()[:, None, None], float("-inf"))
start = mask2d.argmax(-1).int()
end = torch.full((b,), s, dtype=torch.int32, device=dev)


class Layer(torch.nn.Module):
    is_causal, num_key_value_groups, training = True, h // hk, False
    config = None


layer = Layer()
scale = d ** -0.5
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
entries = {
    "hf_flash attention_forward": lambda: integration.attention_forward(layer, q, k, v, mask2d, scaling=scale),
    "hf_flash.flash_attn_with_kvcache": lambda: hf_flash.flash_attn_with_kvcache(
        qt, kt, vt, cache_seqlens=end, cache_leftpad=start, softmax_scale=scale, causal=True),
    "ops.run_fwd_kvcache (eager body)": lambda: ops.run_fwd_kvcache(qt, kt, vt, end, start, scale, True, -1, 0, 0.0,
                                                                    None, 0),
    "ops.fwd_kvcache (custom op)": lambda: ops.fwd_kvcache(qt, kt, vt, end, start, scale, True, -1, 0, 0.0, None, 0),
    "_cuda_fwd_kvcache (C++ op)": lambda: torch.ops.hf_flash._cuda_fwd_kvcache(
        qt, kt, vt, end, start, scale, True, -1, 0, 0.0, None, 0),
    "sdpa attention_forward": lambda: sdpa_attention_forward(layer, q, k, v, mask4d, scaling=scale),
    "F.scaled_dot_product_attention": lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask4d, scale=scale, enable_gqa=True),
}
with torch.no_grad():
    for name, fn in entries.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        host = (time.perf_counter() - t) / 2000 * 1e6
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / 2000 * 1e6
        print(f"{name:36s} host {host:7.1f} us/call   with GPU drain {total:7.1f} us/call")
