#!/usr/bin/env bash
# Builds this tree's extension into build/dev and runs pytest against this tree's Python sources.
# For git worktrees that share another checkout's venv (whose editable install points at that
# checkout): FERRUM_VENV=/path/to/.venv scripts/dev_test.sh tests/test_ops.py -q
# `python -S` keeps the venv's editable-install hook from shadowing this tree; the venv's
# site-packages is put on PYTHONPATH after our sources instead.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FERRUM_VENV:-$root/.venv}
py=$venv/bin/python
cd "$root"
cmake -S . -B build/dev -DCMAKE_BUILD_TYPE=Release -DFERRUM_PYTHON=ON -DFERRUM_TESTS=${FERRUM_CPP_TESTS:-OFF} \
  -DPython_EXECUTABLE=$py -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" > /dev/null
cmake --build build/dev -j ${JOBS:-2}
cp build/dev/_core*.so python/ferrum/   # ignored by git (*.so)
site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
PATH=$venv/bin:$PATH PYTHONPATH=$root/python:$site exec $py -S -m pytest -p no:cacheprovider "$@"
