"""The OpenCL gpu kernel family's NVIDIA path, built offline: a program's sources (kernels/*.cl,
concatenated as the backend does) with its build options plus -DNV_ASM go through clang-14 to
PTX (NVIDIA's OpenCL target, OpenCL builtins from libclc), and NVIDIA's ptxas (PyPI's
nvidia-cuda-nvcc-cu12) assembles the PTX for an architecture, reporting each kernel's registers,
stack frame and spills. pocl never compiles this path; tests/test_opencl_ptx.py runs it on every
program the backend builds.

usage: python scripts/nv_ptx.py [--arch sm_80 ...]   prints the registers / spills table of the
       programs scripts/gpu_family_workload.py builds on this machine's OpenCL device
       (docs/performance.md).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
LIBCLC = Path("/usr/lib/clc/nvptx64--nvidiacl.bc")
ARCHS = ("sm_80", "sm_90")


def clang() -> str:
    path = shutil.which("clang-14")
    if path is None:
        raise FileNotFoundError("clang-14 is not installed (Debian: apt-get install clang-14 libclc-14)")
    return path


def ptxas() -> str:
    import nvidia.cuda_nvcc  # the nvidia-cuda-nvcc-cu12 wheel: its ptxas binary
    path = Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin" / "ptxas"
    if not path.is_file():
        raise FileNotFoundError(f"no ptxas at {path}")
    return str(path)


@dataclass
class KernelStats:
    kernel: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def program_source(sources: list[str]) -> str:
    return "".join((KERNELS / f"{name}.cl").read_text() + "\n" for name in sources)


# clang-14 writes PTX 7.0 for sm_80; ptxas assembles that PTX for sm_80 and any later GPU.
PTX_TARGET = "sm_80"


def to_ptx(sources: list[str], options: str, workdir: Path) -> Path:
    """clang's PTX for one program. CalledProcessError (with clang's messages) on any error."""
    src = workdir / "program.cl"
    src.write_text(program_source(sources))
    ptx = workdir / "program.ptx"
    # clang spells inline asm `__asm__` in OpenCL C; NVIDIA's compiler takes `asm` as the kernels write it.
    cmd = [clang(), "-x", "cl", "-cl-std=CL1.2", "-target", "nvptx64-nvidia-nvcl", "-O2",
           "-Xclang", "-target-cpu", "-Xclang", PTX_TARGET, "-Xclang", "-target-feature", "-Xclang", "+ptx70",
           "-Xclang", "-finclude-default-header", "-Xclang", "-cl-ext=+all",
           "-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(LIBCLC),
           "-Dasm=__asm__", "-DNV_ASM", *options.split(), "-S", "-o", str(ptx), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ptx


def assemble(ptx: Path, arch: str) -> list[KernelStats]:
    """ptxas -v over the PTX: per kernel its registers, stack frame and spills. CalledProcessError
    (with ptxas's messages) on any error."""
    out = subprocess.run([ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                         check=True, capture_output=True, text=True)
    stats, kernel, frame = [], None, (0, 0, 0)
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            frame = tuple(int(g) for g in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel is not None:
            stats.append(KernelStats(kernel, int(m.group(1)), *frame))
            kernel, frame = None, (0, 0, 0)
    return stats


def build(sources: list[str], options: str, archs=ARCHS) -> dict[str, list[KernelStats]]:
    """Per architecture, the kernels of one program as ptxas assembled them."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = to_ptx(sources, options, Path(tmp))
        return {arch: assemble(ptx, arch) for arch in archs}


def gpu_family_programs(requested) -> list[tuple[list[str], str]]:
    """The programs of the gpu family among `_core.opencl.programs_requested()`: its own (they
    include gpu_common) and the shared elementwise one."""
    return [(list(s), o) for s, o in requested if "gpu_common" in s or list(s) == ["common", "elementwise"]]


def program_label(sources: list[str], options: str) -> str:
    kind = sources[-1] if sources[-1] != "embedding" else "gpu_linear"
    defines = [d[2:] for d in options.split() if d.startswith(("-DW_", "-DKV_"))]
    return kind + (" " + " ".join(defines) if defines else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=list(ARCHS))
    a = p.parse_args()
    import json

    import gpu_family_workload
    with tempfile.TemporaryDirectory() as tmp:
        gpu_family_workload.run(Path(tmp), gpu_family_workload.model_files(Path(tmp) / "models"))
        requested = json.loads((Path(tmp) / "programs.json").read_text())
    print("| program | kernel | " + " | ".join(f"{arch} registers / stack / spills (B)" for arch in a.arch) + " |")
    print("|---|---|" + "---|" * len(a.arch))
    for sources, options in gpu_family_programs(requested):
        built = build(sources, options, a.arch)
        per_arch = [{s.kernel: s for s in built[arch]} for arch in a.arch]
        for kernel in per_arch[0]:
            cells = [f"{d[kernel].registers} / {d[kernel].stack_bytes} / {d[kernel].spill_stores + d[kernel].spill_loads}"
                     for d in per_arch]
            print(f"| {program_label(sources, options)} | {kernel} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
