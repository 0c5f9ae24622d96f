"""Host overhead per attention call: µs of host time for forward without grad, forward with grad (inputs
requiring grad, forward only), backward, and decode (one new token per sequence against a KV cache),
hf_flash next to SDPA (flash and cuDNN backends) and FlashAttention-4 in the same run.

Shapes where the host dominates: the Llama layer at 8 x 1024 (GQA 32/8, d128, causal) and a tiny
1 x 128 one (same heads). Decode uses caches of those lengths (``backends.decode``).
Method (``timing.CallTimer``): a batch of back-to-back calls is enqueued behind a sleep kernel, so launches
never wait on the GPU: host time = wall time of the enqueueing / calls, GPU time = CUDA events around the
batch / calls. Backends take turns in each of ``--rounds`` rounds; medians over rounds, min-max spread.
Writes overhead.csv to --out, appends to the results file and prints the table last.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from . import backends as B
from . import results
from .kernels import _table, split, write_csv
from .timing import CallTimer, median_spread, short_error, take_turns

SHAPES = {"llama-8x1024": (8, 1024), "tiny-1x128": (1, 128)}  # (batch, seqlen)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
OPS = ("fwd", "fwd-grad", "bwd", "decode")
DEFAULT_BACKENDS = ("hf_flash", "sdpa-flash", "sdpa-cudnn", B.FA4)


@dataclass
class Row:
    shape: str
    op: str
    backend: str
    host_us: float
    host_us_min: float
    host_us_max: float
    gpu_us: float
    gpu_us_min: float
    gpu_us_max: float
    calls: int


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                        help=f"comma list of hf_flash, {B.FA4}, {', '.join(B.SDPA)} ({B.FA4} when it imports)")
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls per timed batch")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median, spread)")
    parser.add_argument("--out", default="bench_out", help="directory for overhead.csv")
    results.add_arguments(parser)


def call(op: str, backend: str, batch: int, seqlen: int):
    """The zero-argument call timed for ``op``."""
    if op == "decode":
        return B.decode(backend, batch, seqlen, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
    grad = op != "fwd"
    kw = {"device": B.DEVICE, "dtype": torch.bfloat16, "requires_grad": grad}
    q = torch.randn(batch, seqlen, HEADS, HEAD_DIM, **kw)
    k, v = (torch.randn(batch, seqlen, KV_HEADS, HEAD_DIM, **kw) for _ in range(2))
    attn = B.dense(backend, causal=True)
    if op == "fwd":
        def fwd():
            with torch.no_grad():
                return attn(q, k, v)
        return fwd
    if op == "fwd-grad":
        return lambda: attn(q, k, v)
    out, dout = attn(q, k, v), torch.randn_like(q)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def measure(shape: str, op: str, names: list[str], calls: int, rounds: int, timer: CallTimer,
            errors: dict) -> list[Row]:
    batch, seqlen = SHAPES[shape]
    fns, guess = {}, {}
    for name in names:
        try:
            fn = call(op, name, batch, seqlen)
            n, batch_ms = timer.warm_up(fn, 1.0, 1)
            fns[name], guess[name] = fn, batch_ms / n * calls
        except Exception as e:  # noqa: BLE001
            errors[(shape, op, name)] = short_error(e)
        torch.cuda.synchronize()

    def time_one(name, fn):
        gpu_ms, host_us = timer(fn, calls, guess[name])
        guess[name] = host_us * calls * 1e-3
        return host_us, gpu_ms * 1e3

    values, failed = take_turns(fns, rounds, time_one)
    errors.update({(shape, op, name): short_error(e) for name, e in failed.items()})
    rows = [Row(shape, op, name, *median_spread([h for h, _ in v]), *median_spread([g for _, g in v]), calls)
            for name, v in values.items()]
    fns = values = None
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[Row]) -> str:
    """host µs (GPU µs) per call, one column per backend; the last column: hf_flash's host time over the best
    SDPA backend's (the target is <= 1)."""
    names = list(dict.fromkeys(r.backend for r in rows))
    by = {(r.shape, r.op, r.backend): r for r in rows}
    lines = []
    for shape, op in dict.fromkeys((r.shape, r.op) for r in rows):
        cells = [by.get((shape, op, b)) for b in names]
        ours = by.get((shape, op, "hf_flash"))
        sdpa = [by[(shape, op, b)].host_us for b in B.SDPA if (shape, op, b) in by]
        lines.append([f"{shape} {op}",
                      *(f"{c.host_us:.0f} ({c.gpu_us:.0f})" if c else "n/a" for c in cells),
                      f"{ours.host_us / min(sdpa):.2f}" if ours and sdpa else "-"])
    return ("host µs per call (GPU µs per call), medians of rounds\n"
            + _table(["case", *names, "hf/best sdpa host"], lines))


def run(args) -> None:
    shapes, ops = split(args.shapes), split(args.ops)
    if set(shapes) - set(SHAPES) or not shapes:
        raise SystemExit(f"unknown --shapes {args.shapes!r}; choose from {list(SHAPES)}")
    if set(ops) - set(OPS) or not ops:
        raise SystemExit(f"unknown --ops {args.ops!r}; choose from {OPS}")
    if args.calls < 1 or args.rounds < 1:
        raise SystemExit("--calls and --rounds must be >= 1")
    from hf_flash import ops as hf_ops

    backend, reason = hf_ops.backend_for(torch.empty(1, 1, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
    if backend != "cuda":
        raise SystemExit(f"hf_flash would run its PyTorch reference here ({reason}); build the extension first")
    names = B.available(split(args.backends))
    if B.FA4 in split(args.backends) and B.FA4 not in names:
        print(f"fa4 column left out: flash_attn.cute does not import ({B.fa4()[2]})", file=sys.stderr)
    timer = CallTimer()
    rows, errors = [], {}
    for shape in shapes:
        for op in ops:
            rows += measure(shape, op, names, args.calls, args.rounds, timer, errors)
    env = write_csv(rows, args.out, "overhead.csv")
    results.record(args, "overhead", [
        result for r in rows for result in (
            results.Result(f"{r.shape} {r.op}", r.backend, "host_us", r.host_us, "us", r.host_us_max - r.host_us_min),
            results.Result(f"{r.shape} {r.op}", r.backend, "gpu_us", r.gpu_us, "us", r.gpu_us_max - r.gpu_us_min))])
    print(json.dumps(env))
    for (shape, op, name), why in errors.items():
        print(f"n/a: {shape} {op} {name}: {why}")
    print(summary(rows))
