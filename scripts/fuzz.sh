#!/usr/bin/env bash
# Fuzzes the model-file readers (GGUF, safetensors + config.json, llama2.c: libFuzzer under ASan
# + UBSan, fuzz/*.cpp) and the GGUF tokenizer metadata (atheris, fuzz/fuzz_tokenizer_metadata.py).
# Each target first replays its kept findings (tests/fuzz_findings/<target>/), then mutates for
# SECONDS from a seed corpus made of the test models; new inputs accumulate in build/fuzz/corpus,
# crashes land in build/fuzz/findings/ (keep each one as a file in tests/fuzz_findings/<target>/).
# usage: scripts/fuzz.sh [SECONDS per target, default 10]     (CI: make test-fuzz; long: 3600)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-10}
py=.venv/bin/python
build=build/fuzz
cmake -S fuzz -B $build -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE= > /dev/null
cmake --build $build -j 2 > /dev/null
[ -d $build/seeds ] || $py fuzz/make_seeds.py $build/seeds
mkdir -p $build/findings
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run() {  # target, command...
  local target=$1; shift
  local kept=tests/fuzz_findings/$target corpus=$build/corpus/$target
  mkdir -p "$corpus"
  if compgen -G "$kept/*" > /dev/null; then "$@" "$kept"/* > $build/$target.log 2>&1 || { cat $build/$target.log; exit 1; }; fi
  "$@" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix=$build/findings/$target- "$corpus" ${seeds:+$build/seeds/$target} > $build/$target.log 2>&1 \
    || { tail -60 $build/$target.log; echo "[fuzz] $target: a finding, see $build/findings/" >&2; exit 1; }
  echo "[fuzz] $target: $(grep -o 'stat::number_of_executed_units: [0-9]*' $build/$target.log | grep -o '[0-9]*$') inputs in ${secs}s, no finding"
}
for t in gguf safetensors llama2c; do seeds=1 run $t $build/fuzz_$t; done
seeds= run tokenizer $py fuzz/fuzz_tokenizer_metadata.py
