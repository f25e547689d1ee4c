"""IQ4_NL and IQ4_XS (the i-quants' non-linear 4-bit formats): the C++ reading of the blocks
equals gguf-py's (an independent reading of ggml's layout) bit for bit, on our writer's blocks
and on random bytes, and every ISA's dot kernel equals the dequantized weights times the
activations it sees (their 8-bit round trip) up to float rounding."""
import gguf
import numpy as np
import pytest

from ferrum import _core
from ferrum.tools import quantize as Q

IQ4 = {"iq4_nl": gguf.GGMLQuantizationType.IQ4_NL, "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS}
ACT_TYPE = {"iq4_nl": "q8_0", "iq4_xs": "q8_k"}


def random_blocks(rng, dtype, count):
    _, nbytes = Q.BLOCK_SIZES[dtype]
    raw = rng.integers(0, 256, (count, nbytes), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(-0.1, 0.1, (count, 1)).astype(np.float16).view(np.uint8)  # finite d
    return raw


@pytest.mark.parametrize("dtype", list(IQ4))
def test_dequantize_equals_gguf_py(dtype):
    rng = np.random.default_rng(0)
    block, _ = Q.BLOCK_SIZES[dtype]
    for raw in (Q.quantize(rng.standard_normal((8, 512), dtype=np.float32), dtype).reshape(-1, Q.BLOCK_SIZES[dtype][1]),
                random_blocks(rng, dtype, 64)):
        want = gguf.quants.dequantize(raw, IQ4[dtype]).reshape(-1)
        got = _core.quant.dequantize(dtype, raw.reshape(-1), raw.shape[0] * block)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", list(IQ4))
def test_every_isa_dot_matches_the_dequantized_reference(dtype):
    rng = np.random.default_rng(1)
    assert "scalar" in _core.quant.isas(dtype)
    for n in (256, 1024 + 256):
        rows = 5
        raw = random_blocks(rng, dtype, rows * n // Q.BLOCK_SIZES[dtype][0])
        w = gguf.quants.dequantize(raw, IQ4[dtype]).reshape(rows, n).astype(np.float64)
        act = rng.standard_normal(n).astype(np.float32)
        seen = _core.quant.dequantize(ACT_TYPE[dtype], _core.quant.quantize(ACT_TYPE[dtype], act), n)
        want = w @ seen.astype(np.float64)
        scale = np.abs(w).max() * np.abs(seen).sum()
        for isa in _core.quant.isas(dtype):
            got = _core.quant.dot(dtype, raw.reshape(-1), act, rows, n, isa)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale, err_msg=isa)
