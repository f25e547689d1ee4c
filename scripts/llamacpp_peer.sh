#!/usr/bin/env bash
# llama.cpp (llama-cpp-python) for the tests and benchmarks that compare against it, installed
# where ../shared/bench/llamacpp/run.sh looks for it (FERRUM_PEER_DIR, by default
# ~/.cache/ferrum-peer/llama-cpp-python), so that run.sh uses it as it is.
#
# The build names this CPU's instruction sets one by one instead of taking run.sh's GGML_NATIVE:
# on an Intel Xeon with AMX and AVX512-FP16 the -march=native build crashes in its first decode
# (with or without llama.cpp's AMX code), where this one runs. AMX stays off.
# Nothing is done when the peer already there decodes the default model (a 4-token smoke run).
# usage: scripts/llamacpp_peer.sh   (scripts/setup.sh --test runs it)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir="${FERRUM_PEER_DIR:-$HOME/.cache/ferrum-peer/llama-cpp-python}"
peer="$dir/venv/bin/python"
bench=../shared/bench/llamacpp/bench.py
model=$(.venv/bin/python -c "from ferrum.models import default_model_path; print(default_model_path())")
smoke() { [ -x "$peer" ] && timeout 120 "$peer" "$bench" "$model" 4 4 1 >/dev/null 2>&1; }
smoke && exit 0

has() { grep -qw "$1" /proc/cpuinfo; }
on() { if has "$1"; then echo ON; else echo OFF; fi; }
flags="-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)"
flags="$flags -DGGML_BMI2=$(on bmi2)"
if has avx512f && has avx512bw && has avx512vl; then  # (/proc/cpuinfo's names)
  flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni)"
  flags="$flags -DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AVX_VNNI=OFF"
else
  flags="$flags -DGGML_AVX512=OFF -DGGML_AVX_VNNI=$(on avx_vnni)"
fi
flags="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"

echo "[setup] building llama.cpp (llama-cpp-python) for the comparison tests into $dir (several minutes)"
rm -rf "$dir"
python3 -m venv "$dir/venv"
# --no-cache-dir: a wheel cached from a build with other flags would be reused silently
CMAKE_ARGS="$flags" "$peer" -m pip install --no-cache-dir "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}" \
  >"$dir/pip-install.log" 2>&1 || { echo "[setup] installing llama-cpp-python failed; see $dir/pip-install.log" >&2; exit 1; }
echo "$flags" > "$dir/cmake-flags.txt"
smoke || { echo "[setup] the llama.cpp build in $dir fails its smoke run" >&2; exit 1; }
