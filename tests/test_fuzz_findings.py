"""Every kept fuzz finding (tests/fuzz_findings/<target>/, docs/fuzzing.md) goes through ferrum
itself as the invariant says: a model file is refused with ValueError or loads with finite
outputs; tokenizer metadata gives a ValueError or a tokenizer that encodes and decodes."""
import struct
from pathlib import Path

import numpy as np
import pytest

from ferrum import _core

FINDINGS = Path(__file__).parent / "fuzz_findings"


def as_model_path(target: str, data: bytes, tmp_path: Path) -> Path:
    """The finding written the way its fuzz target writes it."""
    tmp_path.mkdir()
    if target == "safetensors":
        (n,) = struct.unpack_from("<I", data)
        d = tmp_path / "hf"
        d.mkdir()
        (d / "config.json").write_bytes(data[4:4 + n])
        (d / "model.safetensors").write_bytes(data[4 + n:])
        return d
    p = tmp_path / ("model.gguf" if target == "gguf" else "model.bin")
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("target", ["gguf", "safetensors", "llama2c"])
def test_kept_findings(target, tmp_path):
    files = sorted((FINDINGS / target).iterdir())
    assert files, f"no kept findings for {target}"
    for i, f in enumerate(files):
        path = as_model_path(target, f.read_bytes(), tmp_path / str(i))
        try:
            r = _core.ModelRunner(str(path), num_threads=1, max_model_len=16, kv_cache_tokens=16)
        except ValueError as e:
            assert str(path) in str(e), f"{f.name}: the error does not name the file: {e}"
            continue
        logits = r.step([(r.add_sequence(), [1, 2, 3], "all")])
        assert np.isfinite(logits).all(), f"{f.name} loaded with non-finite logits"


def test_kept_tokenizer_findings():
    """Replayed through the atheris target's own function (its mutations of real vocabularies)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "fuzz_tokenizer_metadata", Path(__file__).parent.parent / "fuzz" / "fuzz_tokenizer_metadata.py")
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
    files = sorted((FINDINGS / "tokenizer").iterdir())
    assert files
    for f in files:
        target.test_one_input(f.read_bytes())
