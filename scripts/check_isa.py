"""Checks that a portable build (FERRUM_NATIVE=OFF) runs no AVX-512 instruction that the run-time
dispatch did not choose.

usage: python scripts/check_isa.py BUILD_DIR

Every object file of the library and the extension is disassembled. Objects of files named
*_avx512* hold the AVX-512 kernels (compiled for x86-64-v4 + VNNI, CMakeLists.txt); every other
object is baseline code (x86-64-v3), which runs on any CPU ferrum supports. Checked:
- baseline objects contain no AVX-512 instruction (an intrinsic from a header, or the compiler
  vectorizing wider than the baseline);
- an AVX-512 object's static initializers (run when the library loads, on every CPU) contain none;
- an AVX-512 object shares no weak (inline or template) function holding AVX-512 code with baseline
  code: the linker keeps one copy, and the baseline callers could get the wide one;
- VNNI instructions come only from files that use VNNI intrinsics (the file-wide flag also covers
  kernels whose dispatch asks for AVX-512 F/BW/VL alone).
AVX-512 instructions are those with an EVEX prefix (0x62, invalid on its own in 64-bit code) and
the opmask instructions (k*).
"""
import re
import subprocess
import sys
from pathlib import Path

LEGACY_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3}
OPMASK = re.compile(r"k(mov|and|andn|or|xor|xnor|not|shift[lr]|ortest|test|add|unpck)[bwdq]")
SYMBOL = re.compile(r"^[0-9a-f]+ <(.+)>:$")
INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\t([0-9a-f ]+)\t(\S+)")
VNNI_MNEMONIC = re.compile(r"vpdp(bus|wss)ds?")
VNNI_INTRINSIC = re.compile(r"_mm(256|512)?_(mask_|maskz_)?dp(bus|wss)ds?_epi32")
STATIC_INIT = "_GLOBAL__sub_I_"
INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)
SOURCES = Path(__file__).resolve().parent.parent


def is_avx512(code_bytes, mnemonic):
    for b in code_bytes:
        if b not in LEGACY_PREFIXES:
            return b == 0x62 or OPMASK.fullmatch(mnemonic) is not None
    return False


def disassemble(obj):
    """{mangled function name: [(instruction bytes, mnemonic)]} of obj."""
    out = subprocess.run(["objdump", "-d", "-w", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    functions, current = {}, None
    for line in out.splitlines():
        m = SYMBOL.match(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            current.append(([int(x, 16) for x in m.group(1).split()], m.group(2)))
    return functions


def avx512_functions(functions):
    return {name for name, code in functions.items() if any(is_avx512(b, m) for b, m in code)}


def uses_vnni_intrinsics(obj):
    """Whether the source of obj, or a header of ours it includes, calls VNNI intrinsics."""
    source = SOURCES / str(obj).split(".dir/", 1)[1].removesuffix(".o")
    seen, todo = set(), [source]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        text = path.read_text()
        if VNNI_INTRINSIC.search(text):
            return True
        todo += [SOURCES / "cpp" / name for name in INCLUDE.findall(text)]
    return False


def symbols(obj):
    """{mangled name: nm type letter} of obj, referenced ones included."""
    out = subprocess.run(["nm", str(obj)], check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            table[parts[-1]] = parts[-2]
    return table


def demangle(names):
    return subprocess.run(["c++filt"], input="\n".join(names), check=True, capture_output=True,
                          text=True).stdout.splitlines()


def main(build_dir):
    objects = sorted(Path(build_dir).glob("CMakeFiles/*.dir/**/*.o"))
    if not objects:
        sys.exit(f"check_isa: no object files under {build_dir}/CMakeFiles")
    wide = [o for o in objects if "_avx512" in o.name]
    baseline = [o for o in objects if o not in wide]
    errors = []
    baseline_names = set()
    for obj in baseline:
        found = sorted(avx512_functions(disassemble(obj)))
        for shown in demangle(found) if found else []:
            errors.append(f"{obj.name}: AVX-512 in baseline code: {shown}")
        baseline_names.update(symbols(obj))
    for obj in wide:
        functions, kinds = disassemble(obj), symbols(obj)
        wide_code = avx512_functions(functions)
        shared = sorted(n for n in wide_code if kinds.get(n) in ("W", "V") and n in baseline_names)
        for shown in demangle(shared) if shared else []:
            errors.append(f"{obj.name}: weak function with AVX-512 code also used by baseline code: {shown}")
        for name in sorted(n for n in wide_code if n.startswith(STATIC_INIT)):
            errors.append(f"{obj.name}: AVX-512 in a static initializer: {name}")
        vnni = sorted(n for n, code in functions.items() if any(VNNI_MNEMONIC.fullmatch(m) for _, m in code))
        if vnni and not uses_vnni_intrinsics(obj):
            for shown in demangle(vnni):
                errors.append(f"{obj.name}: VNNI the source never asked for: {shown}")
    for e in errors:
        print(e)
    print(f"check_isa: {len(baseline)} baseline and {len(wide)} AVX-512 objects, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
