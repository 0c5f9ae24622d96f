"""tools/ncu_compare.py's report handling (no GPU, no ncu): the main kernel is the longest one of a raw CSV page,
the table keeps the asked metrics that some backend measured, the SASS page's stall samples are summed by reason
and opcode for its busiest kernel, and a malformed shape is refused."""

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


# ncu --csv --page source --print-source sass: per kernel a name line, then its own table (columns abridged)
_COLS = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait",'
         '"stall_short_sb","stall_barrier","stall_wait (Not Issued)"')
SOURCE = "\n".join([
    '"Kernel Name","dot_do_o_kernel"', _COLS,
    '"0x10","      LDG.E R2, [R4.64]","9","1,024","0","0","0","0"',
    '"Kernel Name","void hf_flash::bwd_sm90::bwd_sm90_kernel<(bool)1, (int)128>(hf_flash::BwdParams)"', _COLS,
    '"0x20","      MUFU.EX2 R185, R185","1,010","2,080,768","1,000","10","0","900"',
    '"0x30","      MUFU.EX2 R186, R186","815","2,080,768","800","15","0","700"',
    '"0x40","@!P0  BRA 0x7f70","40","2,113,536","0","0","40","0"',
    '"0x50","      HGMMA.64x64x16.F32.BF16 R184, gdesc[UR12], RZ, !UPT","500","2,080,768","100","0","400","0"',
])


def test_source_stalls_of_the_busiest_kernel():
    sections = ncu.source_sections(SOURCE)
    assert [len(rows) for _, rows in sections] == [1, 4]
    name, rows = ncu.busiest(sections)
    assert "bwd_sm90_kernel" in name
    by_op = ncu.stalls(rows)
    assert by_op["MUFU.EX2"] == {"wait": 1800, "short_sb": 25, "barrier": 0}  # not-issued columns left out
    assert by_op["BRA"]["barrier"] == 40 and by_op["HGMMA.64x64x16"]["barrier"] == 400
    other = {"MUFU.EX2": ncu.collections.Counter(wait=100)}
    rows = ncu.stall_table({"hf_flash": by_op, "fa4": other}, top=2)
    assert rows[0] == ["all samples", "2365", "100"]
    assert rows[1] == ["  wait", "80.3%", "100.0%"]  # 1900 of 2365
    assert rows[-2:] == [["MUFU.EX2", "1825 (wait 1800)", "100 (wait 100)"],
                         ["HGMMA.64x64x16", "500 (barrier 400)", "-"]]
    with pytest.raises(ValueError, match="no kernel"):
        ncu.busiest(ncu.source_sections(""))


@pytest.mark.parametrize("shape", ["1,2,3", "1,16384,16,16,x", "0,1024,16,16,128"])
def test_bad_shape_is_refused(shape):
    with pytest.raises(SystemExit):
        ncu.main(["--shape", shape])
