"""The Q8_K quantizer (activations of the k-quant dot kernels and GEMM; AVX-512 where the CPU has
it) writes llama.cpp's bytes: max = the first element of largest magnitude, iscale = -127 / max,
q = min(127, round half to even(iscale * x)) in float32, bsums, d = 1 / iscale; zero blocks all
zero."""
import numpy as np
import pytest

from ferrum import _core


def q8_k_reference(x):
    out = []
    for b in x.astype(np.float32).reshape(-1, 256):
        mx = b[np.argmax(np.abs(b))]  # argmax: the first on ties
        if mx == 0:
            out.append(np.zeros(292, np.uint8))
            continue
        iscale = np.float32(-127.0) / mx
        q = np.minimum(127, np.rint(iscale * b)).astype(np.int8)
        bsums = q.astype(np.int16).reshape(16, 16).sum(axis=1, dtype=np.int16)
        d = np.float32(1.0) / iscale
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]))
    return np.concatenate(out)


@pytest.mark.parametrize("n", [256, 512, 2048, 5632])
def test_q8_k_quantize_matches_reference_bytes(rng, n):
    x = rng.standard_normal(n).astype(np.float32) * np.float32(rng.choice([1e-3, 1.0, 300.0]))
    np.testing.assert_array_equal(_core.quant.quantize("q8_k", x), q8_k_reference(x))


def test_q8_k_quantize_ties_signs_and_zeros():
    ties = np.pad(np.concatenate([[-127.0], np.arange(-63.5, 64.0, 1.0)]), (0, 127))  # iscale 1: exact .5 ties
    both_signs = np.concatenate([[3.0, -3.0], np.linspace(-2, 2, 254)])  # +3 comes first: it sets the sign
    x = np.concatenate([ties, both_signs, np.zeros(256), np.linspace(-1, 1, 256) * 1e-30]).astype(np.float32)
    got = _core.quant.quantize("q8_k", x)
    np.testing.assert_array_equal(got, q8_k_reference(x))
    q = got[:292][4:260].view(np.int8)
    assert q[1] == -64 and q[2] == -62  # -63.5 -> -64, -62.5 -> -62: to even
    assert got[292:][4:260].view(np.int8)[0] == -127
