#!/bin/bash
# Same-process A/B of kernel builds on the device: builds this checkout ("new") and each git worktree named in
# VARIANTS (.wt/<name>, e.g. `git worktree add .wt/base main`; carry them), runs the bwd tests on "new", then
# ROUNDS (3) alternating rounds of tools/kernel_ab.py per build (cuDNN timed in every process) and prints the
# median of each: ms, new / variant, cuDNN / new, the widest round-to-round spread ((max - min) / median) of the
# row; AB_DET=1 adds each build's deterministic backward (speed / its default: "<build> det"). "÷cuDNN": the median
# over rounds of new / variant with each process's time divided by its own cuDNN time (clock drift between
# processes, up to 20% on some cards at 16k, cancels). AB_CASES="d64,llama" runs the cases named so.
# Each pass also writes $OUT/rows_<pass>.csv in benchmarks/results.csv's columns (bench "kernel_ab <pass>": per
# case and build the median ms of hf_flash, of its deterministic mode, and of cuDNN in that build's processes),
# commit = the build's label from AB_LABELS ("new=7f76717+wip base=e86f799"; the device copy has no git), else
# its name; append them to results.csv. The table and the rows come from tools/kernel_ab_summary.py, which also
# records an ab_<pass>.csv brought back from the device (its docstring).
#   VARIANTS="base" bash tools/kernel_ab.sh
# PASS=fwd times the forward instead (and runs the forward kernel tests), PASS="bwd fwd" both from the same builds
# (ab_bwd.csv, ab_fwd.csv); HF_FLASH_DISABLE_SM90=1 times the mma.sync kernels; AB_SUSTAIN=1.6 times each call for
# 1.6 s at the clock the power limit leaves (tools/kernel_ab.py), as a training run sees it (~2 s a case and backend
# a round: name the cases with AB_CASES).
# AB_TESTS="tests/test_kernels_rel_bias.py" adds test files to the new build's tests.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=90a
cd "$(dirname "$0")/.." && ROOT=$PWD
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"  # absolute: the variants run from their worktrees
VARIANTS=${VARIANTS:-base}
PASS=${PASS:-bwd}
TESTS=""
for pass in $PASS; do
  TESTS+=$([ "$pass" = fwd ] && echo " tests/test_kernels_fwd.py tests/test_kernels_fwd_sm90.py" || echo " tests/test_kernels_bwd.py")
done
TESTS+=" ${AB_TESTS:-}"
start=$(date +%s); stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
# A device call brings back 8 files: on exit the build logs, exit codes and stderr go into one archive
# (logs.tgz), leaving it beside tests.log, ab_<pass>.csv and rows_<pass>.csv.
pack() {
  local logs; logs=$(cd "$OUT" && ls -d build_*.log ./*.rc ab.err new 2>/dev/null)
  [ -z "$logs" ] || (cd "$OUT" && tar czf logs.tgz --remove-files $logs)
}
trap pack EXIT
# This checkout builds through tools/gpu_check.sh; the variants are other checkouts, possibly older than it, so
# they build with setup.py and get hf_flash/patches linked here (this package finds patches/ beside itself:
# hf_flash/__init__.py; older ones needed the link).
(STAGES=build OUT="$OUT/new" bash tools/gpu_check.sh > "$OUT/build_new.log" 2>&1; echo "new rc=$?" > "$OUT/new.rc") &
# variants may be older checkouts: those with a setup.py build with it
build() { if [ -f setup.py ]; then python3 setup.py build_ext --inplace; else python3 -m hf_flash build; fi; }
for v in $VARIANTS; do
  ln -sfn ../patches ".wt/$v/hf_flash/patches"
  (cd ".wt/$v" && MAX_JOBS=6 build > "$OUT/build_$v.log" 2>&1; echo "$v rc=$?" > "$OUT/$v.rc") &
done
wait; stamp "built: $(cat "$OUT"/*.rc | tr '\n' ' ')"
# A build that failed is not timed (its processes would run the reference path) nor tested (its GPU tests skip).
if grep -qv "rc=0" "$OUT"/*.rc; then tail -n 25 "$OUT"/build_*.log; exit 1; fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1 when the GPU suite runs elsewhere in the same session
  PYTHONPATH=$ROOT timeout 240 python3 -m pytest -q -x -p no:cacheprovider --tb=short -m gpu $TESTS \
    > "$OUT/tests.log" 2>&1; rc=$?; stamp "tests rc=$rc: $(tail -1 "$OUT/tests.log")"
  [ $rc -eq 0 ] || exit $rc  # a build that fails its tests is not timed
fi
for pass in $PASS; do
  for round in $(seq "${ROUNDS:-3}"); do
    PYTHONPATH=$ROOT AB_DET=${AB_DET:-0} timeout 300 python3 tools/kernel_ab.py new $pass >> "$OUT/ab_$pass.csv" 2>>"$OUT/ab.err"
    for v in $VARIANTS; do
      (cd ".wt/$v" && PYTHONPATH=$PWD AB_DET=${AB_DET:-0} timeout 300 python3 "$ROOT/tools/kernel_ab.py" "$v" $pass >> "$OUT/ab_$pass.csv" \
        2>>"$OUT/ab.err")
    done
  done
  stamp "a/b $pass done"
  echo "== $pass"
  PYTHONPATH=$ROOT AB_PASS=$pass AB_ROWS="$OUT/rows_$pass.csv" python3 tools/kernel_ab_summary.py "$OUT/ab_$pass.csv" $VARIANTS
done
