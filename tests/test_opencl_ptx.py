"""The gpu kernel family's NVIDIA path (warp shuffles and dp4a as inline PTX, -DNV_ASM), which no
device here compiles: every program scripts/gpu_family_workload.py makes the backend build (each
weight type and layout, each KV dtype, the row kernels, MoE; two tunings) is compiled with its
build options plus -DNV_ASM by clang to PTX and assembled by NVIDIA's ptxas for sm_80 (A100) and
sm_90 (H100 / H200). Any error fails. scripts/nv_ptx.py prints the registers and spills."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import nv_ptx  # noqa: E402
from gpu_family_workload import WEIGHT_DTYPES  # noqa: E402

TUNINGS = ("", "LANES=16,GEMV_GROUPS=8,GEMV_ROWS=4,GEMV_TOKENS=4,GEMM_TM=32,GEMM_TN=32,GEMM_WM=2,GEMM_WN=4,"
               "ATTN_WG=32,MAX_GROUP=4,ATTN_SPLIT=8,ATTN_SPLIT_TOKENS=4,ROW_WG=64")


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The gpu family's (sources, options) as the backend requested them on pocl, per tuning."""
    found = []
    for i, tuning in enumerate(TUNINGS):
        out = tmp_path_factory.mktemp(f"programs{i}")
        env = dict(os.environ, FERRUM_OPENCL_GPU_TUNING=tuning)
        code = ("import sys; sys.path.insert(0, sys.argv[2]); import gpu_family_workload as w; from pathlib import Path; "
                "out = Path(sys.argv[1]); w.run(out, w.model_files(out / 'models'))")
        r = subprocess.run([sys.executable, "-c", code, str(out), str(ROOT / "scripts")], env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        for p in nv_ptx.gpu_family_programs(json.loads((out / "programs.json").read_text())):
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
