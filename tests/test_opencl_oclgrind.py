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
import re

import numpy as np
import pytest

from gpu_family_runs import TUNINGS, run_workload
import gpu_family_workload as w  # noqa: I001 (importable once gpu_family_runs is)

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


@pytest.fixture(scope="module", params=list(TUNINGS))
def runs(request, gpu_family_models, gpu_family_on_pocl, tmp_path_factory):
    """(Oclgrind's stderr, its outputs, pocl's outputs) for one tuning."""
    out = tmp_path_factory.mktemp(f"oclgrind_{request.param}")
    stderr = run_workload(out, gpu_family_models[0].parent, TUNINGS[request.param], simulator=True)
    return stderr, np.load(out / "outputs.npz"), np.load(gpu_family_on_pocl(request.param) / "outputs.npz")


def test_no_race_and_no_access_out_of_bounds(runs):
    stderr = runs[0]
    findings = [line for line in stderr.splitlines() if line.strip() and not BENIGN.match(line.strip())]
    assert not findings, "Oclgrind reports:\n" + "\n".join(findings[:60])


def test_results_equal_pocls(runs):
    _, simulated, pocl = runs
    expected = len(w.WEIGHT_DTYPES) * 2 * 4 + 2 * 3 + len(w.MODELS) * len(w.KV_DTYPES) * 3  # 3 ops at 2 row counts
    assert sorted(simulated.files) == sorted(pocl.files) and len(simulated.files) == expected
    for name in simulated.files:
        a, b = simulated[name], pocl[name]
        assert a.shape == b.shape and np.isfinite(a).all(), name
        err = float(np.sum((a.astype(np.float64) - b) ** 2) / max(np.sum(b.astype(np.float64) ** 2), 1e-30))
        assert err < bound(name), (name, err)


def test_models_greedy_tokens_equal_the_cpu_backends(runs, gpu_family_models):
    simulated = runs[1]
    for path in gpu_family_models:
        for kv in w.KV_DTYPES:
            cpu = w.model_steps(path, "cpu", kv)
            for i, c in enumerate(cpu):
                g = simulated[f"model/{path.stem}/{kv}/step{i}"]
                assert np.array_equal(np.argmax(g, axis=-1), np.argmax(c, axis=-1)), (path.stem, kv, i)
