"""The OpenCL gpu kernel family under Oclgrind (Debian's OpenCL device simulator) with its data-race
and memory-bounds checks: scripts/gpu_family_workload.py runs every kernel (each weight type's
matmuls and embedding rows; a dense and a MoE model's norms, attention under each KV dtype,
prompts, batched and single decodes) with the default sizes Oclgrind gets (a GPU's: 32 lanes,
4 lane groups per work-group) and with other sizes (16 lanes, 8 groups, small GEMM tiles, the
split decode attention over several splits). Any finding fails; the results equal pocl's for the
same kernels and sizes, and the models' greedy tokens equal the CPU backend's.

pocl runs a work-group's work-items one after another between barriers, so it cannot show a
missing barrier or a race on local memory; Oclgrind runs them as a GPU may and reports both.
Oclgrind's uninitialized-value check aborts on LLVM's `freeze` instruction in this toolchain
(kernels/README.md, "Checking the gpu family without a GPU"), so it is not used."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "scripts" / "gpu_family_workload.py"
OCLGRIND_ICD = Path("/usr/lib/oclgrind/liboclgrind-rt-icd.so")
TUNINGS = {
    "default": "",
    "small": "LANES=16,GEMV_GROUPS=8,GEMV_ROWS=4,GEMV_TOKENS=4,GEMM_TM=32,GEMM_TN=32,GEMM_WM=2,GEMM_WN=4,"
             "ATTN_WG=32,MAX_GROUP=4,ATTN_SPLIT=8,ATTN_SPLIT_TOKENS=4,ROW_WG=64",
}
# What Oclgrind's compiler prints that is not a finding.
BENIGN = re.compile(r"^\d+ warnings? generated\.$")
# The same kernels compiled by two LLVMs may contract multiply-adds differently: f32 results then
# differ in their last bits. A KV cache of f16 / int8 rounds each stored element, so such a bit can
# move one element by an f16 ulp or one int8 step: test_opencl_parity.py's KV bounds.
NMSE_BOUND = {"f32": 1e-10, "f16": 1e-8, "int8": 1e-6}


def bound(name: str) -> float:
    """model/<file>/<kv dtype>/step<i> by its KV dtype; matmuls and embedding rows as f32."""
    parts = name.split("/")
    return NMSE_BOUND[parts[2]] if parts[0] == "model" else NMSE_BOUND["f32"]


def run_workload(out: Path, models: Path, tuning: str, simulator: bool) -> str:
    """Runs the workload in a fresh process on pocl or Oclgrind; returns what it wrote to stderr."""
    env = dict(os.environ, FERRUM_OPENCL_GPU_TUNING=tuning)
    if not tuning:
        env.pop("FERRUM_OPENCL_GPU_TUNING")
    if simulator:
        vendors = out / "icd"
        vendors.mkdir(parents=True)
        (vendors / "oclgrind.icd").write_text(f"{OCLGRIND_ICD}\n")
        env.update(OCL_ICD_VENDORS=str(vendors), OCLGRIND_DATA_RACES="1", OCLGRIND_CHECK_API="1")
    code = ("import sys; sys.path.insert(0, sys.argv[3]); import gpu_family_workload as w; from pathlib import Path; "
            "w.run(Path(sys.argv[1]), sorted(Path(sys.argv[2]).glob('*.gguf')))")
    r = subprocess.run([sys.executable, "-c", code, str(out), str(models), str(WORKLOAD.parent)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    sys.path.insert(0, str(WORKLOAD.parent))
    import gpu_family_workload
    return gpu_family_workload.model_files(tmp_path_factory.mktemp("gpu_family_models"))


@pytest.fixture(scope="module", params=list(TUNINGS))
def runs(request, models, tmp_path_factory):
    """(Oclgrind's stderr, its outputs, pocl's outputs) for one tuning."""
    tuning = TUNINGS[request.param]
    base = tmp_path_factory.mktemp(f"oclgrind_{request.param}")
    stderr = run_workload(base / "oclgrind", models[0].parent, tuning, simulator=True)
    run_workload(base / "pocl", models[0].parent, tuning, simulator=False)
    return stderr, np.load(base / "oclgrind" / "outputs.npz"), np.load(base / "pocl" / "outputs.npz"), base


def test_no_race_and_no_access_out_of_bounds(runs):
    stderr = runs[0]
    findings = [line for line in stderr.splitlines() if line.strip() and not BENIGN.match(line.strip())]
    assert not findings, "Oclgrind reports:\n" + "\n".join(findings[:60])


def test_results_equal_pocls(runs):
    _, simulated, pocl, _ = runs
    import gpu_family_workload as w
    expected = len(w.WEIGHT_DTYPES) * 2 * 4 + len(w.MODELS) * len(w.KV_DTYPES) * 3
    assert sorted(simulated.files) == sorted(pocl.files) and len(simulated.files) == expected
    for name in simulated.files:
        a, b = simulated[name], pocl[name]
        assert a.shape == b.shape and np.isfinite(a).all(), name
        err = float(np.sum((a.astype(np.float64) - b) ** 2) / max(np.sum(b.astype(np.float64) ** 2), 1e-30))
        assert err < bound(name), (name, err)


def test_models_greedy_tokens_equal_the_cpu_backends(runs, models):
    import gpu_family_workload as w
    simulated = runs[1]
    for path in models:
        for kv in w.KV_DTYPES:
            cpu = w.model_steps(path, "cpu", kv)
            for i, c in enumerate(cpu):
                g = simulated[f"model/{path.stem}/{kv}/step{i}"]
                assert np.array_equal(np.argmax(g, axis=-1), np.argmax(c, axis=-1)), (path.stem, kv, i)
