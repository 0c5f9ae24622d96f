"""tools/soak.py runs on CPU (a tiny model on the reference path): the trace files and the summary line."""

import csv
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_soak_smoke(tmp_path, capsys):
    path = Path(__file__).resolve().parent.parent / "tools" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    assert soak.main(["--minutes", "0.2", "--device", "cpu", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("soak PASS:"), last
    with open(tmp_path / "memory.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["step"].split()[0] for r in rows} >= set(soak.STEP_KINDS)  # every kind of step ran
    assert float(rows[-1]["seconds"]) < 0.2 * 60 + 5  # --minutes honoured
    assert (tmp_path / "memory.png").exists() or "matplotlib" in last
