"""The Hopper kernels' CTA order (csrc/sm90/schedule.cuh) on the host: tests/host/schedule_test.cu, compiled with
nvcc where it is installed (no GPU needed). Every tile of a grid is one (pair, block) exactly once, and a pair's
block n - 1 starts before its block n, which the deterministic backward's ordered dQ adds rely on; deterministic
full attention takes sections of ~num_sms / 4 pairs within the byte cap."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit); no GPU")
def test_section_order_on_the_host(tmp_path):
    exe = tmp_path / "schedule_test"
    build = subprocess.run(["nvcc", "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", "-x", "cu",
                            str(ROOT / "tests" / "host" / "schedule_test.cu"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-4000:]
