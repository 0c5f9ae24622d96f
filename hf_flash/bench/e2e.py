"""Whole models: training tokens/s and peak memory, generation tokens/s, for hf_flash against sdpa,
flash_attention_4 (transformers' FlashAttention-4 backend, whenever ``flash_attn.cute`` imports),
flex_attention and eager in the same run. ``--backends ...,no-attention`` adds the bound: the same model with
every attention layer returning V (its heads repeated over the query groups), a step with all other work and no
attention, so "without attention / the best other" is the most any attention kernel could gain on that row.

Models (``generate.MODELS``, random init, bf16, AdamW): the Llama-style one of the generation benchmark
(8 layers, hidden 2048, 16 query / 8 KV heads) and a SmolLM2-135M-shaped one (30 layers, hidden 576, 9 / 3
heads, d64, intermediate 1536, vocab 49152). Training rows (``--rows``): Llama 2 x 4096, 1 x 16384,
1 x 32768 (max_position_embeddings 32768) and one packed row of 8192 tokens made of documents of random
length (position ids restart per document); SmolLM2 shape at 8 x 1024 and 16 x 512. Generation: the
generate benchmark's 8 x 1024 + 128 case, dynamic cache.
Times: per training row every backend's model is resident (when memory allows; on running out, the row is
redone one model at a time, building each anew per round in rotated order); after warm-up steps,
``--rounds`` rounds in which the backends take turns, each turn ``--steps`` steps on the CUDA-synchronised
wall clock; tokens/s = the median over rounds, spread = max - min. ``--processes``: every turn a process of
its own (one model, a fresh interpreter, allocator and collector, order rotated per round), for host-bound
models, whose steps depend on the state a long-lived process accumulates. Writes e2e.csv and e2e.png to --out,
appends to the results file and prints a table last.
"""

from __future__ import annotations

import csv
import gc
import os
import subprocess
import sys
import tempfile

import torch

from . import generate, results
from .generate import NO_ATTENTION, Row, build_model, error_row, plot, summary, take_turns, timed, with_fa4
from .kernels import write_csv
from .timing import median_spread, rotated

BACKENDS = ("hf_flash", "sdpa", "flex_attention", "eager")
# name -> (model, batch, tokens per row); "packed-" rows pack documents into one row.
TRAIN_SHAPES = {"2x4096": ("llama", 2, 4096), "1x16384": ("llama", 1, 16384), "packed-8192": ("llama", 1, 8192),
                "1x32768": ("llama", 1, 32768), "smol-8x1024": ("smol", 8, 1024), "smol-16x512": ("smol", 16, 512)}
EAGER_MAX_TOKENS_PER_ROW = 4096  # eager materialises B*H*S^2 scores
MIN_POSITIONS = 16384  # max_position_embeddings of the Llama rows, or the row's length if longer
GEN_SHAPE = "8x1024"
WARMUP_STEPS = 3


def add_arguments(parser) -> None:
    parser.add_argument("--backends", default=None,
                        help=f"comma list; default {','.join(BACKENDS)} and {generate.FA4} when FlashAttention-4 "
                             f"imports; {NO_ATTENTION} adds the bound without attention (training rows)")
    parser.add_argument("--rows", default=",".join(TRAIN_SHAPES),
                        help=f"comma list of training rows: {', '.join(TRAIN_SHAPES)}")
    parser.add_argument("--layers", type=int, default=8, help="depth of the Llama model (the SmolLM2 shape keeps 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the backends take turns (median)")
    parser.add_argument("--steps", type=int, default=3,
                        help=f"timed training steps per turn (after {WARMUP_STEPS} warm-up steps)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="one model resident at a time (order rotated per round) instead of all")
    parser.add_argument("--processes", action="store_true",
                        help="every turn in a process of its own (order rotated per round; for host-bound models)")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--out", default="bench_out", help="directory for e2e.csv / e2e.png")
    results.add_arguments(parser)


def train_batch(shape: str):
    _, batch, seqlen = TRAIN_SHAPES[shape]
    ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")  # below every model's vocabulary
    if not shape.startswith("packed"):
        return {"input_ids": ids, "labels": ids}
    gen = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seqlen:
        n = min(int(torch.randint(128, 2048, (1,), generator=gen)), seqlen - total)
        lengths.append(n)
        total += n
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    return {"input_ids": ids, "labels": ids, "position_ids": position_ids}


def _trainer(backend: str, shape: str, layers: int):
    """(step(), resident bytes) of one backend's benchmark model: step() is one AdamW training step on the
    shape's batch; resident = weights + optimizer state, what the model holds between steps."""
    model_name, _, seqlen = TRAIN_SHAPES[shape]
    batch = train_batch(shape)
    if model_name == "llama":
        model = build_model(backend, layers, max_positions=max(MIN_POSITIONS, seqlen))
    else:
        model = build_model(backend, None, max_positions=max(8192, seqlen), model=model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        # Fresh tensors each step, as a data loader gives: nothing a backend caches on its inputs carries over.
        model(**{name: t.clone() for name, t in batch.items()}).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    tensors = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values())]
    return step, sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.is_cuda)


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """The bound's "attention" (transformers' AttentionInterface signature): V for every query head of its group,
    laid out as attention outputs are, (batch, seqlen, heads, d); the gradients reach V and so every layer."""
    groups = query.shape[1] // value.shape[1]
    return value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous(), None


def register_no_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NO_ATTENTION, no_attention)
    AttentionMaskInterface.register(NO_ATTENTION, flash_attention_mask)  # no mask built, as for a flash kernel


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _one_at_a_time(backends: list[str], shape: str, layers: int, rounds: int, steps: int) -> tuple[dict, dict]:
    """The resident measurement's result when the models do not fit together: per round, each backend's
    model is built, warmed up and timed alone, in rotated order."""
    cases, failed = {b: {"times": [], "peak": 0, "resident": 0} for b in backends}, {}
    for r in range(rounds):
        for backend in rotated([b for b in backends if b not in failed], r):
            try:
                step, resident = _trainer(backend, shape, layers)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                cases[backend]["times"].append(timed(step, warmup=0, steps=1, calls=steps))
                cases[backend]["peak"] = max(cases[backend]["peak"], torch.cuda.max_memory_allocated() - base)
                cases[backend]["resident"] = resident
            except Exception as e:  # noqa: BLE001
                failed[backend] = e
                del cases[backend]
            step = None
            _free()
    return cases, failed


def measure_train(backends: list[str], shape: str, layers: int, rounds: int = 3, steps: int = 3,
                  resident: bool = True) -> list[Row]:
    """Every backend on one training shape. Resident: all models built first, then ``rounds`` rounds of
    turns (``generate.take_turns``; a fixed order drifts with clocks over a process). Peak memory = the
    model's weights and optimizer state + the most its own steps allocated on top of what was resident."""
    tokens = TRAIN_SHAPES[shape][1] * TRAIN_SHAPES[shape][2]
    rows = {}
    if resident:
        ready = {}
        for backend in backends:
            try:
                step, size = _trainer(backend, shape, layers)
                ready[backend] = {"run": step, "resident": size}
            except Exception as e:  # noqa: BLE001  (a backend that cannot run the shape)
                rows[backend] = error_row("train", shape, backend, e)
        failed = take_turns(ready, rounds, calls=steps)
    else:
        ready, failed = _one_at_a_time(backends, shape, layers, rounds, steps)
    for backend, e in failed.items():
        rows[backend] = error_row("train", shape, backend, e)
    for backend, case in ready.items():
        mid, lo, hi = median_spread([tokens / t for t in case["times"]])
        rows[backend] = Row("train", shape, backend, mid, (case["resident"] + case["peak"]) / 2**30,
                            spread=hi - lo)
    ready = None
    _free()
    return [rows[b] for b in backends]


def _turn_in_process(backend: str, shape: str, layers: int, steps: int) -> Row:
    """One turn in a fresh process: this benchmark with one backend, one model, one round (``_one_at_a_time``:
    built, warmed up, ``steps`` steps timed); its row from the child's e2e.csv, or the child's error."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "hf_flash.bench", "e2e", "--rows", shape, "--backends", backend, "--rounds", "1",
               "--steps", str(steps), "--layers", str(layers), "--one-at-a-time", "--skip-generate", "--no-record",
               "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        path = os.path.join(out, "e2e.csv")
        if done.returncode != 0 or not os.path.exists(path):
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return error_row("train", shape, backend, RuntimeError(f"child process: {last}"))
        with open(path, newline="") as f:
            row = next(r for r in csv.DictReader(f) if r["task"] == "train")
    return Row("train", shape, backend, float(row["tokens_per_s"]), float(row["peak_gib"]), error=row["error"])


def measure_train_processes(backends: list[str], shape: str, layers: int, rounds: int = 3,
                            steps: int = 3) -> list[Row]:
    """Every backend on one training shape, each turn in a process of its own (``_turn_in_process``), the
    order rotated per round; tokens/s = the median over rounds, spread = max - min, peak = the largest."""
    turns, rows = {b: [] for b in backends}, {}
    for r in range(rounds):
        for backend in rotated([b for b in backends if b not in rows], r):
            row = _turn_in_process(backend, shape, layers, steps)
            if row.error:
                rows[backend] = row  # a backend that cannot run the shape keeps its error, no more turns
            else:
                turns[backend].append(row)
    for backend, done in turns.items():
        if backend not in rows:
            mid, lo, hi = median_spread([t.tokens_per_s for t in done])
            rows[backend] = Row("train", shape, backend, mid, max(t.peak_gib for t in done), spread=hi - lo)
    return [rows[b] for b in backends]


def _out_of_memory(rows: list[Row]) -> bool:
    return any("OutOfMemoryError" in r.error for r in rows)


def run(args) -> None:
    from tqdm import tqdm

    import hf_flash  # noqa: F401  (registers the backend)

    backends = ([b.strip() for b in args.backends.split(",") if b.strip()] if args.backends
                else list(with_fa4(BACKENDS)))
    if NO_ATTENTION in backends:
        register_no_attention()
    shapes = [s.strip() for s in args.rows.split(",") if s.strip()]
    unknown = set(shapes) - set(TRAIN_SHAPES)
    if unknown:
        raise SystemExit(f"unknown --rows {sorted(unknown)}; choose from {list(TRAIN_SHAPES)}")
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be >= 1")
    if args.processes and args.one_at_a_time:
        raise SystemExit("--processes and --one-at-a-time are exclusive: each process holds one model")
    jobs = [("train", shape) for shape in shapes]
    if not args.skip_generate:
        jobs.append(("generate-dynamic", GEN_SHAPE))
    rows = []
    for task, shape in (bar := tqdm(jobs, desc="e2e", unit="case")):  # each case: all backends, interleaved
        bar.set_postfix_str(f"{task} {shape}")
        if task == "train":
            eligible = [b for b in backends if not (b == "eager" and TRAIN_SHAPES[shape][2] > EAGER_MAX_TOKENS_PER_ROW)]
            if args.processes:
                case_rows = measure_train_processes(eligible, shape, args.layers, args.rounds, args.steps)
            else:
                case_rows = measure_train(eligible, shape, args.layers, args.rounds, args.steps,
                                          resident=not args.one_at_a_time)
                if not args.one_at_a_time and _out_of_memory(case_rows):
                    print(f"{shape}: out of memory with every model resident; one model at a time")
                    case_rows = measure_train(eligible, shape, args.layers, args.rounds, args.steps, resident=False)
            rows += case_rows
        else:
            rows += generate.measure_interleaved([b for b in backends if b != NO_ATTENTION], shape, args.layers)
        write_csv(rows, args.out, "e2e.csv")  # after every case: a cut-off run keeps what it measured
    plot(rows, os.path.join(args.out, "e2e.png"))
    results.record(args, "e2e", generate.to_results(rows))
    print(summary(rows))
    spreads = [f"{r.shape} {r.backend} {100 * r.spread / r.tokens_per_s:.1f}%" for r in rows
               if r.task == "train" and r.tokens_per_s > 0]
    if spreads:
        print("training tokens/s spread (max - min over rounds): " + ", ".join(spreads))
