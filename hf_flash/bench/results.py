"""The one append-only results file, ``benchmarks/results.csv``: every bench subcommand appends its rows.

One row is one measured value: ``value`` is a median over interleaved rounds, ``spread`` its max - min over
those rounds in the same unit (empty where a single measurement was taken). ``COLUMNS`` is the file's
header and the only place it is spelt out; a file with another header is refused rather than mixed.
"""
from __future__ import annotations

import csv
import datetime
import math
import os
import subprocess
from dataclasses import dataclass

COLUMNS = ("date", "commit", "gpu", "torch", "cuda", "cudnn", "bench", "case", "backend", "metric", "value",
           "spread", "unit")
DEFAULT_PATH = os.path.join("benchmarks", "results.csv")


@dataclass
class Result:
    case: str
    backend: str
    metric: str
    value: float
    unit: str
    spread: float | None = None


def add_arguments(parser) -> None:
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {DEFAULT_PATH}")
    parser.add_argument("--results", default=DEFAULT_PATH, help="the append-only results file")


def commit() -> str:
    """Short hash of the checkout the package runs from, or "unknown" (no git, not a checkout);
    ``HF_FLASH_BENCH_COMMIT`` overrides it (a copy of the tree without its git metadata)."""
    if os.environ.get("HF_FLASH_BENCH_COMMIT"):
        return os.environ["HF_FLASH_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def environment() -> dict:
    """The columns every row of one run shares (all but bench and the measurement's own)."""
    import torch

    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "cudnn": (torch.backends.cudnn.version() or "") if cuda else ""}


def _number(x: float | None) -> str:
    return "" if x is None or not math.isfinite(x) else f"{x:.6g}"


def bench_label(bench: str, sustain: float | None = None) -> str:
    """The bench column: sustained runs (timing.SustainedTimer, ``sustain`` seconds a turn) apart from the default
    bursts, e.g. "kernels sustained 1.6 s"."""
    return f"{bench} sustained {sustain:g} s" if sustain else bench


def append(results: list[Result], bench: str, path: str = DEFAULT_PATH, env: dict | None = None) -> int:
    """Appends the finite-valued results as rows of ``path`` (created with the header if missing or empty);
    returns how many rows were written."""
    if not isinstance(bench, str) or not bench:
        raise ValueError(f"bench must be a non-empty string, got {bench!r}")
    rows = [r for r in results if r.value is not None and math.isfinite(r.value)]
    env = environment() if env is None else env
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = tuple(next(csv.reader(f), ()))
        if header != COLUMNS:
            raise ValueError(f"{path} has columns {list(header)}, expected {list(COLUMNS)}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        for r in rows:
            row = {**env, "bench": bench, "case": r.case, "backend": r.backend, "metric": r.metric,
                   "value": _number(r.value), "spread": _number(r.spread), "unit": r.unit}
            writer.writerow([row[c] for c in COLUMNS])
    return len(rows)


def record(args, bench: str, results: list[Result]) -> None:
    """Appends unless ``--no-record``; says where."""
    if args.no_record:
        return
    n = append(results, bench, args.results)
    print(f"appended {n} rows to {args.results}")
