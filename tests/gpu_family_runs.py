"""scripts/gpu_family_workload.py run in a fresh process, on pocl or under Oclgrind, at the tunings
the offline checks use (tests/test_opencl_oclgrind.py, tests/test_opencl_ptx.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(SCRIPTS) not in sys.path:  # the workload and nv_ptx.py, for the tests that import them
    sys.path.insert(0, str(SCRIPTS))
OCLGRIND_ICD = Path("/usr/lib/oclgrind/liboclgrind-rt-icd.so")
# The sizes Oclgrind gets as a GPU (32 lanes, 4 lane groups per work-group), and other ones: 16
# lanes, 8 groups, small GEMM tiles, the split decode attention over several splits.
TUNINGS = {
    "default": "",
    "small": "LANES=16,GEMV_GROUPS=8,GEMV_ROWS=4,GEMV_TOKENS=4,GEMM_TM=32,GEMM_TN=32,GEMM_WM=2,GEMM_WN=4,"
             "ATTN_WG=32,MAX_GROUP=4,ATTN_SPLIT=8,ATTN_SPLIT_TOKENS=4,ROW_WG=64",
}


def run_workload(out: Path, models: Path, tuning: str, simulator: bool) -> str:
    """Runs the workload over the models in `models` into `out` (outputs.npz, programs.json) on
    pocl or Oclgrind (with its data-race checks); returns what the process wrote to stderr."""
    env = dict(os.environ)
    env.pop("FERRUM_OPENCL_GPU_TUNING", None)
    if tuning:
        env["FERRUM_OPENCL_GPU_TUNING"] = tuning
    if simulator:
        vendors = out / "icd"
        vendors.mkdir(parents=True)
        (vendors / "oclgrind.icd").write_text(f"{OCLGRIND_ICD}\n")
        env.update(OCL_ICD_VENDORS=str(vendors), OCLGRIND_DATA_RACES="1", OCLGRIND_CHECK_API="1")
    code = ("import sys; sys.path.insert(0, sys.argv[3]); import gpu_family_workload as w; from pathlib import Path; "
            "w.run(Path(sys.argv[1]), sorted(Path(sys.argv[2]).glob('*.gguf')))")
    r = subprocess.run([sys.executable, "-c", code, str(out), str(models), str(SCRIPTS)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr
