#!/usr/bin/env bash
# The repaired wheel in dist/ as a user gets it (docs/install.md):
# 1. installed into a fresh venv from binaries only (no compiler, no build backend);
# 2. its _core needs no library but its own, scipy-openblas32's and the C / C++ runtime (ldd); the
#    chat page's files are in it;
# 3. outside the repository, with LD_LIBRARY_PATH cleared and the system's OpenBLAS, libgfortran and
#    OpenCL loader hidden (bind-mounted away in a private mount namespace, where root may), it
#    imports, generates stories260K's reference text, and device="opencl" is a clear error;
# 4. on an emulated CPU without AVX-512 it generates what it does here capped to AVX2, and on one
#    below x86-64-v3 `import ferrum` raises an ImportError that says so;
# 5. the kernel, MoE, stories260K and SmolLM2 tests under each FERRUM_CPU_ISA cap (the fallback kernels).
# usage: scripts/check_wheel.sh      (after scripts/build_wheel.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
stories=$(cd "$root/../shared/models/stories260K" && pwd)
wheel=$(ls "$root"/dist/ferrum-*manylinux*.whl)
work=$root/build/wheel-check
venv=$work/venv

echo "[check] fresh venv, installing $(basename "$wheel") from binaries only"
rm -rf "$work" && mkdir -p "$work"
base_python=$(.venv/bin/python -c "import sys; print(sys._base_executable)")
"$base_python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --only-binary=:all: "$wheel" "pytest==9.2.0" 2>&1 | grep -v "WARNING: Location" || true
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
core=$(ls "$site"/ferrum/_core*.so)

echo "[check] ldd $(basename "$core")"
ldd "$core" | tee "$work/ldd.txt"
# Outside the venv only the C / C++ runtime that every manylinux platform has.
system_ok='^(linux-vdso\.so|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|/lib64/ld-linux-x86-64\.so|ld-linux-x86-64\.so)'
bad=$(awk -v site="$site" -v ok="$system_ok" '
  /not found/ { print; next }
  { path = ($2 == "=>") ? $3 : $1; name = $1
    if (index(path, site) == 1) next
    if (name ~ ok) next
    print }' "$work/ldd.txt")
if [ -n "$bad" ]; then
  echo "[check] FAIL: _core needs libraries from outside the wheel:" >&2
  echo "$bad" >&2
  exit 1
fi

# The chat page `ferrum serve` answers / with: its files are in the wheel, as in the repository.
echo "[check] the chat page's files"
for f in "$root"/python/ferrum/server/page/*; do
  cmp "$f" "$site/ferrum/server/page/$(basename "$f")" || { echo "[check] FAIL: $f is not in the wheel as it is here" >&2; exit 1; }
done
ls "$site/ferrum/server/page"

smoke=("$venv/bin/python" "$root/scripts/wheel_smoke.py" "$stories")
hidden=$(ls /usr/lib/x86_64-linux-gnu/{libopenblas,libblas,libgfortran,libOpenCL}*.so* 2>/dev/null | xargs -r -n1 readlink -f | sort -u)
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  echo "[check] stories260K outside the repository, with the system's libraries hidden:" $hidden
  mounts=""
  for f in $hidden; do mounts="$mounts mount --bind /dev/null $f;"; done
  (cd /tmp && unshare -m sh -c "$mounts exec env -i PATH=/usr/bin:/bin HOME=$HOME \"\$@\"" sh \
    "${smoke[@]}" --no-opencl)
else
  echo "[check] stories260K outside the repository (not root: the system's libraries stay visible)"
  (cd /tmp && env -i PATH=/usr/bin:/bin HOME="$HOME" "${smoke[@]}")
fi

# On an emulated CPU without AVX-512 (qemu-user's Haswell: x86-64-v3), the same generations as
# here under FERRUM_CPU_ISA=avx2: an AVX-512 instruction outside the dispatch's choice would stop
# it (SIGILL). The quantized model brings in the quantized kernels, quantizers and repacking.
quantized=$("$venv/bin/python" -c "from ferrum.models import default_model_path as p; print(p())")
echo "[check] on an emulated Haswell (qemu-x86_64 -cpu Haswell): stories260K and $(basename "$quantized")"
(cd /tmp && FERRUM_CPU_ISA=avx2 "${smoke[@]}" --model "$quantized" | grep "greedy ids" > "$work/host.txt")
(cd /tmp && qemu-x86_64 -cpu Haswell "${smoke[@]}" --model "$quantized" 2> >(grep -v "TCG doesn't support" >&2) \
  | tee "$work/haswell.txt")
if ! grep -q "avx2 fma f16c)" "$work/haswell.txt" || ! grep "greedy ids" "$work/haswell.txt" | cmp -s - "$work/host.txt"; then
  echo "[check] FAIL: the emulated Haswell's run differs from FERRUM_CPU_ISA=avx2 here:" >&2
  cat "$work/host.txt" >&2
  exit 1
fi

# Below the baseline (qemu-user's Nehalem: x86-64-v2), `import ferrum` must say so, not crash.
echo "[check] on an emulated Nehalem (qemu-x86_64 -cpu Nehalem): import ferrum refuses clearly"
if out=$(cd /tmp && qemu-x86_64 -cpu Nehalem "$venv/bin/python" -c "import ferrum" 2>&1); then
  echo "[check] FAIL: ferrum imported on a CPU below x86-64-v3" >&2
  exit 1
fi
if ! echo "$out" | grep -q "ImportError: this ferrum build needs an x86-64-v3 CPU"; then
  echo "[check] FAIL: not the ImportError expected:" >&2
  echo "$out" | grep -v "TCG doesn't support" | tail -n 5 >&2
  exit 1
fi
echo "$out" | grep "ImportError"

# The backend's AVX-512 copies of its loops (x86-64-v4) against their baseline copies (x86-64-v3).
echo "[check] the AVX-512 copies of the CPU backend's loops compute their baseline copies' bits"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_cpu_isa_copies.py

# The fallback kernels against the references: the kernel, quantizer, MoE and stories260K tests,
# and SmolLM2 against llama.cpp (8-bit activations: a kernel rounding in another order than the
# AVX-512 one shows as near-ties there).
for isa in avx2 scalar; do
  echo "[check] FERRUM_CPU_ISA=$isa: kernel, MoE, stories260K and SmolLM2 tests on the wheel"
  FERRUM_CPU_ISA=$isa "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_ops.py tests/test_quantize_q8_0.py tests/test_quantize_q8_k.py tests/test_moe_ops.py \
    "tests/test_models_real.py::test_stories260k_greedy_from_bos_and_logits" \
    "tests/test_models_real.py::test_stories260k_prompt_continuation" \
    "tests/test_models_real.py::test_smollm2_llama_cpp_tokens_are_ours_or_near_ties" \
    "tests/test_models_real.py::test_smollm2_greedy_agrees_with_llama_cpp" \
    "tests/test_models_real.py::test_smollm2_batched_decode_equals_each_alone"
done
echo "[check] the wheel passed"
