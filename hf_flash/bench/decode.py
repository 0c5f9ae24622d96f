"""Decode attention: one query token per sequence against a full KV cache, hf_flash's split-KV kernel
against each SDPA backend, as achieved bandwidth of the KV-cache read.

B = 8 sequences (--batch), 8 KV heads, 32 query heads (16 and 8 at a few lengths), d = 128, bf16,
cache S = 1k..64k. The cache is stored (B, H_k, S, d) as transformers keeps it; hf_flash reads it
through a transposed view, SDPA directly (enable_gqa where the backend takes it, else K/V repeated to
H heads beforehand, outside the timing). GB/s = K + V bytes of the cache (2 * B * S * H_k * d * 2) /
time, whatever a backend reads in addition. Copy bandwidth: a torch copy of a 1 GiB buffer, (read +
write bytes) / time. Every call is captured in a CUDA graph (no launch overhead in the timing, as in
graph-captured generation) and replayed after an L2 flush, the backends taking turns; times are
medians of CUDA events after warm-up. Writes decode.csv, appends to the results file and prints a table:
GB/s per backend, hf_flash in % of the copy bandwidth and its speedup over each SDPA backend.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

import torch

from . import results
from .backends import SDPA, sdpa_backend
from .kernels import write_csv

BATCH, KV_HEADS, HEAD_DIM = 8, 8, 128  # defaults; --batch changes B
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
EXTRA_HEADS = {16: (4096, 32768), 8: (4096, 32768)}  # query heads -> cache lengths also measured


@dataclass
class Row:
    heads: int
    kv_heads: int
    seqlen: int
    batch: int
    backend: str
    gqa: str  # how the backend sees the KV heads: kernel (hf_flash), enable_gqa or repeat_kv
    ms: float
    gb_per_s: float
    pct_of_copy: float


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="32 query heads, S in {4k, 32k} only")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--splits", default="1", help="comma list of fixed num_splits also timed (hf_flash-<n>split)")
    parser.add_argument("--reps", type=int, default=30, help="timed replays per case (after 3 warm-up)")
    parser.add_argument("--out", default="bench_out", help="directory for decode.csv")
    results.add_arguments(parser)


def capture(fn):
    """fn captured in a CUDA graph, or None when it cannot run or be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up (lazy init, autotuning) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None


def time_ms(fns: dict, reps: int) -> dict:
    """Median ms per captured fn; each replay follows an L2 flush, and the fns take turns in every
    round, in a rotating order, so that clock or power drift does not favour one of them."""
    graphs = {name: g for name, g in ((name, capture(fn)) for name, fn in fns.items()) if g is not None}
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    times = {name: [] for name in graphs}
    names = list(graphs)
    for i in range(reps + 3):
        for name in names[i % len(names):] + names[:i % len(names)]:  # each fn leads some rounds
            graph = graphs[name]
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= 3:  # warm-up rounds
                times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(reps: int) -> float:
    """GB/s of a device-to-device torch copy (bytes read + bytes written)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms({"copy": lambda: dst.copy_(src)}, reps)["copy"] * 1e-6


def _sdpa(backend, q, k, v, enable_gqa: bool):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(sdpa_backend(backend)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def measure_case(batch: int, heads: int, seqlen: int, splits: list[int], reps: int, copy_gbps: float) -> list[Row]:
    from hf_flash import flash_attn_with_kvcache

    dtype, group = torch.bfloat16, heads // KV_HEADS
    k, v = (torch.randn(batch, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=dtype)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * k.numel() * k.element_size()

    def hf_flash(num_splits):
        return lambda: flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               cache_seqlens=seqlens, causal=True, num_splits=num_splits)

    cases = {("hf_flash", "kernel"): hf_flash(0)}
    cases.update({(f"hf_flash-{n}split", "kernel"): hf_flash(n) for n in splits})
    repeated = None
    for backend in SDPA:
        try:  # q_len 1: no causal mask needed (SDPA's is_causal aligns top-left)
            _sdpa(backend, q, k, v, enable_gqa=group > 1)
            cases[(backend, "enable_gqa" if group > 1 else "none")] = lambda b=backend: _sdpa(b, q, k, v, group > 1)
        except RuntimeError:
            if repeated is None:
                repeated = [t.repeat_interleave(group, dim=1) for t in (k, v)]
            cases[(backend, "repeat_kv")] = lambda b=backend: _sdpa(b, q, *repeated, False)
    rows = []
    for (backend, gqa), ms in time_ms(cases, reps).items():  # a backend that refuses the shape is left out
        gbps = kv_bytes / ms * 1e-6
        rows.append(Row(heads, KV_HEADS, seqlen, batch, backend, gqa, ms, gbps, 100 * gbps / copy_gbps))
    return rows


def summary(rows: list[Row], copy_gbps: float) -> str:
    """One line per (B, H, S): GB/s per backend, hf_flash in % of copy, SDPA time / hf_flash time."""
    backends = list(dict.fromkeys(r.backend for r in rows))
    sdpa = [b for b in backends if b.startswith("sdpa")]
    by_key = {(r.batch, r.heads, r.seqlen, r.backend): r for r in rows}
    head = (f"{'B':>2} {'H':>3} {'S':>6} " + " ".join(f"{b:>15}" for b in backends) + f" {'hf %copy':>8} "
            + " ".join(f"{'x ' + b[5:]:>11}" for b in sdpa))
    lines = [f"KV read GB/s (H_k={KV_HEADS}, d={HEAD_DIM}, bf16); copy bandwidth {copy_gbps:.0f} GB/s",
             head, "-" * len(head)]
    for case in dict.fromkeys((r.batch, r.heads, r.seqlen) for r in rows):
        cells = [by_key.get((*case, b)) for b in backends]
        ours = by_key.get((*case, "hf_flash"))
        ratios = [by_key.get((*case, b)) for b in sdpa]
        lines.append(f"{case[0]:2} {case[1]:3} {case[2]:6} "
                     + " ".join(f"{c.gb_per_s:15.0f}" if c else f"{'-':>15}" for c in cells)
                     + (f" {ours.pct_of_copy:7.0f}%" if ours else f" {'-':>8}") + " "
                     + " ".join(f"{r.ms / ours.ms:11.2f}" if r and ours else f"{'-':>11}" for r in ratios))
    return "\n".join(lines)


def run(args) -> None:
    from hf_flash import ops

    backend, reason = ops.backend_for(torch.empty(1, 1, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
    if backend != "cuda":
        raise SystemExit(f"hf_flash would run its PyTorch reference here ({reason}); build the extension first")
    copy_gbps = copy_bandwidth(args.reps)
    torch.cuda.empty_cache()
    if args.quick:
        grid = [(32, s) for s in (4096, 32768)]
    else:
        grid = [(32, s) for s in SEQLENS] + [(h, s) for h, lens in EXTRA_HEADS.items() for s in lens]
    splits = [int(n) for n in args.splits.split(",") if n.strip()]
    rows = []
    for heads, seqlen in grid:
        rows += measure_case(args.batch, heads, seqlen, splits, args.reps, copy_gbps)
        torch.cuda.empty_cache()
    env = write_csv(rows, args.out, "decode.csv")
    results.record(args, "decode", [results.Result(f"B{r.batch} H{r.heads}/{r.kv_heads} S{r.seqlen}", r.backend,
                                                   "kv_read_gb_per_s", r.gb_per_s, "GB/s") for r in rows])
    print(json.dumps({**env, "copy_gb_per_s": round(copy_gbps, 1)}))
    print(summary(rows, copy_gbps))
