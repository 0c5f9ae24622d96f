#!/usr/bin/env bash
# The fuzzer, compute-sanitizer and soak runs on a GPU (kernels built: python -m hf_flash build).
# Each stage fits one 10-minute command; logs and the soak's trace go to $OUT (default ./fuzz_out).
#   bash tools/fuzz_gpu.sh fuzz                         # >= 2000 kernel cases + 200 bad inputs (HF_FLASH_CHECK=1)
#   bash tools/fuzz_gpu.sh memcheck|racecheck|initcheck  # the reduced fixed-seed set under compute-sanitizer
#   bash tools/fuzz_gpu.sh soak                         # 8 minutes of training + generate, memory trace
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-fuzz_out}
mkdir -p "$OUT"
case "${1:?stage: fuzz | memcheck | racecheck | initcheck | soak}" in
  fuzz)
    HF_FLASH_FUZZ_GPU_EXAMPLES=${EXAMPLES:-2000} timeout 570 python3 -m pytest tests/test_fuzz.py -m gpu -q --hypothesis-show-statistics \
      -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/fuzz.log" | tail -30 ;;
  memcheck|racecheck|initcheck)
    bad=$([ "$1" = initcheck ] && echo 0 || echo 10)  # unchecked bad values leave rows unwritten: not for initcheck
    # racecheck: only the kernels' shared memory matters. initcheck: the float64 oracle is not under test, and
    # every kernel must stay instrumented (filtering to ours hides torch's writes: its outputs read "uninitialised")
    check=$([ "$1" != memcheck ] && echo --no-check)
    timeout 570 compute-sanitizer --tool "$1" --error-exitcode 1 \
      python3 tools/fuzz_sanitize.py --cases "${CASES:-40}" --bad "$bad" $check 2>&1 | tee "$OUT/$1.log" \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|fuzz_sanitize|FAIL|Error" | tail -20 ;;
  soak)
    python3 tools/soak.py --minutes "${MINUTES:-8}" --out "$OUT/soak" 2>&1 | tee "$OUT/soak.log" | tail -3 ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
