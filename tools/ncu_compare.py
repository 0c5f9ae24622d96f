"""Nsight Compute of one attention call's main kernel, hf_flash next to FlashAttention-4 (and SDPA's cuDNN), on one
shape: runs ``ncu`` on this script once per backend (child mode: warm-up calls, then one profiled call between
cudaProfilerStart / Stop), keeps each report's longest kernel (the main forward or backward kernel, not the
pre / post-processing ones) and prints their metrics side by side: time, cycles, instructions, the tensor pipe,
shared-memory wavefronts and the warps' stall reasons.

    python tools/ncu_compare.py --shape 1,16384,16,16,128 --causal --mode bwd --out $OUT/ncu
    python tools/ncu_compare.py --shape 2,4096,32,8,128 --causal --backends hf_flash,fa4 --metrics wavefronts

``--shape`` is batch, seqlen, heads, kv heads, head dim; ``--clock-control none`` profiles at the clock the
GPU runs (ncu locks the base clock by default). Reports (``<backend>.ncu-rep``) and the table (``ncu.csv``) go to
``--out``; open a report with ``ncu --import``.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Metric-name fragments shown by default (ncu's raw names; each backend's value of every matching metric).
DEFAULT_METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.max", "smsp__inst_executed.sum",
                   "pipe_tensor", "wavefronts_mem_shared", "launch__registers_per_thread",
                   "issue_stalled")


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,16384,16,16,128", help="batch,seqlen,heads,kv_heads,head_dim")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    parser.add_argument("--backends", default="hf_flash,fa4", help="comma list (hf_flash, fa4, sdpa-cudnn, ...)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                        help="comma list of metric-name fragments to print")
    parser.add_argument("--set", dest="section_set", default="full", help="ncu --set")
    parser.add_argument("--clock-control", default="base", choices=("base", "none"))
    parser.add_argument("--out", default="ncu_out")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one backend's calls under ncu
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        parser.error(f"--shape takes 5 positive integers (batch,seqlen,heads,kv_heads,head_dim), got {args.shape!r}")
    args.shape = shape
    return args


def _child(args) -> None:
    """Warm-up calls, then one call of ``args.child`` inside the profiler range."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hf_flash.bench import kernels  # the kernel benchmark's inputs and timed calls, one case

    case = kernels.Case("ncu", *args.shape, args.causal)
    inputs = kernels._inputs(case, torch.bfloat16)
    run = kernels._call(args.mode, kernels._attention(args.child, case), inputs, torch.randn_like(inputs["q"]))
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def longest_kernel(raw_csv: str) -> dict[str, str]:
    """The row of ``ncu --csv --page raw`` output with the longest ``gpu__time_duration.sum`` (ncu's second line
    holds the units; values may carry thousands separators)."""
    rows = list(csv.DictReader(io.StringIO(raw_csv)))
    rows = [r for r in rows if _number(r.get("gpu__time_duration.sum")) is not None]
    if not rows:
        raise ValueError("no kernel with gpu__time_duration.sum in the report")
    return max(rows, key=lambda r: _number(r["gpu__time_duration.sum"]))


def _number(value: str | None) -> float | None:
    try:
        return float(value.replace(",", "")) if value not in (None, "") else None
    except ValueError:
        return None


def table(kernels: dict[str, dict[str, str]], fragments: list[str]) -> list[list[str]]:
    """Rows [metric, value per backend] for every metric whose name contains one of ``fragments`` in any
    backend's kernel, the kernel names first."""
    names = sorted({m for row in kernels.values() for m in row if any(f in m for f in fragments)})
    rows = [["kernel", *(row.get("Kernel Name", "?")[:60] for row in kernels.values())]]
    for m in names:
        values = [row.get(m, "") for row in kernels.values()]
        if any(_number(v) for v in values):  # all-zero or absent everywhere: not worth a line
            rows.append([m, *values])
    return rows


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.child:
        _child(args)
        return 0
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        print("ncu_compare: Nsight Compute's `ncu` is neither on PATH nor in /usr/local/cuda/bin", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for backend in args.backends.split(","):
        report = out / backend
        cmd = [ncu, "--profile-from-start", "off", "--set", args.section_set, "--clock-control",
               args.clock_control, "--export", str(report), "--force-overwrite", sys.executable,
               os.path.abspath(__file__), "--child", backend, "--shape", ",".join(map(str, args.shape)),
               "--mode", args.mode, *(["--causal"] if args.causal else [])]
        print(f"[ncu] {backend}: {' '.join(cmd[:8])} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"{backend}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"[ncu] {backend} failed (rc {proc.returncode}); see {out / (backend + '.log')}", file=sys.stderr)
            continue
        raw = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw"],
                             capture_output=True, text=True, check=True).stdout
        kernels[backend] = longest_kernel(raw)
    if not kernels:
        return 1
    rows = table(kernels, args.metrics.split(","))
    with open(out / "ncu.csv", "w", newline="") as f:
        csv.writer(f).writerows([["metric", *kernels], *rows])
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  " + "  ".join(f"{b:>20}" for b in kernels))
    for r in rows:
        print(f"{r[0]:{width}}  " + "  ".join(f"{v:>20}" for v in r[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
