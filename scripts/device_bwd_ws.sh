#!/bin/bash
# One GPU-machine call for the warp-specialised Hopper backward (branch hopper-bwd-ws; temporary, goes with the
# A/B switch HF_FLASH_BWD_SM90_WS). From the repository root (or the worktree) on an H100:
#   bash scripts/device_bwd_ws.sh     # QUICK=1: S in {2k, 8k} only in the A/B; RACE=1: racecheck too;
#                                     # BULK_MEMCHECK=1: memcheck of the dQ bulk-reduction variant too
# Steps, each logged under $OUT and bounded by a timeout so the A/B table still prints (about 9 minutes at
# most): sm_90a build, ptxas / SASS summary of the kernels, a smoke A/B of the gradients (stops the run on a hang or
# a mismatch), tests/test_kernels_bwd.py + tests/test_train_gpu.py (default kernel = ws),
# scripts/sanitize_sm90.py under memcheck, then scripts/bwd_ws_ab.py (ws, its dQ bulk-reduction variant, the
# previous kernel, SDPA-flash and cuDNN, same run), whose table is printed last.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ln -sfn ../patches hf_flash/patches  # pyproject installs patches/ as hf_flash.patches
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/log"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log"; }
if ! python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"; stamp "build failed"; exit 1
fi
stamp "built"
so=$(ls hf_flash/_C*.so | head -1)
cuobjdump -res-usage "$so" 2>/dev/null | grep -A1 "bwd_sm90" | grep -oE "Function [^ ]+|REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+" \
  | paste - - - - - >"$OUT/sass.txt"
for f in $(cuobjdump -sass "$so" | grep -oE "Function : \S*bwd_sm9011main_kernel\S*" | awk '{print $3}'); do
  echo "== $f" >>"$OUT/sass.txt"
  cuobjdump -sass -fun "$f" "$so" 2>/dev/null | grep -oE "(HGMMA|SYNCS|UTMALDG|LDGSTS|BAR|RED|USETMAXREG|LDL|STL)[.A-Z0-9_]*" | sort | uniq -c >>"$OUT/sass.txt"
done
# A hang (mbarrier phases) or wrong gradients show here within a minute; then the rest is not worth the time.
timeout 60 python3 scripts/bwd_ws_ab.py --smoke >"$OUT/smoke.log" 2>&1; rc=$?
stamp "smoke rc=$rc (124: timed out, likely a hang): $(tail -1 "$OUT/smoke.log")"
[ $rc = 0 ] || { tail -15 "$OUT/smoke.log"; exit 1; }
timeout 240 python3 -m pytest -q --tb=short -rfs --no-header -p no:cacheprovider -m gpu ${TESTS:-tests} \
  >"$OUT/tests.log" 2>&1; stamp "tests rc=$?: $(tail -1 "$OUT/tests.log")"
if [ -n "${GROUP_TEST:-}" ]; then  # the same tests with sections of GROUP_TEST pairs
  HF_FLASH_BWD_SM90_GROUP=$GROUP_TEST timeout 240 python3 -m pytest -q --tb=short -rfs --no-header -p no:cacheprovider \
    -m gpu ${TESTS:-tests} >"$OUT/tests_group.log" 2>&1; stamp "tests (group $GROUP_TEST) rc=$?: $(tail -1 "$OUT/tests_group.log")"
fi
timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_sm90.py >"$OUT/memcheck.log" 2>&1
stamp "memcheck rc=$?: $(grep -E "ERROR SUMMARY|sanitize_sm90" "$OUT/memcheck.log" | tr '\n' ' ')"
if [ "${BULK_MEMCHECK:-0}" = 1 ]; then  # the dQ bulk-reduction variant (HF_FLASH_BWD_SM90_WS=2) too
  HF_FLASH_BWD_SM90_WS=2 timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_sm90.py >"$OUT/memcheck_bulk.log" 2>&1
  stamp "memcheck (bulk) rc=$?: $(grep -E "ERROR SUMMARY|sanitize_sm90" "$OUT/memcheck_bulk.log" | tr '\n' ' ')"
fi
if [ "${RACE:-0}" = 1 ]; then
  timeout 150 compute-sanitizer --tool racecheck python3 scripts/sanitize_sm90.py >"$OUT/racecheck.log" 2>&1
  stamp "racecheck rc=$?: $(grep -E "RACECHECK SUMMARY|sanitize_sm90" "$OUT/racecheck.log" | tr '\n' ' ')"
fi
timeout 120 python3 scripts/bwd_ws_ab.py $([ "${QUICK:-0}" = 1 ] && echo --quick) --out "$OUT" >"$OUT/ab.log" 2>&1
stamp "a/b rc=$?"
grep -E "FAILED|Error|error" "$OUT/tests.log" | head -8
cat "$OUT/sass.txt" | head -40
tail -14 "$OUT/ab.log"
if [ "${E2E:-0}" = 1 ]; then  # training tokens/s of the e2e benchmark (no generation)
  timeout ${E2E_TIMEOUT:-240} python3 -m hf_flash.bench e2e --skip-generate --out "$OUT/bench" 2>&1 | tr '\r' '\n' \
    | grep -v "e2e:" > "$OUT/e2e.log"; stamp "e2e rc=$?"; tail -12 "$OUT/e2e.log"
fi
