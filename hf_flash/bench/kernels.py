"""Attention kernels, hf_flash against FlashAttention-4 (whenever ``flash_attn.cute`` imports), cuDNN and
SDPA-flash, on the same tensors in one process.

Cases: the FlashAttention paper grid (B*S = 16k tokens, H*D = 2048, d in {64, 128}, causal and not,
S = 512..16k), the Llama GQA 32/8 d128 causal shapes 8 x 1024, 2 x 4096, 1 x 16384, a packed varlen
batch of 8 causal documents of 1..5000 tokens (GQA 32/8, d128; SDPA has no packed form), learned sinks
(gpt-oss's d64 GQA 64/8 causal layers, full and 128-key windowed, and a d128 shape; SDPA has no sinks or
windows), T5's relative position bias with R = 128, T5's max_distance (flan-t5-base's d64 12-head encoder and
decoder self-attention at 32 x 512, a 4 x 4k encoder and a d128 32-head causal 2 x 4k shape: hf_flash with its
float32 (H, 2R+1) table, SDPA as transformers calls it for T5, cuDNN and its own pick ("sdpa"), with the bias
materialised as a dense (1, H, S, S) mask in q's dtype (the causal mask folded in) outside the timed calls, as T5
builds it once for all its layers; FlexAttention with the table read in a score_mod; FA4 only without: it has no
relative bias), attention dropout at T5's default
p = 0.1 (flan-t5-base's encoder and decoder shapes and a d128 causal 2 x 4k; FA4 only without: it has no dropout),
and head dim 512 (Gemma 4's global layers) beside d256 at S = 4k. Each sinks, rel_bias and dropout case runs beside
the same shape without the feature (its twin, named without the " +sinks" / " +rel_bias" / " +dropout" suffix, with
the same FLOPs); each feature's cost is printed as a table of its own (GPU time without -> with, per backend).
FLOPs = 4*B*S^2*H*D (sum over documents when packed; halved when causal; the visible keys when windowed);
backward 2.5x, forward+backward 3.5x.
Inputs have ``requires_grad=True`` for every pass, as in training; the backward is
``torch.autograd.grad`` of a retained forward graph (no gradient accumulation kernels).
Timing (``timing.CallTimer``): each backend's batch of back-to-back calls is enqueued behind a sleep kernel,
CUDA events give GPU time per call and the enqueueing's wall clock the host time per call; backends take
turns in each of ``--rounds`` rounds (rotating who leads) and each cell is the median over rounds, with
their min-max spread. ``--sustain SECONDS`` (``timing.SustainedTimer``) times each backend's turn after
running it back to back for half that long instead, at the clock the board's power limit leaves (as a long
training run sees it), with that clock, the board power and the energy per call (NVML) as three more columns.
Writes kernels.csv and kernels.png (hf_flash / max(FA4, cuDNN) per case) to --out,
appends to the results file and prints the table last.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields, replace

import torch

from . import backends as B
from . import power, results
from .timing import (CallTimer, Power, SustainedTimer, host_bound, median_spread, relative_spread, short_error,
                     take_turns)

TOKENS, HIDDEN = 16384, 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 8192)
LLAMA_SHAPES = ((8, 1024), (2, 4096), (1, 16384))  # (batch, seqlen), GQA 32/8, d128, causal
QUICK_LLAMA = ((8, 1024),)
VARLEN_DOCS = (1, 300, 1000, 1700, 2500, 3300, 4200, 5000)  # tokens per packed document
# (name, batch, seqlen, heads, kv_heads, d, window): gpt-oss's full and sliding-window layers, and d128
SINK_SHAPES = (("gpt-oss 8x1k", 8, 1024, 64, 8, 64, -1), ("gpt-oss 1x8k", 1, 8192, 64, 8, 64, -1),
               ("gpt-oss 1x8k w128", 1, 8192, 64, 8, 64, 128), ("d128 2x4k", 2, 4096, 32, 8, 128, -1))
QUICK_SINKS = SINK_SHAPES[:1]
# (name, batch, seqlen, heads, kv_heads, d, causal): flan-t5-base's encoder and decoder self-attention, a long
# encoder, and a d128 decoder (names unlike the sinks' twins: rows are keyed by name)
REL_BIAS_SHAPES = (("t5-base enc 32x512", 32, 512, 12, 12, 64, False),
                   ("t5-base dec 32x512", 32, 512, 12, 12, 64, True),
                   ("t5 enc 4x4k", 4, 4096, 12, 12, 64, False), ("t5 d128 dec 2x4k", 2, 4096, 32, 32, 128, True))
QUICK_REL_BIAS = REL_BIAS_SHAPES[:1]
REL_BIAS_RADIUS = 128  # T5's max_distance: every distance past it reads the table's last column
# (name, batch, seqlen, heads, kv_heads, d, window): Gemma 2's layers (9b: 16 / 8 heads, d256, every other layer a
# 4096-key window; 27b: 32 / 16, d128), causal, scores capped at SOFTCAP
SOFTCAP_SHAPES = (("gemma2-9b 4x2k", 4, 2048, 16, 8, 256, -1), ("gemma2-9b 1x8k w4k", 1, 8192, 16, 8, 256, 4096),
                  ("gemma2-27b 2x4k", 2, 4096, 32, 16, 128, -1))
QUICK_SOFTCAP = SOFTCAP_SHAPES[:1]
SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping
# (name, batch, seqlen, heads, kv_heads, d, causal): T5 fine-tuning keeps its default attention dropout, which the
# Hopper kernels do not carry (the mma.sync ones run it), and a d128 decoder shape
# (names unlike the rel_bias pairs': rows are keyed by name)
DROPOUT_SHAPES = (("t5 train enc 32x512", 32, 512, 12, 12, 64, False),
                  ("t5 train dec 32x512", 32, 512, 12, 12, 64, True), ("d128 train dec 2x4k", 2, 4096, 32, 32, 128, True))
QUICK_DROPOUT = DROPOUT_SHAPES[:1]
DROPOUT_P = 0.1  # T5's dropout_rate
# The features measured beside their twin without ("<twin> +<feature>"), and their cost tables' titles
FEATURES = {"sinks": "learned sinks", "rel_bias": f"relative position bias (R = {REL_BIAS_RADIUS})",
            "dropout": f"attention dropout (p = {DROPOUT_P})", "softcap": f"softcap ({SOFTCAP:g})"}
TWIN = " +"
LARGE_D = (256, 512)  # head dims of the "d512" set: Gemma 4's global layers against the largest other kernel
# The attention layer of the e2e benchmark's small model (SmolLM2-135M: 9 / 3 heads, d64, causal) at its two batch
# shapes: few (kv head, batch) pairs, so the grids run in under two waves
SMOL_SHAPES = (("smol 8x1k", 8, 1024), ("smol 16x512", 16, 512))
SETS = ("grid", "llama", "varlen", "smol", *FEATURES, "d512")
MODES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DEFAULT_BACKENDS = ("hf_flash", B.FA4, B.FLEX, "sdpa-cudnn", "sdpa-flash", B.SDPA_DEFAULT)
BASELINES = (B.FA4, "sdpa-cudnn")  # the ratio column and plot: hf_flash / the best of these
MATH_MAX_SEQLEN = 4096  # the math backend materialises B*H*S^2 scores
TARGET_MS, MAX_CALLS = 20.0, 32  # per backend and round: ~20 ms of calls, at most 32 (launch queue depth)


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int  # the longest document when packed
    heads: int
    kv_heads: int
    d: int
    causal: bool
    docs: tuple = ()  # packed document lengths; empty = dense
    window: int = -1  # causal sliding window: each query sees itself and this many earlier keys
    feature: str = ""  # a key of FEATURES: this case is one of a pair measured with and without it
    featured: bool = False  # the twin with the feature (named "<twin> +<feature>")

    @property
    def sinks(self) -> bool:  # learned per-head sinks (gpt-oss)
        return self.featured and self.feature == "sinks"

    @property
    def rel_bias(self) -> bool:  # T5's relative position bias, radius REL_BIAS_RADIUS
        return self.featured and self.feature == "rel_bias"

    @property
    def dropout_p(self) -> float:  # attention dropout, DROPOUT_P on the featured twin
        return DROPOUT_P if self.featured and self.feature == "dropout" else 0.0

    @property
    def softcap(self) -> float:  # Gemma 2's score cap, SOFTCAP on the featured twin
        return SOFTCAP if self.featured and self.feature == "softcap" else 0.0

    def flops(self, mode: str) -> float:
        if self.window >= 0:
            pairs = self.batch * sum(min(i, self.window) + 1 for i in range(self.seqlen))
            return 4 * pairs * self.heads * self.d * FLOP_FACTOR[mode]
        squares = sum(n * n for n in self.docs) if self.docs else self.batch * self.seqlen**2
        return 4 * squares * self.heads * self.d / (2 if self.causal else 1) * FLOP_FACTOR[mode]


@dataclass
class Row:
    mode: str
    case: str
    d: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    kv_heads: int
    backend: str
    gpu_ms: float
    gpu_ms_min: float
    gpu_ms_max: float
    host_us: float
    host_us_min: float
    host_us_max: float
    tflops: float
    tflops_min: float
    tflops_max: float
    calls: int
    rounds: int
    # sustained timing only (medians over rounds; NaN otherwise): SM clock, board power, energy per call, the
    # host's enqueueing per call meanwhile
    clock_mhz: float = math.nan
    watts: float = math.nan
    mj_per_call: float = math.nan
    enqueue_us: float = math.nan


def _size(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def _twins(feature: str, plain: list[Case]) -> list[Case]:
    """Each case, then its twin with ``feature``: the same shape (and FLOPs), named "<name> +<feature>"."""
    return [c for p in plain for c in (replace(p, feature=feature),
                                       replace(p, name=p.name + TWIN + feature, feature=feature, featured=True))]


def cases(sets: list[str], head_dims: list[int], seqlens: tuple, llama: tuple, sinks: tuple = SINK_SHAPES,
          rel_bias: tuple = REL_BIAS_SHAPES, dropout: tuple = DROPOUT_SHAPES,
          softcap: tuple = SOFTCAP_SHAPES) -> list[Case]:
    out = []
    if "grid" in sets:
        out += [Case(f"d{d} {'causal' if c else 'full'} {_size(s)}", TOKENS // s, s, HIDDEN // d, HIDDEN // d, d, c)
                for d in head_dims for c in (False, True) for s in seqlens]
    if "llama" in sets:
        out += [Case(f"llama {b}x{_size(s)}", b, s, 32, 8, 128, True) for b, s in llama]
    if "varlen" in sets:
        out.append(Case(f"varlen {len(VARLEN_DOCS)} docs", len(VARLEN_DOCS), max(VARLEN_DOCS), 32, 8, 128, True,
                        VARLEN_DOCS))
    if "smol" in sets:
        out += [Case(name, b, s, 9, 3, 64, True) for name, b, s in SMOL_SHAPES]
    if "sinks" in sets:
        out += _twins("sinks", [Case(name, b, s, h, hk, d, True, window=w) for name, b, s, h, hk, d, w in sinks])
    if "rel_bias" in sets:
        out += _twins("rel_bias", [Case(name, b, s, h, hk, d, c) for name, b, s, h, hk, d, c in rel_bias])
    if "dropout" in sets:
        out += _twins("dropout", [Case(name, b, s, h, hk, d, c) for name, b, s, h, hk, d, c in dropout])
    if "softcap" in sets:
        out += _twins("softcap", [Case(name, b, s, h, hk, d, True, window=w) for name, b, s, h, hk, d, w in softcap])
    if "d512" in sets:  # same tokens and H*D as the grid, S = 4k
        out += [Case(f"d{d} {'causal' if c else 'full'} 4k", TOKENS // 4096, 4096, HIDDEN // d, HIDDEN // d, d, c)
                for c in (False, True) for d in LARGE_D]
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--mode", default="fwd,bwd", help="comma list of fwd, bwd, fwdbwd")
    parser.add_argument("--quick", action="store_true",
                        help=f"S in {QUICK_SEQLENS}, Llama 8x1024, the packed batch and one sinks, one "
                             f"rel_bias and one dropout pair only")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma list of {', '.join(SETS)}")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="", help="comma list overriding the grid's S")
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                        help=f"comma list of hf_flash, {B.FA4}, {B.FLEX}, {', '.join(B.SDPA)}, {B.SDPA_DEFAULT} "
                             f"({B.FA4} when it imports; {B.SDPA_DEFAULT}, SDPA's own pick, in the rel_bias pairs only; "
                             f"{B.FLEX} in the rel_bias and softcap pairs)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (median, spread)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="time each turn after SECONDS / 2 of back-to-back calls, over SECONDS / 2 more, at the "
                             "clock the power limit leaves (adds SM clock, board power, energy per call); 0: a "
                             "~20 ms batch after a sleep (default)")
    parser.add_argument("--out", default="bench_out", help="directory for kernels.csv / kernels.png")
    results.add_arguments(parser)


def split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _inputs(case: Case, dtype) -> dict:
    """The leaves requiring grad, by argument name: q, k, v, and the sinks (float32, as gpt-oss keeps them) or the
    relative bias table (float32 (H, 2R+1)) when the case has them."""
    kw = {"device": B.DEVICE, "dtype": dtype, "requires_grad": True}
    lead = (sum(case.docs),) if case.docs else (case.batch, case.seqlen)
    q = torch.randn(*lead, case.heads, case.d, **kw)
    k, v = (torch.randn(*lead, case.kv_heads, case.d, **kw) for _ in range(2))
    inputs = {"q": q, "k": k, "v": v}
    if case.sinks:
        inputs["sinks"] = torch.randn(case.heads, device=B.DEVICE, requires_grad=True)
    if case.rel_bias:
        inputs["rel_bias"] = torch.randn(case.heads, 2 * REL_BIAS_RADIUS + 1, device=B.DEVICE, requires_grad=True)
    return inputs


def _backend_inputs(name: str, case: Case, inputs: dict) -> dict:
    """``inputs`` as backend ``name`` takes them: the relative bias in its form (``backends.rel_bias_input``)."""
    if not case.rel_bias:
        return inputs
    return {**inputs, "rel_bias": B.rel_bias_input(name, inputs["rel_bias"], case.seqlen, case.causal,
                                                       inputs["q"].dtype)}


def doc_offsets(docs) -> torch.Tensor:
    """cu_seqlens of packed documents of these lengths (int32, on the benchmark's device)."""
    return torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=B.DEVICE)


def _attention(backend: str, case: Case):
    if not case.docs:
        return B.dense(backend, case.causal, case.window, case.dropout_p, case.softcap)
    return B.varlen(backend, case.causal, doc_offsets(case.docs), max(case.docs))


def _call(mode: str, attn, inputs: dict, dout):
    """The zero-argument call timed for ``mode``; the gradients are those of every input."""
    leaves = list(inputs.values())
    if mode == "fwd":
        return lambda: attn(**inputs)
    if mode == "bwd":
        out = attn(**inputs)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(attn(**inputs), leaves, dout)


def runs(name: str, case: Case) -> bool:
    """Whether backend ``name`` is measured on ``case``: sdpa-math materialises B*H*S^2 scores (up to
    MATH_MAX_SEQLEN); SDPA has no sinks, softcap or windows, and sdpa-flash takes no mask; FA4 has no relative
    bias or dropout;
    SDPA's own pick (what transformers runs) is measured in the rel_bias pairs, where it picks by the mask,
    and nowhere else: without a mask it picks one of the forced columns; FlexAttention in the rel_bias and
    softcap pairs (features it computes in its kernel, as a score_mod; each shape compiles its own kernels)."""
    if name == B.FLEX:
        return case.feature in ("rel_bias", "softcap")
    if name == "sdpa-math" and case.seqlen > MATH_MAX_SEQLEN:
        return False
    if name in (*B.SDPA, B.SDPA_DEFAULT) and (case.sinks or case.softcap or case.window >= 0):
        return False
    if name == B.SDPA_DEFAULT and case.feature != "rel_bias":
        return False
    if case.dropout_p and name == B.FA4:
        return False
    return not (case.rel_bias and name in (B.FA4, "sdpa-flash"))


def measure_case(case: Case, mode: str, names: list[str], rounds: int, timer: CallTimer, dtype,
                 errors: dict) -> list[Row]:
    """Every backend on one case and pass, the backends taking turns in each round."""
    inputs = _inputs(case, dtype)
    dout = torch.randn_like(inputs["q"])
    fns, sizes = {}, {}
    for name in names:
        try:
            fn = _call(mode, _attention(name, case), _backend_inputs(name, case, inputs), dout)
            sizes[name] = list(timer.warm_up(fn, TARGET_MS, MAX_CALLS))
            fns[name] = fn
        except Exception as e:  # noqa: BLE001  (the backend refuses the shape, or is absent)
            errors[(mode, case.name, name)] = short_error(e)
        torch.cuda.synchronize()

    def measure(name, fn):
        calls, host_guess = sizes[name]
        gpu_ms, host_us = timer(fn, calls, host_guess)
        sizes[name][1] = host_us * calls * 1e-3  # the next round's sleep from what the host really took
        return gpu_ms, host_us, getattr(timer, "last", Power())

    values, failed = take_turns(fns, rounds, measure)
    errors.update({(mode, case.name, name): short_error(e) for name, e in failed.items()})
    rows = []
    for name, per_round in values.items():
        gpu = median_spread([g for g, _, _ in per_round])
        host = median_spread([h for _, h, _ in per_round])
        tf = median_spread([case.flops(mode) / g * 1e-9 for g, _, _ in per_round])
        seen = {f.name: median_spread([getattr(p, f.name) for _, _, p in per_round])[0] for f in fields(Power)}
        rows.append(Row(mode, case.name, case.d, case.causal, case.seqlen, case.batch, case.heads, case.kv_heads,
                        name, *gpu, *host, *tf, sizes[name][0], len(per_round), **seen))
    fns = values = inputs = dout = None
    torch.cuda.empty_cache()
    return rows


def write_csv(rows, out_dir: str, name: str) -> dict:
    """Rows (dataclasses) plus the environment on every line; returns the environment."""
    os.makedirs(out_dir, exist_ok=True)
    env = results.environment()
    with open(os.path.join(out_dir, name), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), *env] if rows else list(env))
        writer.writeheader()
        writer.writerows({**asdict(r), **env} for r in rows)
    return env


def ratios(rows: list[Row]) -> dict:
    """{(mode, case): (hf_flash TFLOP/s / the best baseline's, that baseline)} where both were measured."""
    by = {(r.mode, r.case, r.backend): r for r in rows}
    out = {}
    for mode, case in dict.fromkeys((r.mode, r.case) for r in rows):
        ours = by.get((mode, case, "hf_flash"))
        base = [by[(mode, case, b)] for b in BASELINES if (mode, case, b) in by]
        if ours and base:
            best = max(base, key=lambda r: r.tflops)
            out[(mode, case)] = (ours.tflops / best.tflops, best.backend)
    return out


def plot(rows: list[Row], path: str) -> None:
    """One panel per pass: hf_flash's TFLOP/s over the best of FA4 and cuDNN, per case (1.0 and the 1.05
    target drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratio = ratios(rows)
    modes = list(dict.fromkeys(m for m, _ in ratio))
    if not modes:
        return
    cases_ = list(dict.fromkeys(c for _, c in ratio))
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 0.42 * len(cases_) + 2), 3.4 * len(modes)),
                             squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        names = [c for c in cases_ if (mode, c) in ratio]
        values = [ratio[(mode, c)][0] for c in names]
        ax.bar(range(len(names)), values, color=["C2" if v >= 1.05 else "C0" if v >= 1.0 else "C3" for v in values])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.05, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("hf_flash / max(FA4, cuDNN)")
        ax.set_title(f"{mode}: TFLOP/s ratio (median of rounds)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    sustained = any(math.isfinite(r.clock_mhz) for r in rows)
    fig.suptitle(f"{torch.cuda.get_device_name()}, bf16, inputs requiring grad"
                 + (", sustained (at the power limit's clock)" if sustained else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(header), "-" * (sum(widths) + 2 * len(widths) - 2), *map(fmt, lines)])


def host_table(rows: list[Row]) -> str:
    """Host µs per call and GPU µs per call, per backend."""
    names = list(dict.fromkeys(r.backend for r in rows))
    by = {(r.mode, r.case, r.backend): r for r in rows}
    lines = []
    for mode, case in dict.fromkeys((r.mode, r.case) for r in rows):
        cells = [by.get((mode, case, b)) for b in names]
        lines.append([f"{mode} {case}", *(f"{c.host_us:.0f} / {c.gpu_ms * 1e3:.0f}" if c else "-" for c in cells)])
    return "host / GPU µs per call\n" + _table(["case", *names], lines)


def power_table(rows: list[Row]) -> str:
    """Sustained runs: TFLOP/s at the mean SM clock, board power and energy per call, per backend; "host-bound"
    where the host's enqueueing took at least timing.HOST_BOUND of the GPU's time per call (the GPU then waits for
    the host at its jitter, and the time is partly the host's: such a cell ranks nothing)."""
    def cell(c: Row | None) -> str:
        if c is None:
            return "-"
        bound = " host-bound" if host_bound(c.enqueue_us, c.gpu_ms) else ""
        return f"{c.tflops:.0f} @ {c.clock_mhz:.0f} MHz, {c.watts:.0f} W, {c.mj_per_call:.3g} mJ{bound}"

    names = list(dict.fromkeys(r.backend for r in rows))
    by = {(r.mode, r.case, r.backend): r for r in rows}
    lines = [[f"{mode} {case}", *(cell(by.get((mode, case, b))) for b in names)]
             for mode, case in dict.fromkeys((r.mode, r.case) for r in rows)]
    return "sustained: TFLOP/s @ SM clock, board power, energy per call\n" + _table(["case", *names], lines)


def summary(rows: list[Row]) -> str:
    """case, hf_flash TFLOP/s, fa4, cudnn, ratio vs best (of fa4, cudnn), spread (the widest of the row's
    cells: (max - min) / median over rounds)."""
    by = {(r.mode, r.case, r.backend): r for r in rows}
    ratio = ratios(rows)
    lines = []
    for mode, case in dict.fromkeys((r.mode, r.case) for r in rows):
        cells = [by.get((mode, case, b)) for b in ("hf_flash", B.FA4, "sdpa-cudnn")]
        spreads = [relative_spread([r.tflops_min, r.tflops, r.tflops_max]) for r in cells if r]
        best = ratio.get((mode, case))
        lines.append([f"{mode} {case}", *(f"{c.tflops:.0f}" if c else "-" for c in cells),
                      f"{best[0]:.3f} ({best[1].replace('sdpa-', '')})" if best else "-",
                      f"{100 * max(spreads):.1f}%" if spreads else "-"])
    return _table(["case", "hf_flash TFLOP/s", "fa4", "cudnn", "ratio vs best", "spread"], lines)


def feature_costs(rows: list[Row]) -> str:
    """Per feature (FEATURES), GPU time of each featured case over its twin without, one column per backend that
    ran a case with the feature (a cell needs both twins; the sinks' target: +10% at most). One table per
    feature measured."""
    by = {(r.mode, r.case, r.backend): r for r in rows}
    tables = []
    for feature, title in FEATURES.items():
        suffix = TWIN + feature
        pairs = [(mode, case[: -len(suffix)], case) for mode, case in dict.fromkeys((r.mode, r.case) for r in rows)
                 if case.endswith(suffix)]
        if not pairs:
            continue
        names = list(dict.fromkeys(r.backend for r in rows if r.case.endswith(suffix)))
        lines = []
        for mode, plain, case in pairs:
            cells = [(by.get((mode, plain, b)), by.get((mode, case, b))) for b in names]
            lines.append([f"{mode} {plain}", *(f"{w.gpu_ms * 1e3:.0f} -> {s.gpu_ms * 1e3:.0f} µs "
                                                f"({s.gpu_ms / w.gpu_ms - 1:+.1%})" if w and s else "-"
                                                for w, s in cells)])
        tables.append(f"{title}: GPU time without -> with\n" + _table(["case", *names], lines))
    return "\n\n".join(tables)


def record(args, rows: list[Row]) -> None:
    out = []
    for r in rows:
        case = f"{r.mode} {r.case}"
        out += [results.Result(case, r.backend, "tflops", r.tflops, "TFLOP/s", r.tflops_max - r.tflops_min),
                results.Result(case, r.backend, "gpu_us", r.gpu_ms * 1e3, "us", (r.gpu_ms_max - r.gpu_ms_min) * 1e3),
                results.Result(case, r.backend, "host_us", r.host_us, "us", r.host_us_max - r.host_us_min),
                results.Result(case, r.backend, "clock_mhz", r.clock_mhz, "MHz"),
                results.Result(case, r.backend, "watts", r.watts, "W"),
                results.Result(case, r.backend, "mj_per_call", r.mj_per_call, "mJ"),
                results.Result(case, r.backend, "enqueue_us", r.enqueue_us, "us")]  # NaN ones are not written
    results.record(args, results.bench_label("kernels", args.sustain), out)


def run(args) -> None:
    from tqdm import tqdm

    modes = split(args.mode)
    if set(modes) - set(MODES) or not modes:
        raise SystemExit(f"unknown --mode {args.mode!r}; choose from {MODES}")
    sets = split(args.sets)
    if set(sets) - set(SETS) or not sets:
        raise SystemExit(f"unknown --sets {args.sets!r}; choose from {SETS}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.sustain < 0:
        raise SystemExit(f"--sustain must be >= 0 seconds, got {args.sustain}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    from hf_flash import ops

    backend, reason = ops.backend_for(torch.empty(1, 1, 1, 64, device="cuda", dtype=dtype))
    if backend != "cuda":
        raise SystemExit(f"hf_flash would run its PyTorch reference here ({reason}); build the extension first")
    names = B.available(split(args.backends))
    if B.FA4 in split(args.backends) and B.FA4 not in names:
        print(f"fa4 column left out: flash_attn.cute does not import ({B.fa4()[2]})", file=sys.stderr)
    seqlens = tuple(int(s) for s in split(args.seqlens)) or (QUICK_SEQLENS if args.quick else SEQLENS)
    grid = cases(sets, [int(d) for d in split(args.head_dims)], seqlens, QUICK_LLAMA if args.quick else LLAMA_SHAPES,
                 QUICK_SINKS if args.quick else SINK_SHAPES, QUICK_REL_BIAS if args.quick else REL_BIAS_SHAPES,
                 QUICK_DROPOUT if args.quick else DROPOUT_SHAPES, QUICK_SOFTCAP if args.quick else SOFTCAP_SHAPES)
    timer = CallTimer()
    if args.sustain:
        meter = power.meter(torch.cuda.current_device())
        if meter is None:
            print("--sustain: NVML cannot be read here; clock, power and energy columns left out", file=sys.stderr)
        timer = SustainedTimer(args.sustain, meter)
    rows, errors, env = [], {}, results.environment()
    for case in tqdm(grid, desc="kernels", unit="case"):
        for mode in modes:
            rows += measure_case(case, mode, [n for n in names if runs(n, case)], args.rounds, timer, dtype, errors)
        env = write_csv(rows, args.out, "kernels.csv")  # after every case: a cut-off run keeps what it measured
    plot(rows, os.path.join(args.out, "kernels.png"))
    record(args, rows)
    print(json.dumps(env))
    for (mode, case, name), why in errors.items():
        print(f"n/a: {mode} {case} {name}: {why}")
    for key in B.flex_options_used():
        print(f"note: {B.FLEX} ran q {key[0]}, k {key[1]} with kernel_options={B.FLEX_SMALL_BLOCKS} (Inductor found "
              "no config for its default blocks)")
    print(host_table(rows))
    if args.sustain:
        print(power_table(rows))
    print(feature_costs(rows))
    print(summary(rows))
