"""Property-based fuzzing of the public functions (cases and checks: tests/fuzz_cases.py).

On CPU the reference path runs a small budget (HF_FLASH_FUZZ_EXAMPLES valid cases, default 45, and a third as
many bad inputs); on a GPU the kernels run HF_FLASH_FUZZ_GPU_EXAMPLES cases (default 2000). A failure prints the
hypothesis example and a ``run_case(Case(...))`` line that reproduces it; paste the Case into
``fuzz_cases.REGRESSIONS``. Hypothesis' database is off, so every run explores new cases; GPU failures are
not shrunk unless HF_FLASH_FUZZ_SHRINK=1.
"""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_cases import (CPU, FAMILY_CASES, GPU, REGRESSIONS, SMALL_GPU, HypothesisSource, RandomSource, draw_bad_case,  # noqa: E402
                        draw_case, run_bad_case, run_case)

CPU_EXAMPLES = int(os.environ.get("HF_FLASH_FUZZ_EXAMPLES", "45"))
GPU_EXAMPLES = int(os.environ.get("HF_FLASH_FUZZ_GPU_EXAMPLES", "2000"))


def _settings(examples: int, shrink: bool = True):
    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]
    return settings(max_examples=max(1, examples), deadline=None, database=None, derandomize=False,
                    print_blob=True, phases=phases, suppress_health_check=list(HealthCheck))


# Shrinking a GPU failure reruns kernels many times; the failing Case is printed either way.
GPU_SHRINK = os.environ.get("HF_FLASH_FUZZ_SHRINK", "0") == "1"


cpu_cases = st.composite(lambda draw: draw_case(HypothesisSource(draw), CPU))()
gpu_cases = st.composite(lambda draw: draw_case(HypothesisSource(draw), GPU))()
cpu_bad_cases = st.composite(lambda draw: draw_bad_case(HypothesisSource(draw), CPU))()
gpu_bad_cases = st.composite(lambda draw: draw_bad_case(HypothesisSource(draw), GPU))()


@_settings(CPU_EXAMPLES)
@given(case=cpu_cases)
def test_fuzz_reference(case):
    run_case(case, "cpu")


@_settings(max(1, CPU_EXAMPLES // 3))
@given(case=cpu_bad_cases)
def test_fuzz_bad_inputs(case):
    run_bad_case(case, "cpu")


@pytest.mark.parametrize("case", REGRESSIONS, ids=lambda c: f"{c.kind}-{c.seed}")
def test_fuzz_regressions(case):
    run_case(case, "cpu")


def _family_id(case):
    return f"{case.kind}-d{case.d}" + (f"-rel{case.rel_bias}" if case.rel_bias >= 0 else "")


@pytest.mark.parametrize("case", FAMILY_CASES, ids=_family_id)
def test_family_cases(case):
    run_case(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", FAMILY_CASES, ids=_family_id)
def test_family_cases_kernels(case):
    run_case(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", REGRESSIONS, ids=lambda c: f"{c.kind}-{c.seed}")
def test_fuzz_regressions_kernels(case):
    run_case(case, "cuda")


@pytest.mark.gpu
@_settings(GPU_EXAMPLES, GPU_SHRINK)
@given(case=gpu_cases)
def test_fuzz_kernels(case):
    run_case(case, "cuda")


@pytest.mark.gpu
@_settings(max(1, GPU_EXAMPLES // 10), GPU_SHRINK)
@given(case=gpu_bad_cases)
def test_fuzz_kernels_bad_inputs(case):
    run_bad_case(case, "cuda")  # HF_FLASH_CHECK=1 (tests/conftest.py): the GPU checks raise like the CPU ones


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
def test_kernels_clamp_bad_values(seed, monkeypatch):
    """Without HF_FLASH_CHECK bad index values reach the kernels: they must run in bounds, forward and backward
    (an out-of-bounds access surfaces at the synchronize; tools/fuzz_sanitize.py runs these under memcheck)."""
    from hf_flash import checks

    monkeypatch.setattr(checks, "CHECK_VALUES", False)
    run_bad_case(draw_bad_case(RandomSource(seed), SMALL_GPU, errors=("value",)), "cuda", expect_error=False)
    torch.cuda.synchronize()
