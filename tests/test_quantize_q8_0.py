"""The Q8_0 quantizer (activations of every legacy-format dot kernel; AVX-512 where the CPU has
it) writes the reference bytes: numpy's llama.cpp-style d = absmax / 127, q = round half away
from zero, including exact ties, zero blocks and both signs."""
import numpy as np
import pytest

from ferrum import _core
from ferrum.tools import quantize as Q


@pytest.mark.parametrize("n", [32, 64, 544, 1024, 1280, 4096])
def test_q8_0_quantize_matches_reference_bytes(rng, n):
    x = rng.standard_normal(n).astype(np.float32) * np.float32(rng.choice([1e-3, 1.0, 300.0]))
    np.testing.assert_array_equal(_core.quant.quantize("q8_0", x), Q.quantize(x[None], "q8_0").reshape(-1))


def test_q8_0_quantize_ties_and_zeros():
    # absmax 127 in every block: d = 1 and x / d lands exactly on k + 0.5 ties of both signs
    ties = np.arange(-63.5, 64.0, 1.0, dtype=np.float32)
    blocks = [np.concatenate([[127.0], ties[i:i + 31]]) for i in range(0, len(ties), 31)]
    blocks = [np.pad(b, (0, 32 - len(b))) for b in blocks]
    blocks.append(np.zeros(32))                        # all zero: d = 0, q = 0
    blocks.append(np.linspace(-1, 1, 32) * 1e-30)      # tiny values
    blocks.append(np.linspace(-1, 1, 32) * 1e7)        # d beyond f16's range: stored as inf
    x = np.concatenate(blocks).astype(np.float32)
    got = _core.quant.quantize("q8_0", x)
    with np.errstate(over="ignore"):  # the reference's f16 cast of the 1e7 block's d
        expect = Q.quantize(x[None], "q8_0").reshape(-1)
    np.testing.assert_array_equal(got, expect)
    q = got.reshape(-1, 34)[0, 2:].view(np.int8)
    assert q[1] == -64 and q[2] == -63  # -63.5 -> -64, -62.5 -> -63: away from zero
