#!/usr/bin/env bash
# bench/perf_table.py on the native build and then on the portable one (the wheel's), on this
# machine, side by side (docs/install.md). Each build's extension is put beside this tree's
# Python sources and run without site-packages (python -S), the way perf_table.py runs a tree's
# own sources; the table's other columns (bandwidth, llama.cpp) are the same for both.
# usage: scripts/bench_wheel.sh MODEL [perf_table.py options]   (after make setup-test, make wheel)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=.venv/bin/python
site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
native=$(ls -d build/cp3*-linux_x86_64)   # scripts/setup.sh's editable build
if ls python/ferrum/_core*.so >/dev/null 2>&1; then
  echo "python/ferrum/ holds an extension already (scripts/dev_test.sh?): remove it first" >&2
  exit 1
fi
trap 'rm -f python/ferrum/_core*.so python/ferrum/_cpu_check*.so' EXIT
for build in "$native" build/wheel; do
  echo "## $build"
  cp "$build"/_core*.so "$build"/_cpu_check*.so python/ferrum/
  PYTHONPATH=$PWD/python:$site $py -S bench/perf_table.py "$@"
  rm -f python/ferrum/_core*.so python/ferrum/_cpu_check*.so
done
