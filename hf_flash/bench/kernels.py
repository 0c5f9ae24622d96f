"""Attention kernels on the FlashAttention paper grid: hf_flash against each SDPA backend.

B*S = 16k tokens, H*D = 2048, d in {64, 128}, causal and not, S = 512..16k.
FLOPs = 4*B*S^2*H*D (halved when causal); backward 2.5x that, forward+backward 3.5x.
Times are medians of CUDA-event timings after warm-up (triton.testing.do_bench).
Writes kernels.csv and kernels.png to --out and prints a table with the ratio to SDPA-flash.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
from dataclasses import asdict, dataclass

import torch

TOKENS, HIDDEN = 16384, 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)
MODES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
MATH_MAX_SEQLEN = 4096  # the math backend materialises B*H*S^2 scores


@dataclass
class Row:
    mode: str
    d: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    backend: str
    ms: float
    tflops: float
    peak_mib: float


def add_arguments(parser) -> None:
    parser.add_argument("--mode", default="fwd", help="comma list of fwd, bwd, fwdbwd")
    parser.add_argument("--quick", action="store_true", help=f"S in {QUICK_SEQLENS} only")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--out", default="bench_out", help="directory for kernels.csv / kernels.png")


def _backends():
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}


def _attention(backend: str, causal: bool):
    """f(q, k, v) on (B, S, H, D) tensors."""
    if backend == "hf_flash":
        from hf_flash import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    from torch.nn.attention import sdpa_kernel

    sdpa_backend = _backends()[backend]

    def sdpa(q, k, v):
        with sdpa_kernel(sdpa_backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return sdpa


def _hf_flash_backward_built() -> bool:
    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        _attention("hf_flash", False)(q, q, q).sum().backward()
        return True
    except RuntimeError:
        return False


def _bench(fn, grads) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def measure(mode: str, backend: str, d: int, causal: bool, seqlen: int, dtype) -> Row | None:
    batch, heads = TOKENS // seqlen, HIDDEN // d
    attn = _attention(backend, causal)
    needs_grad = mode != "fwd"
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, requires_grad=needs_grad)
               for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        if mode == "fwd":
            fn = lambda: attn(q, k, v)  # noqa: E731
        elif mode == "bwd":
            out = attn(q, k, v)
            fn = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
        else:
            fn = lambda: attn(q, k, v).backward(dout)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = _bench(fn, [q, k, v] if needs_grad else None)
    except (RuntimeError, torch.cuda.OutOfMemoryError):  # backend refuses the shape, or no memory
        return None
    finally:
        del q, k, v, dout
    flops = 4 * batch * seqlen**2 * heads * d / (2 if causal else 1) * FLOP_FACTOR[mode]
    return Row(mode, d, causal, seqlen, batch, heads, backend, ms, flops / ms * 1e-9, peak)


def environment() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def write_csv(rows, out_dir: str, name: str) -> dict:
    """Rows (dataclasses) plus the environment on every line, for appending runs together; returns the environment."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    with open(os.path.join(out_dir, name), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), *env])
        writer.writeheader()
        writer.writerows({**asdict(r), **env} for r in rows)
    return env


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.mode, r.d, r.causal) for r in rows})
    cols = 2
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(11, 3.6 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    for ax, (mode, d, causal) in zip(axes.flat, panels):
        for backend in dict.fromkeys(r.backend for r in rows):
            pts = [(r.seqlen, r.tflops) for r in rows if (r.mode, r.d, r.causal, r.backend) == (mode, d, causal, backend)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length (B*S = 16k)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{torch.cuda.get_device_name()}, H*D = 2048")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(rows: list[Row]) -> str:
    """One line per (mode, d, causal, S): TFLOP/s per backend and hf_flash / SDPA-flash."""
    backends = list(dict.fromkeys(r.backend for r in rows))
    by_key = {(r.mode, r.d, r.causal, r.seqlen, r.backend): r for r in rows}
    head = f"{'mode':6} {'d':>4} {'causal':>6} {'S':>6} " + " ".join(f"{b:>14}" for b in backends) + "  hf/flash"
    lines = [head, "-" * len(head)]
    for mode, d, causal, seqlen in dict.fromkeys((r.mode, r.d, r.causal, r.seqlen) for r in rows):
        cells = [by_key.get((mode, d, causal, seqlen, b)) for b in backends]
        ours, flash = by_key.get((mode, d, causal, seqlen, "hf_flash")), by_key.get((mode, d, causal, seqlen, "sdpa-flash"))
        ratio = f"{ours.tflops / flash.tflops:8.2f}" if ours and flash else f"{'-':>8}"
        lines.append(f"{mode:6} {d:4} {str(causal):>6} {seqlen:6} "
                     + " ".join(f"{c.tflops:14.1f}" if c else f"{'-':>14}" for c in cells) + "  " + ratio)
    return "\n".join(lines)


def run(args) -> None:
    from tqdm import tqdm

    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --mode {sorted(unknown)}; choose from {MODES}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    from hf_flash import ops

    backend, reason = ops.backend_for(torch.empty(1, 1, 1, 64, device="cuda", dtype=dtype))
    if backend != "cuda":
        raise SystemExit(f"hf_flash would run its PyTorch reference here ({reason}); build the extension first")
    seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    head_dims = [int(d) for d in args.head_dims.split(",")]
    hf_bwd = any(m != "fwd" for m in modes) and _hf_flash_backward_built()
    backends = ["hf_flash", *_backends()]
    jobs = [(m, b, d, c, s) for m in modes for d in head_dims for c in (False, True) for s in seqlens for b in backends
            if not (b == "hf_flash" and m != "fwd" and not hf_bwd) and not (b == "sdpa-math" and s > MATH_MAX_SEQLEN)]
    rows = []
    for job in tqdm(jobs, desc="kernels", unit="case"):
        row = measure(*job, dtype)
        if row is not None:
            rows.append(row)
        torch.cuda.empty_cache()
    env = write_csv(rows, args.out, "kernels.csv")
    plot(rows, os.path.join(args.out, "kernels.png"))
    if any(m != "fwd" for m in modes) and not hf_bwd:
        print("hf_flash backward not built: its bwd / fwdbwd rows are skipped")
    print(json.dumps(env))
    print(summary(rows))
