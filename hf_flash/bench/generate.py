"""Generation: tokens/s and peak memory of ``model.generate`` for hf_flash against every other
attention implementation in the same run: sdpa (its own backend choice, then forced to each SDPA
backend with torch.nn.attention.sdpa_kernel), eager and flex_attention.

Model (also the e2e benchmark's): Llama-style random init, 8 layers, hidden 2048, 16 query / 8 KV
heads (d 128), intermediate 5632, vocab 32000, bf16. Cases: 8 x 1024-token prompts (left-padded by
0..112 tokens) and 1 x 16384, each + 128 greedy tokens; a dynamic cache (decode steps run eagerly)
and a static cache (transformers compiles the decode step: torch.compile, mode reduce-overhead,
CUDA graphs). flash_attention_4 (transformers' FlashAttention-4 backend) joins the default backends whenever
``flash_attn.cute`` imports. tokens/s = new tokens / wall time of the whole generate call (prefill
included); prefill ms = a generate call of one new token, reported on its own (the issue-16 target:
hf_flash's prefill <= the best other backend's). CUDA-synchronised wall clock, median of timed calls
after a warm-up call (which also compiles). Dynamic-cache cases keep every backend's model loaded and time
the backends in turns, prefill calls first, then whole generate calls (generation is host-bound and drifts
over a process); static-cache cases compile
and time one model at a time. Writes generate.csv (after every case) and generate.png
to --out, appends tokens/s, prefill ms and peak GiB to the results file and prints a table last: each
backend against hf_flash, and hf_flash's tokens/s and prefill against the best other's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch

from . import results
from .backends import fa4_available
from .kernels import write_csv
from .timing import rotated

BACKENDS = ("hf_flash", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "eager", "flex_attention")
FA4 = "flash_attention_4"  # transformers' name for FlashAttention-4
# Not a backend: the layers' attention replaced by V itself (bench e2e), the most any attention kernel could
# gain in a step. Never the "best other".
NO_ATTENTION = "no-attention"
# The benchmark models (random init, bf16): config fields; "layers" is the default depth (llama: --layers).
MODELS = {"llama": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "layers": 8},
          "smol": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                   "num_key_value_heads": 3, "layers": 30}}  # SmolLM2-135M's shape (d 64)
SHAPES = {"8x1024": (8, 1024), "1x16384": (1, 16384)}
CACHES = ("dynamic", "static")
NEW_TOKENS = 128
PAD_STEP = 16  # row r of a batch is left-padded by PAD_STEP * r tokens


@dataclass
class Row:
    task: str
    shape: str
    backend: str
    tokens_per_s: float
    peak_gib: float
    prefill_ms: float = float("nan")
    error: str = ""
    spread: float = float("nan")  # tokens/s, max - min over rounds (e2e training)


def with_fa4(backends) -> tuple:
    """``backends`` plus flash_attention_4 when FlashAttention-4 imports."""
    return (*backends, FA4) if fa4_available() else tuple(backends)


def add_arguments(parser) -> None:
    parser.add_argument("--backends", default=None,
                        help=f"comma list; default {','.join(BACKENDS)} and {FA4} when FlashAttention-4 imports")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--caches", default=",".join(CACHES), help="comma list of dynamic, static")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--steps", type=int, default=3, help="timed generate calls per case (after one warm-up)")
    parser.add_argument("--out", default="bench_out", help="directory for generate.csv / generate.png")
    results.add_arguments(parser)


def build_model(backend: str, layers: int, max_positions: int, model: str = "llama"):
    """A benchmark model (``MODELS``: Llama-style, random init, bf16, on the GPU) with one attention
    implementation; ``layers`` None = the model's own depth."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = dict(MODELS[model])
    depth = fields.pop("layers")
    config = LlamaConfig(**fields, num_hidden_layers=layers or depth, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=backend, dtype=torch.bfloat16)


def timed(fn, warmup: int, steps: int, calls: int = 1) -> float:
    """Median over ``steps`` of the seconds per call of ``calls`` consecutive calls of ``fn``
    (CUDA-synchronised wall clock), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _sdpa_backend(backend: str):
    """("sdpa", SDPBackend or None) for the sdpa variants, (backend, None) otherwise."""
    from torch.nn.attention import SDPBackend

    forced = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-math": SDPBackend.MATH}
    return ("sdpa", forced[backend]) if backend in forced else (backend, None)


def prompts(batch: int, length: int):
    """Random token ids and a left-padding mask (row r padded by PAD_STEP * r tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : PAD_STEP * row] = 0
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def _generator(backend: str, shape: str, cache: str, layers: int, new_tokens: int):
    """(generate(n), weight bytes) of one backend's benchmark model: generate(n) adds n greedy tokens to the
    case's prompts, inside the forced SDPA backend for the sdpa-* variants."""
    from torch.nn.attention import sdpa_kernel

    batch, length = SHAPES[shape]
    implementation, sdpa_backend = _sdpa_backend(backend)
    model = build_model(implementation, layers, max_positions=length + new_tokens).eval()
    ids, mask = prompts(batch, length)
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def generate(n: int):
        with sdpa_kernel(sdpa_backend) if sdpa_backend is not None else contextlib.nullcontext():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, **extra)

    return generate, sum(t.numel() * t.element_size() for t in model.state_dict().values())


def error_row(task: str, shape: str, backend: str, e: Exception) -> Row:
    return Row(task, shape, backend, float("nan"), float("nan"),
               error=f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:120])


@torch.no_grad()
def measure(backend: str, shape: str, cache: str, layers: int = 8, new_tokens: int = NEW_TOKENS,
            steps: int = 3) -> Row:
    """One backend on one case, alone on the GPU; a backend that cannot run it gets a row with its error."""
    batch = SHAPES[shape][0]
    task = f"generate-{cache}"
    try:
        generate, _ = _generator(backend, shape, cache, layers, new_tokens)
        prefill = timed(lambda: generate(1), warmup=1, steps=steps)
        torch.cuda.reset_peak_memory_stats()
        seconds = timed(lambda: generate(new_tokens), warmup=1, steps=steps)
        return Row(task, shape, backend, batch * new_tokens / seconds, torch.cuda.max_memory_allocated() / 2**30,
                   prefill * 1e3)
    except Exception as e:  # noqa: BLE001  (whatever stops a backend on a case is its result)
        return error_row(task, shape, backend, e)
    finally:
        generate = None
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def take_turns(cases: dict, rounds: int, calls: int = 1) -> dict:
    """Times ``rounds`` turns of every case's ``run()`` with all of them resident, taking turns (the first case
    of each round rotates, ``timing.rotated``), so drift over a process falls on every backend alike; a turn
    is ``calls`` consecutive calls. Adds to each case dict its "times" (seconds per call, one per round) and
    "peak" (the most one turn allocated on top of what was resident: the other models too).
    Returns {name: exception} of the cases that raised (removed from ``cases``)."""
    failed = {}
    for case in cases.values():
        case.update(times=[], peak=0)
    for step in range(rounds):
        for name in rotated(list(cases), step):
            case = cases[name]
            try:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                case["times"].append(timed(case["run"], warmup=0, steps=1, calls=calls))
                case["peak"] = max(case["peak"], torch.cuda.max_memory_allocated() - base)
            except Exception as e:  # noqa: BLE001
                failed[name] = e
                del cases[name]
    return failed


@torch.no_grad()
def measure_interleaved(backends: list[str], shape: str, layers: int = 8, new_tokens: int = NEW_TOKENS,
                        steps: int = 3) -> list[Row]:
    """Every backend on one dynamic-cache case, all models loaded: first the prefill calls (one new token),
    then the whole generate calls, each taking turns (``take_turns``): host-bound generation drifts ~15%
    over one process. Peak memory = the backend's weights + the most its own call allocated on top of
    what was resident."""
    batch = SHAPES[shape][0]
    task = "generate-dynamic"
    ready, rows = {}, {}
    for backend in backends:
        try:
            generate, weights = _generator(backend, shape, "dynamic", layers, new_tokens)
            generate(1)  # warm-up
            generate(new_tokens)
            ready[backend] = {"run": lambda g=generate: g(new_tokens), "prefill": lambda g=generate: g(1),
                              "weights": weights}
        except Exception as e:  # noqa: BLE001
            rows[backend] = error_row(task, shape, backend, e)
    generate = None
    prefill = {backend: {"run": case["prefill"]} for backend, case in ready.items()}
    for backend, e in take_turns(prefill, steps).items():
        rows[backend] = error_row(task, shape, backend, e)
        del ready[backend]
    for backend, e in take_turns(ready, steps).items():
        rows[backend] = error_row(task, shape, backend, e)
    for backend, case in ready.items():
        rows[backend] = Row(task, shape, backend, batch * new_tokens / statistics.median(case["times"]),
                            (case["weights"] + case["peak"]) / 2**30,
                            statistics.median(prefill[backend]["times"]) * 1e3)
    ready = prefill = None
    gc.collect()
    torch.cuda.empty_cache()
    return [rows[b] for b in backends]


def plot(rows: list[Row], path: str) -> None:
    """Bars of tokens/s and peak memory per backend, one column of panels per (task, shape)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r.task, r.shape) for r in rows))
    backends = list(dict.fromkeys(r.backend for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.4 * len(groups) + 0.3 * len(backends), 6.5), squeeze=False)
    for col, (task, shape) in enumerate(groups):
        for row, (field, label) in enumerate((("tokens_per_s", "tokens/s"), ("peak_gib", "peak GiB"))):
            values = [next((getattr(r, field) for r in rows if (r.task, r.shape, r.backend) == (task, shape, b)),
                           float("nan")) for b in backends]
            ax = axes[row][col]
            ax.bar(backends, values, color=["C0" if b == "hf_flash" else "C7" for b in backends])
            ax.set_title(f"{task} {shape}", fontsize=9)
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"{torch.cuda.get_device_name()}, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(rows: list[Row]) -> str:
    lines = [f"{'task':17} {'shape':8} {'backend':15} {'tok/s':>8} {'prefill ms':>10} {'peak GiB':>8} "
             f"{'vs hf_flash':>11}"]
    ours = {(r.task, r.shape): r.tokens_per_s for r in rows if r.backend == "hf_flash" and r.tokens_per_s > 0}
    bound = {(r.task, r.shape): r.tokens_per_s for r in rows if r.backend == NO_ATTENTION and r.tokens_per_s > 0}
    prefill = {(r.task, r.shape): r.prefill_ms for r in rows if r.backend == "hf_flash" and r.prefill_ms > 0}
    for r in rows:
        base = ours.get((r.task, r.shape))
        ratio = f"{r.tokens_per_s / base:11.2f}" if base and r.tokens_per_s > 0 else f"{'-':>11}"
        lines.append(f"{r.task:17} {r.shape:8} {r.backend:15} {r.tokens_per_s:8.0f} {r.prefill_ms:10.1f} "
                     f"{r.peak_gib:8.1f} {ratio}" + (f"  ({r.error})" if r.error else ""))
    for (task, shape), tokens in ours.items():
        others = [r for r in rows if (r.task, r.shape) == (task, shape)
                  and r.backend not in ("hf_flash", NO_ATTENTION) and r.tokens_per_s > 0]
        if others:
            best = max(others, key=lambda r: r.tokens_per_s)
            lines.append(f"{task} {shape}: hf_flash {tokens / best.tokens_per_s:.2f}x the best other ({best.backend})")
            if (task, shape) in bound:
                lines.append(f"{task} {shape}: without attention {bound[task, shape] / best.tokens_per_s:.2f}x the "
                             "best other: the most any attention kernel could reach here")
    for (task, shape), ms in prefill.items():
        others = [r for r in rows if (r.task, r.shape) == (task, shape) and r.backend != "hf_flash"
                  and r.prefill_ms > 0]
        if others:
            best = min(others, key=lambda r: r.prefill_ms)
            lines.append(f"{task} {shape}: prefill hf_flash {ms:.1f} ms, the best other {best.prefill_ms:.1f} ms "
                         f"({best.backend}): {best.prefill_ms / ms:.2f}x")
    return "\n".join(lines)


def to_results(rows: list[Row]) -> list:
    """The results file's rows of a generate or e2e table."""
    out = []
    for r in rows:
        case = f"{r.task} {r.shape}"
        metric = "train_tokens_per_s" if r.task == "train" else "tokens_per_s"
        out += [results.Result(case, r.backend, metric, r.tokens_per_s, "tokens/s",
                               None if r.spread != r.spread else r.spread),
                results.Result(case, r.backend, "peak_gib", r.peak_gib, "GiB"),
                results.Result(case, r.backend, "prefill_ms", r.prefill_ms, "ms")]
    return out


def run(args) -> None:
    from tqdm import tqdm

    import hf_flash  # noqa: F401  (registers the backend)

    def split(text):
        return [x.strip() for x in text.split(",") if x.strip()]

    backends = split(args.backends) if args.backends else list(with_fa4(BACKENDS))
    jobs = [(shape, cache, backend) for shape in split(args.shapes) for cache in split(args.caches)
            for backend in (backends if cache == "static" else [None])]
    rows = []
    for shape, cache, backend in (bar := tqdm(jobs, desc="generate", unit="case")):
        bar.set_postfix_str(f"{shape} {cache} {backend or 'all backends, interleaved'}")
        if cache == "static":  # one model at a time: dynamo recompiles per model instance
            rows.append(measure(backend, shape, cache, args.layers, args.new_tokens, args.steps))
        else:
            rows += measure_interleaved(backends, shape, args.layers, args.new_tokens, args.steps)
        write_csv(rows, args.out, "generate.csv")  # after every case: a cut-off run keeps what it measured
    plot(rows, os.path.join(args.out, "generate.png"))
    results.record(args, "generate", to_results(rows))
    print(summary(rows))
