"""tools/ncu_compare.py's report handling (no GPU, no ncu): the main kernel is the longest one of a raw CSV page,
the table keeps the asked metrics that some backend measured, and a malformed shape is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "ncu_compare", Path(__file__).resolve().parent.parent / "tools" / "ncu_compare.py")
ncu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu)

# ncu --csv --page raw: a header, a units line, one row per profiled kernel (values may carry separators)
RAW = '''"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared.sum","dram__bytes.sum"
"","","nsecond","inst","","byte"
"0","dot_do_o_kernel","12,500","1,000","0","5"
"1","bwd_sm90_kernel","4,210,000","1,753,000,000","0","9"
"2","convert_dq_blocks_kernel","61,000","2,000","7","3"
'''


def test_longest_kernel_is_the_main_one():
    row = ncu.longest_kernel(RAW)
    assert row["Kernel Name"] == "bwd_sm90_kernel"
    with pytest.raises(ValueError, match="no kernel"):
        ncu.longest_kernel(RAW.split("\n")[0] + "\n")


def test_table_keeps_asked_measured_metrics():
    other = dict(ncu.longest_kernel(RAW), **{"Kernel Name": "fa4_bwd", "smsp__inst_executed.sum": "1,589,000,000"})
    rows = ncu.table({"hf_flash": ncu.longest_kernel(RAW), "fa4": other}, ["inst_executed", "wavefronts", "nothing"])
    assert rows[0] == ["kernel", "bwd_sm90_kernel", "fa4_bwd"]
    assert rows[1:] == [["smsp__inst_executed.sum", "1,753,000,000", "1,589,000,000"]]  # all-zero wavefronts dropped


@pytest.mark.parametrize("shape", ["1,2,3", "1,16384,16,16,x", "0,1024,16,16,128"])
def test_bad_shape_is_refused(shape):
    with pytest.raises(SystemExit):
        ncu.main(["--shape", shape])
