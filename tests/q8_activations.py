"""The 8-bit activations generation's quantized matmuls take, for references that run in torch:
llama.cpp's quantize_row_q8_0, which ferrum's quantizer (cpp/quant/quantize.cpp) follows."""
import numpy as np
import torch


def q8_0_rounded(x, order=None):
    """x rounded block by block of 32 (of the inputs in `order`, the order a weight's columns hold
    them: GPTQ act-order): d = max|x| / 127, q = x * (1 / d) rounded half away from zero, read
    back as q * f16(d)."""
    if order is not None:
        return q8_0_rounded(x[..., order])[..., np.argsort(order)]
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    v = b * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d.half().float()).reshape(x.shape)
