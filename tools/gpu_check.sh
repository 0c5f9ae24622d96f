#!/bin/bash
# The whole product on one GPU machine: build, every GPU test, the demo, the
# convergence example, kernel and end-to-end benchmarks. Pick stages with
#   STAGES="build test sanitize fuzz soak demo converge kernels decode generate e2e profile" bash tools/gpu_check.sh
# (a warm machine keeps the build); STAGES="build multigpu" on a machine with
# 2+ GPUs. Logs and CSV/PNG go to $OUT (or out/).
# Needs .data/tinyshakespeare.txt and the .whl wheels (datasets) carried along.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=${HF_FLASH_CUDA_ARCHS:-90a}  # sm_80 is compile-checked off-device
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test demo converge kernels e2e"}
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  start=$SECONDS
  python3 -m hf_flash build > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s"; grep "^slowest" "$OUT/build.log"
fi
python3 -m hf_flash env | tee "$OUT/env.txt"
if has test; then  # the fuzzer's 2000 GPU cases are the fuzz stage's; 300 here keep the stage within its 400 s
  HF_FLASH_FUZZ_GPU_EXAMPLES=${HF_FLASH_FUZZ_GPU_EXAMPLES:-300} \
    timeout 400 python3 -m pytest tests -m gpu -q -p no:cacheprovider --tb=short --maxfail=20 2>&1 \
    | tee "$OUT/test.log" | tail -25
fi
if has sanitize; then  # every kernel family's edge cases + fixed fuzz seeds under memcheck, racecheck, initcheck
  for tool in memcheck racecheck initcheck; do OUT="$OUT" CASES=${FUZZ_SANITIZE_CASES:-12} bash tools/fuzz_gpu.sh $tool; done
fi
if has fuzz; then  # the property-based fuzzer on the kernels (>= 2000 cases + 200 bad inputs)
  OUT="$OUT" bash tools/fuzz_gpu.sh fuzz
fi
if has soak; then  # 8 minutes of training and generation in one process, memory_allocated() traced
  OUT="$OUT" bash tools/fuzz_gpu.sh soak
fi
if has demo; then
  timeout 120 python3 -m hf_flash demo 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tee "$OUT/demo.log" | tail -12
fi
if has converge; then
  timeout 300 python3 examples/convergence.py --text-file .data/tinyshakespeare.txt --max-steps 300 \
    --out "$OUT/convergence" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -6
fi
if has kernels; then
  timeout 420 python3 -m hf_flash.bench kernels --mode ${KERNEL_MODES:-fwd,bwd} ${BENCH_ARGS:-} --out "$OUT/bench" 2>&1 \
    | tr '\r' '\n' | grep -v "kernels:" | tee "$OUT/kernels.log" | tail -55
fi
if has e2e; then
  timeout 500 python3 -m hf_flash.bench e2e --out "$OUT/bench" 2>&1 | tr '\r' '\n' | grep -v "e2e:" \
    | tee "$OUT/e2e.log" | tail -20
fi
if has decode; then
  timeout 300 python3 -m hf_flash.bench decode --out "$OUT/bench" 2>&1 | tr '\r' '\n' | grep -v "decode:" \
    | tee "$OUT/decode.log" | tail -20
fi
if has generate; then
  timeout 500 python3 -m hf_flash.bench generate --out "$OUT/bench" 2>&1 | tr '\r' '\n' | grep -v "generate:" \
    | tee "$OUT/generate.log" | tail -20
fi
if has profile; then  # top CUDA kernels of a training step and of a long-prompt generate, hf_flash next to sdpa
  timeout 300 python3 tools/step_profile.py > "$OUT/e2e_profile.txt" 2>&1; grep "^== " "$OUT/e2e_profile.txt"
  timeout 300 python3 tools/step_profile.py --generate 1x16384 > "$OUT/generate_profile.txt" 2>&1
  grep "^== " "$OUT/generate_profile.txt"
fi
if has multigpu; then  # one GPU vs data parallel on two at the same global batch (NCCL NVLink multicast stays off)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  mg="$OUT/multigpu" logs=/tmp/multigpu; mkdir -p "$mg" $logs  # $OUT keeps the comparison (CSV, PNG, verdict)
  ft=(examples/finetune_trainer.py --text-file .data/tinyshakespeare.txt --max-steps ${MG_STEPS:-200}
      --max-length 512 --logging-steps 1 --weights float32)  # fp32 master weights under bf16 autocast
  launch=(python3 -m accelerate.commands.launch --num_machines 1 --mixed_precision bf16 --dynamo_backend no)
  fsdp=(--use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP
        --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer)
  quiet() { tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tee "$1" | grep "attn=\|Error" | tail -3; }
  # one GPU visible: with several, a plain Trainer process would use DataParallel over all of them
  CUDA_VISIBLE_DEVICES=0 timeout 200 "${launch[@]}" --num_processes 1 "${ft[@]}" --batch-size 16 --loss-log "$logs/1gpu.json" --output-dir /tmp/ft1 2>&1 | quiet "$logs/1gpu.log"
  timeout 200 "${launch[@]}" --num_processes 2 --multi_gpu "${ft[@]}" --batch-size 8 --loss-log "$logs/ddp.json" --output-dir /tmp/ft2 2>&1 \
    | quiet "$logs/ddp.log"
  timeout 200 "${launch[@]}" --num_processes 2 "${fsdp[@]}" "${ft[@]}" --batch-size 8 --loss-log "$logs/fsdp.json" --output-dir /tmp/ft3 \
    2>&1 | quiet "$logs/fsdp.log"
  # sdpa on one GPU shows how far rounding alone moves a curve
  CUDA_VISIBLE_DEVICES=0 timeout 200 "${launch[@]}" --num_processes 1 "${ft[@]}" --attn sdpa --batch-size 16 --loss-log "$logs/1gpu_sdpa.json" \
    --output-dir /tmp/ft4 2>&1 | quiet "$logs/1gpu_sdpa.log"
  curves=("1-gpu=$logs/1gpu.json" "1-gpu-sdpa=$logs/1gpu_sdpa.json" "2-gpu-ddp=$logs/ddp.json")
  [ -s "$logs/fsdp.json" ] && curves+=("2-gpu-fsdp=$logs/fsdp.json")
  python3 examples/convergence.py --compare "${curves[@]}" --out "$mg" 2>&1 | tee "$mg/compare.log"
fi
