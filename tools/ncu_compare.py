"""Nsight Compute of one attention call's main kernel, hf_flash next to FlashAttention-4 (and SDPA's cuDNN), on one
shape: runs ``ncu`` on this script once per backend (child mode: warm-up calls, then one profiled call between
cudaProfilerStart / Stop), keeps each report's longest kernel (the main forward or backward kernel, not the
pre / post-processing ones) and prints their metrics side by side: time, cycles, instructions, the tensor pipe,
shared-memory wavefronts and the warps' stall reasons. Then, from each report's SASS page (``--set full``'s source
counters), where that kernel's warps stalled: the stall samples by reason and by instruction opcode, side by side
(the table that located the d128 backward's gap to FA4 in the exponentials and the LSE / D loads' waits:
docs/design/backward-sm90.md, "Profile against FA4 at causal 16k").

    python tools/ncu_compare.py --shape 1,16384,16,16,128 --causal --mode bwd --out $OUT/ncu
    python tools/ncu_compare.py --shape 2,4096,32,8,128 --causal --backends hf_flash,fa4 --metrics wavefronts

``--shape`` is batch, seqlen, heads, kv heads, head dim; ``--clock-control none`` profiles at the clock the
GPU runs (ncu locks the base clock by default). Reports (``<backend>.ncu-rep``) and the table (``ncu.csv``) go to
``--out``, with ``stalls.csv`` (opcode, backend, reason, samples) and each kernel's SASS with its samples
(``<backend>.sass.csv``); open a report with ``ncu --import``.
"""
from __future__ import annotations

import argparse
import collections
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


def source_sections(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, SASS rows) per kernel of ``ncu --import R --csv --page source --print-source sass``, whose
    kernels each start with a '"Kernel Name","<name>"' line followed by their own CSV table."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            sections.append((next(csv.reader([line]))[1], []))
        elif sections:
            sections[-1][1].append(line)
    return [(name, list(csv.DictReader(lines))) for name, lines in sections]


def _samples(row: dict[str, str]) -> float:
    return _number(row.get("Warp Stall Sampling (All Samples)")) or 0.0


def busiest(sections: list[tuple[str, list[dict[str, str]]]]) -> tuple[str, list[dict[str, str]]]:
    """The kernel with the most stall samples (the longest one; the source page names kernels unlike the raw
    page, so they are not matched by name)."""
    if not sections:
        raise ValueError("no kernel in the source page (was the report taken with source counters, --set full?)")
    return max(sections, key=lambda sec: sum(_samples(r) for r in sec[1]))


def opcode(sass: str) -> str:
    """An instruction's opcode and first modifier ("@!P0 BRA 0x..." -> "BRA", "HGMMA.64x64x16.F32.BF16 ..." ->
    "HGMMA.64x64x16"): one line per kind of instruction, shapes apart."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return ".".join(words[0].split(".")[:2]) if words else "?"


def stalls(rows: list[dict[str, str]]) -> dict[str, collections.Counter]:
    """Samples by opcode and stall reason (ncu's "stall_<reason>" columns, the not-issued ones left out)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r.get("Source", ""))
        for key, value in r.items():
            if key and key.startswith("stall_") and "Not Issued" not in key:
                out[op][key[len("stall_"):]] += _number(value) or 0.0
    return out


def stall_table(by_backend: dict[str, dict[str, collections.Counter]], top: int = 20) -> list[list[str]]:
    """Rows: each reason's share of a backend's samples, then the ``top`` opcodes by their most-sampled backend,
    each cell "samples (the reasons over 20% of them)"."""
    backends = list(by_backend)
    totals = {b: sum((c for c in by_backend[b].values()), collections.Counter()) for b in backends}
    grand = {b: sum(totals[b].values()) or 1.0 for b in backends}
    reasons = sorted({k for t in totals.values() for k in t}, key=lambda k: -max(totals[b][k] for b in backends))
    rows = [["all samples", *(f"{grand[b]:.0f}" for b in backends)]]
    rows += [[f"  {k}", *(f"{100 * totals[b][k] / grand[b]:.1f}%" for b in backends)]
             for k in reasons if any(totals[b][k] for b in backends)]
    ops = sorted({op for b in backends for op in by_backend[b]},
                 key=lambda op: -max(sum(by_backend[b].get(op, {}).values()) for b in backends))
    for op in ops[:top]:
        cells = []
        for b in backends:
            c = by_backend[b].get(op, collections.Counter())
            n = sum(c.values())
            main = ", ".join(f"{k} {v:.0f}" for k, v in c.most_common() if n and v > 0.2 * n)
            cells.append(f"{n:.0f} ({main})" if n else "-")
        rows.append([op, *cells])
    return rows


def _source(ncu: str, report: Path, out: Path, backend: str) -> dict[str, collections.Counter] | None:
    """The busiest kernel's stall samples by opcode from ``report``; its SASS rows to <backend>.sass.csv."""
    proc = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "source", "--print-source",
                           "sass"], capture_output=True, text=True)
    try:
        name, rows = busiest(source_sections(proc.stdout))
    except ValueError as e:
        print(f"[ncu] {backend}: {e}", file=sys.stderr)
        return None
    with open(out / f"{backend}.sass.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", name])
        w.writerow(["address", "sass", "samples", "executed"])
        w.writerows([r.get("Address"), r.get("Source", "").strip(), _samples(r), r.get("Instructions Executed")]
                    for r in rows)
    return stalls(rows)


def _print(rows: list[list[str]], header: list[str]) -> None:
    width = max(len(r[0]) for r in rows)
    cell = max(20, *(len(v) for r in rows for v in r[1:]))
    print(f"{'':{width}}  " + "  ".join(f"{b:>{cell}}" for b in header))
    for r in rows:
        print(f"{r[0]:{width}}  " + "  ".join(f"{v:>{cell}}" for v in r[1:]))


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
    kernels, sources = {}, {}
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
        by_op = _source(ncu, report, out, backend)
        if by_op is not None:
            sources[backend] = by_op
    if not kernels:
        return 1
    rows = table(kernels, args.metrics.split(","))
    with open(out / "ncu.csv", "w", newline="") as f:
        csv.writer(f).writerows([["metric", *kernels], *rows])
    _print(rows, list(kernels))
    if sources:
        with open(out / "stalls.csv", "w", newline="") as f:
            csv.writer(f).writerows([["opcode", "backend", "reason", "samples"]] +
                                    [[op, b, k, v] for b, by_op in sources.items() for op, c in sorted(by_op.items())
                                     for k, v in sorted(c.items()) if v])
        print("\nstall samples of the main kernel: by reason (share), by opcode (samples, the main reasons)")
        _print(stall_table(sources), list(sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
