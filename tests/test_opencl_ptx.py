"""The gpu kernel family's NVIDIA path (warp shuffles and dp4a as inline PTX, -DNV_ASM), which no
device here compiles: every program scripts/gpu_family_workload.py makes the backend build (each
weight type and layout, each KV dtype, the row kernels, MoE; two tunings) is compiled with its
build options plus -DNV_ASM by clang to PTX and assembled by NVIDIA's ptxas for sm_80 (A100) and
sm_90 (H100 / H200). Any error fails. scripts/nv_ptx.py prints the registers and spills."""
import json
import subprocess

import pytest

from gpu_family_runs import TUNINGS
import nv_ptx  # noqa: I001 (importable once gpu_family_runs is)
from gpu_family_workload import WEIGHT_DTYPES


@pytest.fixture(scope="module")
def programs(gpu_family_on_pocl):
    """The gpu family's (sources, options) as the backend requested them on pocl, per tuning."""
    found = []
    for name in TUNINGS:
        requested = json.loads((gpu_family_on_pocl(name) / "programs.json").read_text())
        for p in nv_ptx.gpu_family_programs(requested):
            if p not in found:
                found.append(p)
    return found


def test_every_program_is_valid_ptx_for_sm80_and_sm90(programs):
    kinds = {nv_ptx.program_label(s, o).split()[0] for s, o in programs}
    assert kinds == {"gpu_linear", "gpu_rows", "gpu_attention", "elementwise"}, kinds
    for tuning in ("-DLANES=32", "-DLANES=16"):
        of_tuning = [o for _, o in programs if tuning in o]
        assert {d for o in of_tuning for d in o.split() if d.startswith("-DW_") and "QALIGN" not in d and d != "-DW_FLAT"} \
            == {"-DW_" + t.upper() for t in WEIGHT_DTYPES}
        assert {d for o in of_tuning for d in o.split() if d.startswith("-DKV_")} == {"-DKV_F32", "-DKV_F16", "-DKV_I8"}
    failures = []
    for sources, options in programs:
        try:
            built = nv_ptx.build(sources, options)
        except subprocess.CalledProcessError as e:
            failures.append(f"{nv_ptx.program_label(sources, options)} [{options}]: {e.stderr[-1500:]}")
            continue
        for arch, kernels in built.items():
            assert kernels, f"{arch}: no kernel in {nv_ptx.program_label(sources, options)}"
    assert not failures, "\n".join(failures)
