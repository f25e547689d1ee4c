#!/usr/bin/env bash
# Every GPU measurement of the OpenCL backend and its correctness tests, in one run of at most
# GPU_MEASURE_SECONDS (default 480) on a lent GPU machine (../shared/device/README.md; prepare
# .gpu/ here first):
#
#   bash .gpu/run.sh bash scripts/gpu_measure.sh
#
# run.sh builds ferrum against the NVIDIA driver (~20-40 s), then this runs, each phase under its
# own time limit and within what is left of the budget (a phase that cannot start is skipped),
# writing to $OUT (default /tmp/out):
#   device.txt            the device's OpenCL facts (extensions: command buffers, subgroups, ...)
#   tests.txt             the OpenCL tests, both kernel families (~2 min on 16 cores)
#   kernels.txt / .json   bench/opencl_bench.py per family: GEMV GB/s per weight type, batched
#                         decodes, GEMM GFLOP/s, decode attention, launch overhead (~1.5 min)
#   sweep.txt             GEMV GB/s of the gpu family under other sizes (FERRUM_OPENCL_GPU_TUNING)
#   models.txt / .json    TinyLlama-1.1B-shape Q8_0 / Q4_K_M / F16 and SmolLM2-135M-shape Q4_1
#                         (generated, random weights): pp128 / tg64 tok/s, launches per layer, host
#                         time per decode step, per family (~2.5 min)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
budget=${GPU_MEASURE_SECONDS:-480}
stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
# The smaller of $1 seconds and what is left of the budget; 0 when under 20 s are left.
limit() {
  local left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
# run SECONDS COMMAND...: the command under its limit, or a note that the budget is spent.
run() {
  local s; s=$(limit "$1"); shift
  if [ "$s" -eq 0 ]; then echo "skipped (budget spent): $*"; return 124; fi
  timeout "$s" "$@"
}

# The device's roofs for "% of peak": memory bandwidth (GB/s) and f32 non-tensor GFLOP/s.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in
  *H200*) peak="--peak-gbs 4800 --peak-gflops 66900" ;;
  *H100*PCIe*) peak="--peak-gbs 2000 --peak-gflops 51200" ;;
  *H100*) peak="--peak-gbs 3350 --peak-gflops 66900" ;;
  *) peak="" ;;
esac
stamp "device: ${gpu:-unknown}; roofs: ${peak:-none}"
{ python3 -c "from ferrum import _core; print(_core.opencl.device_info(_core.make_backend('opencl')))"
  clinfo=$(command -v clinfo || echo /tmp/sys/usr/bin/clinfo)
  "$clinfo" 2>/dev/null | grep -iE "device name|extensions|sub-?group|local memory size|command buffer" ; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

stamp "tests: both kernel families"
run 200 python3 -m pytest -q -p no:cacheprovider -n "$(nproc)" --timeout 150 tests/test_opencl_gpu_family.py \
  tests/test_opencl_parity.py tests/test_opencl_backend.py tests/test_opencl_models.py > "$OUT/tests.txt" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -25

stamp "kernels: both families"
run 110 python3 bench/opencl_bench.py --kernels gpu,cpu --no-model $peak --json-out "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
cat "$OUT/kernels.txt"

stamp "gpu family: other sizes (one weight type per layout kind)"
for sizes in "LANES=32,GEMV_ROWS=1" "LANES=32,GEMV_ROWS=4" "LANES=32,GEMV_GROUPS=8" "LANES=16,GEMV_ROWS=2" \
             "LANES=16,GEMV_ROWS=4" "NV_ASM=0"; do
  echo "--- FERRUM_OPENCL_GPU_TUNING=$sizes"
  FERRUM_OPENCL_GPU_TUNING=$sizes run 25 python3 bench/opencl_bench.py --kernels gpu --no-model --only gemv \
    --types q4_0,q8_0,q4_k,q6_k,f16 $peak 2>&1 | grep -E "GB/s|sizes|skipped"
done > "$OUT/sweep.txt" 2>&1
cat "$OUT/sweep.txt"

stamp "models: generate"
M=/tmp/ferrum_models
mkdir -p "$M"
tok=../shared/models/tokenizers
make_model() {  # name preset dtype tokenizer
  [ -f "$M/$1.gguf" ] || run 90 python3 -m ferrum.tools.make_model --arch llama --preset "$2" --format gguf \
    --dtype "$3" --tokenizer "$tok/$4" --out "$M/$1.gguf" > /dev/null
}
make_model tinyllama-q8_0 tinyllama-1.1b q8_0 llama2 &
make_model tinyllama-q4_k_m tinyllama-1.1b q4_k_m llama2 &
make_model tinyllama-f16 tinyllama-1.1b f16 llama2 &
make_model smollm2-q4_1 smollm2-135m q4_1 smollm2-135m-instruct &
wait
ls -la "$M"

stamp "models: both families"
models=""
for m in tinyllama-q8_0 tinyllama-q4_k_m tinyllama-f16 smollm2-q4_1; do
  [ -f "$M/$m.gguf" ] && models="$models --model $M/$m.gguf"
done
run 180 python3 bench/opencl_bench.py --kernels gpu,cpu --no-kernels --no-cpu-baseline $models --json-out "$OUT/models.json" \
  > "$OUT/models.txt" 2>&1
cat "$OUT/models.txt"
stamp done
