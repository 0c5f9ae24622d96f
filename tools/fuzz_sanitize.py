"""The sanitizer runner: every kernel family on its edges (tests/fuzz_cases.py FAMILY_CASES), then a reduced,
fixed-seed set of the fuzzer's random cases, without hypothesis, for compute-sanitizer:

    compute-sanitizer --tool memcheck  --error-exitcode 1 python tools/fuzz_sanitize.py --cases 40
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/fuzz_sanitize.py --cases 40
    compute-sanitizer --tool initcheck --error-exitcode 1 python tools/fuzz_sanitize.py --cases 40 --bad 0 --no-check
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/fuzz_sanitize.py --bad 0 \
        --match deterministic=True

Each case runs the kernels forward and backward and is checked against float64 attention (``--no-check``
skips the comparison). ``--bad`` cases pass bad index values (decreasing or out-of-range offsets, too small
max_seqlen, cache lengths past the cache, bad left padding) straight to the kernels, with the value checks off
as on a GPU without HF_FLASH_CHECK: they must run without a sanitizer error, the kernels clamping every range
to its tensor. Their outputs are meaningless and may leave rows unwritten, which initcheck would report when
the backward reads them: run initcheck with ``--bad 0``. The caching allocator is off (unless
PYTORCH_NO_CUDA_MEMORY_CACHING is set already), so memcheck sees every tensor's own bounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from fuzz_cases import (FAMILY_CASES, SMALL_GPU, RandomSource, draw_bad_case, draw_case, run_bad_case,  # noqa: E402
                        run_case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=40, help="random valid cases (seeds 0..cases-1)")
    parser.add_argument("--bad", type=int, default=None, help="bad-value cases (default: cases // 4)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="only run the kernels (no float64 reference)")
    parser.add_argument("--match", default="",
                        help="only the valid cases whose repr contains this (deterministic=True)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fuzz_sanitize: needs a CUDA GPU", file=sys.stderr)
        return 2
    import hf_flash
    from hf_flash import checks, ops

    loaded, detail = ops.extension_status()
    if not loaded:
        print(f"fuzz_sanitize: {detail}", file=sys.stderr)
        return 2
    start, failures, ran = time.time(), 0, 0
    seeds = range(args.first_seed, args.first_seed + args.cases)
    for name, case in [*((f"family case {i}", c) for i, c in enumerate(FAMILY_CASES)),
                       *((f"seed {s}", draw_case(RandomSource(s), SMALL_GPU)) for s in seeds)]:
        if args.match not in repr(case):
            continue
        ran += 1
        try:
            run_case(case, "cuda", check=not args.no_check)
        except AssertionError as e:
            failures += 1
            print(f"FAIL {name}: {e}")
    bad = args.cases // 4 if args.bad is None else args.bad
    checks.CHECK_VALUES = False  # as on a GPU without HF_FLASH_CHECK: bad values reach the kernels
    for seed in range(args.first_seed, args.first_seed + bad):
        case = draw_bad_case(RandomSource(10**6 + seed), SMALL_GPU, errors=("value",))
        run_bad_case(case, "cuda", expect_error=False)
    torch.cuda.synchronize()
    print(f"fuzz_sanitize: hf_flash {hf_flash.__version__}, {ran} of {len(FAMILY_CASES)} family + {args.cases} random "
          f"cases ({failures} failed), {bad} bad-value "
          f"cases run unchecked, {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
