"""A/B of the Hopper backward kernels in one process (GPU machine; temporary, branch hopper-bwd-ws): the
warp-specialised kernel with red.global.add dQ (ws, default), the same with dQ bulk reductions (bulk,
HF_FLASH_BWD_SM90_GROUP=2), the previous wgmma kernel (prev, HF_FLASH_BWD_SM90_GROUP=0; read per call), SDPA-flash and
SDPA-cuDNN, same run, backward only.

    python3 scripts/bwd_ws_ab.py [--quick] [--out DIR]
    python3 scripts/bwd_ws_ab.py --smoke   # first: small shapes, ws and bulk vs prev, exit 1 if they differ

Paper grid: hf_flash.bench.kernels.measure (B*S = 16k, H*D = 2048, bf16, TFLOP/s = 2.5 * 4*B*S^2*H*D, halved
when causal). Llama training shape: B=2, S=4096, 16 query / 8 KV heads, d128, causal, ms per call (SDPA on KV
heads repeated outside the timed region). Also prints the largest difference between the ws and prev kernels'
gradients on that shape (fp32 atomics: not bitwise equal). Writes DIR/bwd_ws_ab.csv; the table is printed last.
"""
import argparse
import csv
import os

import torch
import triton.testing

from hf_flash import flash_attn_func
from hf_flash.bench import kernels

KERNELS = {"auto": None, "g1": "1", "g8": "8"}  # column -> HF_FLASH_BWD_SM90_GROUP


def _group(flag):
    if flag is None:
        os.environ.pop("HF_FLASH_BWD_SM90_GROUP", None)
    else:
        os.environ["HF_FLASH_BWD_SM90_GROUP"] = flag


def grid_rows(seqlens):
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for s in seqlens:
                row = {"case": f"d{d} {'causal' if causal else 'full'} S={s}", "unit": "TFLOP/s"}
                for col, flag in KERNELS.items():
                    _group(flag)
                    r = kernels.measure("bwd", "hf_flash", d, causal, s, torch.bfloat16)
                    row[col] = r.tflops if r else float("nan")
                for col, backend in (("flash", "sdpa-flash"), ("cudnn", "sdpa-cudnn")):
                    r = kernels.measure("bwd", backend, d, causal, s, torch.bfloat16)
                    row[col] = r.tflops if r else float("nan")
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


def llama_row(b, s):
    torch.manual_seed(0)
    h, hk, d = 16, 8, 128
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    row, grads = {"case": f"llama {b}x{s} h16/8 d128 causal", "unit": "ms"}, {}
    for col, flag in KERNELS.items():
        _group(flag)
        grads[col] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        row[col] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                           warmup=25, rep=100, return_mode="median")
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["auto"], grads["g1"]))
    scale = max(g.float().abs().max().item() for g in grads["g1"])
    print(f"llama shape: max |grad_ws - grad_prev| = {diff:.3e} (max |grad| {scale:.3e})")
    from torch.nn.attention import sdpa_kernel
    backends = kernels._backends()
    qt = q.detach().transpose(1, 2).requires_grad_()
    kt, vt = (x.detach().repeat_interleave(h // hk, dim=2).transpose(1, 2).requires_grad_() for x in (k, v))
    for col, backend in (("flash", "sdpa-flash"), ("cudnn", "sdpa-cudnn")):
        try:
            with sdpa_kernel(backends[backend]):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            dt = dout.transpose(1, 2)
            row[col] = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dt, retain_graph=True),
                                               warmup=25, rep=100, return_mode="median")
        except RuntimeError:
            row[col] = float("nan")
    return row


def smoke():
    """Small dense / GQA / varlen shapes (lengths off the tiles, sq != sk): the kernels' gradients agree."""
    from hf_flash import flash_attn_varlen_func

    torch.manual_seed(0)
    worst = 0.0
    for d, causal, (sq, sk), (h, hk), varlen in [(64, False, (77, 150), (4, 2), False), (128, True, (150, 77), (4, 1), False),
                                                 (128, True, (300, 300), (4, 2), False), (64, True, (1000, 700), (2, 2), False),
                                                 (128, True, (0, 0), (4, 4), True)]:
        if varlen:
            lens = torch.tensor([0, 5, 0, 130, 64, 300], device="cuda")
            cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int()
            q, k, v = (torch.randn(int(cu[-1]), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            m = int(lens.max())
            out = flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal)
        else:
            q = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            out = flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        grads = {}
        for col, flag in KERNELS.items():
            _group(flag)
            grads[col] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        for col in ("auto", "g8"):
            for name, a, b in zip("qkv", grads[col], grads["g1"]):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
                worst = max(worst, err if err == err else float("inf"))  # NaN counts as a failure
                print(f"smoke {col} d{d} causal={causal} sq,sk={sq},{sk} h={h}/{hk} varlen={varlen} d{name}: "
                      f"rel max diff to prev {err:.2e}")
    print(f"smoke: worst relative difference ws / bulk vs prev {worst:.2e}")
    return worst < 2e-2  # bf16 gradients, fp32 atomics in a different order


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=f"S in {kernels.QUICK_SEQLENS} only")
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true", help="only compare the kernels' gradients on small shapes")
    args = parser.parse_args()
    if args.smoke:
        raise SystemExit(0 if smoke() else 1)
    rows = grid_rows(kernels.QUICK_SEQLENS if args.quick else (2048, 4096, 8192, 16384)) + [llama_row(2, 4096), llama_row(1, 16384), llama_row(8, 1024)]
    os.environ.pop("HF_FLASH_BWD_SM90_GROUP", None)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bwd_ws_ab.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "gpu", "torch", "cudnn"])
        writer.writeheader()
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        writer.writerows({**r, **env} for r in rows)
    print(f"{env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}: backward; gN = N (kv head, batch) pairs per "
          "grid section, key blocks slowest within a section; all = one section")
    cols = (*KERNELS, "flash", "cudnn")
    print(f"{'case':34} {'unit':8} " + " ".join(f"{c:>7}" for c in cols) + f" {'best':>5} {'best/g1':>8} {'best/cudnn':>10}")
    for r in rows:
        fast = (lambda a, b: a / b) if r["unit"] == "TFLOP/s" else (lambda a, b: b / a)
        best = "auto"
        print(f"{r['case']:34} {r['unit']:8} " + " ".join(f"{r[c]:7.3g}" for c in cols)
              + f" {best:>5} {fast(r[best], r['g1']):8.3f} {fast(r[best], r['cudnn']):10.3f}")


if __name__ == "__main__":
    main()
