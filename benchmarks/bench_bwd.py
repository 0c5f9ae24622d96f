"""Backward of hf_flash's kernels vs SDPA's flash backend (same run, same GPU).

    python benchmarks/bench_bwd.py [--csv out.csv]

Anchor shape: bf16, B*S = 16k tokens, H*D = 2048. Timings: triton do_bench
median; FLOPs = 2.5 * 4*B*S^2*H*D (halved when causal). Ours times
hf_flash::_cuda_bwd alone (D, dQ accumulation and conversion included),
SDPA the autograd backward of its flash forward.
"""
import argparse
import csv
import datetime
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_flash  # noqa: F401  (loads the ops)


def bench(d, s, causal, deterministic=False):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        t_sdpa = triton.testing.do_bench(
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup=50, rep=200,
            return_mode="median")
    lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[1]  # (B, H, S) natural log
    bshd = lambda t: t.detach().transpose(1, 2)  # our layout (B, S, H, D), strided views
    args = (bshd(dout), bshd(q), bshd(k), bshd(v), bshd(out), lse.contiguous(), None, None, s, s, d**-0.5, causal,
            -1, 0 if causal else -1, 0.0, None, 0.0, None, deterministic)
    t_ours = triton.testing.do_bench(lambda: torch.ops.hf_flash._cuda_bwd(*args), warmup=50, rep=200,
                                     return_mode="median")
    flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
    return flops / t_ours * 1e-9, flops / t_sdpa * 1e-9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default=None)
    parser.add_argument("--seqlens", default="2048,4096,16384")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--causal", default="no,yes", help="no, yes or no,yes")
    parser.add_argument("--no-det", action="store_true", help="skip the deterministic-mode rows")
    args = parser.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    causals = [c == "yes" for c in args.causal.split(",")]
    gpu, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    rows = []
    for d in dims:
        for causal in causals:
            for s in map(int, args.seqlens.split(",")):
                ours, sdpa = bench(d, s, causal)
                rows.append(dict(gpu=gpu, date=date, torch=torch.__version__, variant=os.environ.get("HF_FLASH_BWD_VARIANT", "0"), d=d, causal=causal, seqlen=s,
                                 deterministic=False, ours_tflops=round(ours, 1), sdpa_flash_tflops=round(sdpa, 1),
                                 ratio=round(ours / sdpa, 3)))
    for d in [] if args.no_det or False not in causals else dims:  # deterministic cost, first S, non-causal
        base = next(r for r in rows if r["d"] == d and not r["causal"])
        det, _ = bench(d, base["seqlen"], False, deterministic=True)
        rows.append(dict(base, deterministic=True, ours_tflops=round(det, 1),
                         ratio=round(det / base["sdpa_flash_tflops"], 3)))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    variant = os.environ.get("HF_FLASH_BWD_VARIANT", "0")
    print(f"# {gpu}, torch {torch.__version__}, {date}, variant {variant}, command: {' '.join(sys.argv)}")
    print("d    causal  S      det   ours  sdpa-flash  ratio")
    for r in rows:
        print(f"{r['d']:<4} {str(r['causal']):<7} {r['seqlen']:<6} {str(r['deterministic']):<5} "
              f"{r['ours_tflops']:>5} {r['sdpa_flash_tflops']:>10}  {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
