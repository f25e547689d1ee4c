#!/usr/bin/env bash
# The suite under AddressSanitizer + UBSan: a Sanitize build of the library, its C++ tests,
# and the Python tests run against a sanitized ferrum._core (LD_PRELOAD puts the ASan runtime
# first, as Python itself is not instrumented; leak checking is off because CPython's own
# allocations at exit are reported as leaks). --capture=sys leaves fd 2 alone so a sanitizer
# report reaches the terminal instead of a capture file that dies with the process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=.venv/bin/python
build=build/asan
cmake -S . -B $build -DCMAKE_BUILD_TYPE=Sanitize -DFERRUM_TESTS=ON -DFERRUM_PYTHON=ON -DFERRUM_NATIVE=ON \
  -DPython_EXECUTABLE=$py -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" > /dev/null
cmake --build $build -j 2
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir $build --output-on-failure
# A package tree holding the sanitized extension next to the Python sources.
rm -rf $build/pkg && mkdir -p $build/pkg && cp -r python/ferrum $build/pkg/ferrum
cp $build/_core*.so $build/pkg/ferrum/
site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# The whole suite. Subprocesses some tests start (the CLI, a fresh interpreter for hub downloads,
# llama.cpp) inherit the preloaded runtime; PYTHONPATH is absolute because some (a Jupyter
# kernel) run in another directory.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  PYTHONPATH=$PWD/$build/pkg:$site $py -S -m pytest -q -p no:cacheprovider --capture=sys tests "$@"
