"""Checks that a portable build (FERRUM_NATIVE=OFF) runs no AVX-512 instruction without the
run-time dispatch having chosen it.

usage: python scripts/check_isa.py BUILD_DIR

Every object file of the library and the extension is disassembled. Objects of files named
*_avx512* hold the AVX-512 kernels; every other object is baseline code (x86-64-v3), which runs
on any CPU ferrum supports, and must contain no AVX-512 instruction (an intrinsic from a header,
or the compiler vectorizing wider than the baseline). An AVX-512 object must not share a function
with AVX-512 code in it with baseline code either: a weak (inline or template) function is kept
once at link time, and the baseline callers could get the wide copy.
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


def is_avx512(code_bytes, mnemonic):
    for b in code_bytes:
        if b not in LEGACY_PREFIXES:
            return b == 0x62 or OPMASK.fullmatch(mnemonic) is not None
    return False


def avx512_functions(obj):
    """Names (mangled) of the functions in obj with at least one AVX-512 instruction."""
    out = subprocess.run(["objdump", "-d", "-w", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    found, current = set(), None
    for line in out.splitlines():
        m = SYMBOL.match(line)
        if m:
            current = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if m and current not in found:
            if is_avx512([int(x, 16) for x in m.group(1).split()], m.group(2)):
                found.add(current)
    return found


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
                          text=True).stdout.split("\n")


def main(build_dir):
    objects = sorted(Path(build_dir).glob("CMakeFiles/*.dir/**/*.o"))
    if not objects:
        sys.exit(f"check_isa: no object files under {build_dir}/CMakeFiles")
    wide = [o for o in objects if "_avx512" in o.name]
    baseline = [o for o in objects if o not in wide]
    errors = []
    for obj in baseline:
        found = sorted(avx512_functions(obj))
        for shown in demangle(found) if found else []:
            errors.append(f"{obj.name}: AVX-512 in baseline code: {shown}")
    baseline_names = set()
    for obj in baseline:
        baseline_names.update(symbols(obj))
    for obj in wide:
        kinds = symbols(obj)
        shared = sorted(n for n in avx512_functions(obj) if kinds.get(n) in ("W", "V") and n in baseline_names)
        for shown in demangle(shared) if shared else []:
            errors.append(f"{obj.name}: weak function with AVX-512 code also used by baseline code: {shown}")
    for e in errors:
        print(e)
    print(f"check_isa: {len(baseline)} baseline and {len(wide)} AVX-512 objects, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
