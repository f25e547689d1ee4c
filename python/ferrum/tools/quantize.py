"""GGUF block formats in numpy: round-to-nearest quantizers and the dequantizers that define them.

Every function works on rows: `quantize(x, qtype)` takes float32 of shape (..., n) with n a
multiple of the block size and returns uint8 of shape (..., n // block * type_size), laid out
bit for bit as ggml stores it; `dequantize(data, qtype)` inverts the layout.

Layouts (ggml's, little-endian; "d" is an f16 scale):
  Q4_0  32 el, 18 B: d, qs[16]                      x = d * (q - 8)      q in 0..15
  Q4_1  32 el, 20 B: d, m, qs[16]                   x = d * q + m        q in 0..15
  Q5_0  32 el, 22 B: d, qh[4], qs[16]               x = d * (q - 16)     q in 0..31
  Q5_1  32 el, 24 B: d, m, qh[4], qs[16]            x = d * q + m        q in 0..31
  Q8_0  32 el, 34 B: d, qs[32] (int8)               x = d * q
  Q2_K 256 el, 84 B: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
                                                    x = d*sc*q - dmin*m  q in 0..3, 16 sub-blocks of 16
  Q3_K 256 el,110 B: hmask[32], qs[64], scales[12] (16 x 6-bit, +32), d
                                                    x = d*(sc-32)*(q-4)  q in 0..7, 16 sub-blocks of 16
  Q4_K 256 el,144 B: d, dmin, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128]
                                                    x = d*sc*q - dmin*m  q in 0..15, 8 sub-blocks of 32
  Q5_K 256 el,176 B: d, dmin, scales[12], qh[32], qs[128]   as Q4_K with q in 0..31
  Q6_K 256 el,210 B: ql[128], qh[64], scales[16] (int8), d  x = d*sc*(q-32)  q in 0..63, 16 x 16
  IQ4_NL 32 el, 18 B: d, qs[16]                     x = d * V[q]         q in 0..15, V the 16
                                                    non-linear levels IQ4_VALUES
  IQ4_XS 256 el,136 B: d, scales_h (u16), scales_l[4], qs[128]
                                                    x = d*(sc-32)*V[q]   8 sub-blocks of 32, 6-bit
                                                    sc: low 4 bits in scales_l, top 2 in scales_h
Low-bit packing: legacy types put element j in the low nibble and j+16 in the high nibble of
byte j; k-quants pack 32 consecutive elements per bit-plane (see the _pack/_unpack helpers).

The k-quant quantizers use the plain reference algorithm (per sub-block min/max or absmax,
then 6- or 4-bit quantized sub-block scales, then re-rounding with the stored scales), not
llama.cpp's iterative scale search: the files are valid and decode the same everywhere, they
are only slightly less accurate than llama-quantize's. The IQ4 quantizers map each block's
(sub-block's) largest magnitude to the level -127 and pick the nearest levels (llama.cpp also
searches the scale).
"""
from __future__ import annotations

import numpy as np

# name -> (elements per block, bytes per block)
BLOCK_SIZES = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176),
    "q6_k": (256, 210), "iq4_nl": (32, 18), "iq4_xs": (256, 136),
}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)
QUANT_TYPES = tuple(BLOCK_SIZES)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf(): halves go away from zero (np.rint would round them to even)."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= 0.5), v)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _f16_from(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _safe_inverse(v: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(v == 0, np.float32(0), np.float32(1) / v).astype(np.float32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, sign kept (first one on ties)."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)[..., 0]


# --- bit packing helpers -------------------------------------------------------------------

def _pack_nibbles_split16(q: np.ndarray) -> np.ndarray:
    """(nb, 32) values 0..15 -> (nb, 16) bytes: element j low nibble, element j+16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _unpack_nibbles_split16(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 0x0F, b >> 4], axis=1)


def _pack_planes(q: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Pack (nb, n) small values into bit-planes: consecutive groups of `group` elements share
    bytes, group g at bit offset bits*(g % per_byte). Used by the k-quants' qs/qh/hmask arrays.
    q: (nb, chunks * per_byte * group) -> (nb, chunks * group)."""
    per_byte = 8 // bits
    nb, n = q.shape
    q = q.reshape(nb, n // (per_byte * group), per_byte, group).astype(np.uint8)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).reshape(1, 1, per_byte, 1)
    return np.bitwise_or.reduce(q << shifts, axis=2).reshape(nb, -1)


def _unpack_planes(b: np.ndarray, bits: int, group: int) -> np.ndarray:
    per_byte = 8 // bits
    nb, n = b.shape
    b = b.reshape(nb, n // group, 1, group)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).reshape(1, 1, per_byte, 1)
    return ((b >> shifts) & ((1 << bits) - 1)).reshape(nb, -1)


def _pack_bits_u32(bit: np.ndarray) -> np.ndarray:
    """(nb, 32) of 0/1 -> (nb, 4) bytes of a little-endian uint32 with bit j = element j."""
    word = (bit.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return word.astype("<u4").reshape(-1, 1).view(np.uint8)


def _unpack_bits_u32(b: np.ndarray) -> np.ndarray:
    word = np.ascontiguousarray(b).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> 12 bytes (Q4_K / Q5_K): bytes 0-3 hold scales
    0-3, bytes 4-7 mins 0-3, bytes 8-11 the low nibbles of scales/mins 4-7; the top two bits
    of scales/mins 4-7 ride in the spare top bits of bytes 0-7."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def _unpack_scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ls = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def _pack_scales_q3k(ls: np.ndarray) -> np.ndarray:
    """16 six-bit values -> 12 bytes: low nibbles of 0-7 | 8-15 in bytes 0-7, the top two bits
    of value 4g+i in bits 2g..2g+1 of byte 8+i."""
    ls = ls.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, 0:8] = (ls[:, 0:8] & 0x0F) | ((ls[:, 8:16] & 0x0F) << 4)
    hi = (ls >> 4).reshape(-1, 4, 4)  # [g, i] = value 4g+i
    out[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return out


def _unpack_scales_q3k(s: np.ndarray) -> np.ndarray:
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    hi = np.stack([(s[:, 8:12] >> (2 * g)) & 3 for g in range(4)], axis=1).reshape(-1, 16)
    return low | (hi << 4)


# --- legacy 32-element formats -------------------------------------------------------------

def _q8_0(x):
    d = np.abs(x).max(axis=1) / np.float32(127)
    q = round_half_away(x * _safe_inverse(d)[:, None]).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=1)


def _dq8_0(b):
    return _f16_from(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _symmetric_legacy(x, levels):
    """Q4_0 / Q5_0: d = signed absmax / -(levels/2), q = trunc(x/d + levels/2 + 0.5)."""
    d = _signed_absmax(x) / np.float32(-(levels // 2))
    v = x * _safe_inverse(d)[:, None] + np.float32(levels // 2 + 0.5)
    return d, np.minimum(np.trunc(v), levels - 1).astype(np.uint8)


def _affine_legacy(x, levels):
    """Q4_1 / Q5_1: d = (max - min) / (levels-1), q = trunc((x - min)/d + 0.5)."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / np.float32(levels - 1)
    v = (x - lo[:, None]) * _safe_inverse(d)[:, None] + np.float32(0.5)
    return d, lo, np.minimum(np.trunc(v), levels - 1).astype(np.uint8)


def _q4_0(x):
    d, q = _symmetric_legacy(x, 16)
    return np.concatenate([_f16_bytes(d), _pack_nibbles_split16(q)], axis=1)


def _dq4_0(b):
    return _f16_from(b[:, :2]) * (_unpack_nibbles_split16(b[:, 2:]).astype(np.float32) - 8)


def _q4_1(x):
    d, m, q = _affine_legacy(x, 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_nibbles_split16(q)], axis=1)


def _dq4_1(b):
    q = _unpack_nibbles_split16(b[:, 4:]).astype(np.float32)
    return _f16_from(b[:, :2]) * q + _f16_from(b[:, 2:4])


def _q5_0(x):
    d, q = _symmetric_legacy(x, 32)
    return np.concatenate([_f16_bytes(d), _pack_bits_u32(q >> 4),
                           _pack_nibbles_split16(q & 0x0F)], axis=1)


def _dq5_0(b):
    q = _unpack_nibbles_split16(b[:, 6:]) | (_unpack_bits_u32(b[:, 2:6]) << 4)
    return _f16_from(b[:, :2]) * (q.astype(np.float32) - 16)


def _q5_1(x):
    d, m, q = _affine_legacy(x, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_bits_u32(q >> 4),
                           _pack_nibbles_split16(q & 0x0F)], axis=1)


def _dq5_1(b):
    q = _unpack_nibbles_split16(b[:, 8:]) | (_unpack_bits_u32(b[:, 4:8]) << 4)
    return _f16_from(b[:, :2]) * q.astype(np.float32) + _f16_from(b[:, 2:4])


# --- k-quants (256-element super-blocks) ---------------------------------------------------

def _scale_min_subblocks(x, n_sub, q_max, scale_max):
    """Shared by Q2_K / Q4_K / Q5_K: per sub-block scale = (max - min) / q_max with min <= 0,
    then the scales and mins quantized to 0..scale_max against the super-block's largest.
    Returns d, dmin (f32 of the stored f16), integer scales, mins and q (0..q_max)."""
    nb = x.shape[0]
    sub = x.reshape(nb, n_sub, -1)
    lo = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - lo) / np.float32(q_max)
    neg_min = -lo
    max_scale, max_min = scale.max(axis=1), neg_min.max(axis=1)
    ls = np.clip(round_half_away(scale * (scale_max * _safe_inverse(max_scale))[:, None]), 0, scale_max)
    lm = np.clip(round_half_away(neg_min * (scale_max * _safe_inverse(max_min))[:, None]), 0, scale_max)
    d = (max_scale / np.float32(scale_max)).astype(np.float16).astype(np.float32)
    dmin = (max_min / np.float32(scale_max)).astype(np.float16).astype(np.float32)
    # Re-round every element against the scale and min as they will be decoded.
    eff_scale = d[:, None] * ls
    eff_min = dmin[:, None] * lm
    q = round_half_away((sub + eff_min[:, :, None]) * _safe_inverse(eff_scale)[:, :, None])
    q = np.clip(q, 0, q_max).astype(np.uint8).reshape(nb, -1)
    return d, dmin, ls.astype(np.uint8), lm.astype(np.uint8), q


def _symmetric_subblocks(x, n_sub, q_neg, scale_levels):
    """Shared by Q3_K / Q6_K: per sub-block scale = signed absmax / -q_neg (q in -q_neg..q_neg-1),
    the scales quantized as signed integers against the largest one (-scale_levels at it).
    Returns d (f32 of the stored f16), integer scales (signed) and q (signed)."""
    nb = x.shape[0]
    sub = x.reshape(nb, n_sub, -1)
    scale = _signed_absmax(sub) / np.float32(-q_neg)
    max_scale = _signed_absmax(scale)
    iscale = np.float32(-scale_levels) * _safe_inverse(max_scale)
    ls = np.clip(round_half_away(scale * iscale[:, None]), -scale_levels, scale_levels - 1)
    d = _safe_inverse(iscale).astype(np.float16).astype(np.float32)
    eff_scale = d[:, None] * ls
    q = round_half_away(sub * _safe_inverse(eff_scale)[:, :, None])
    q = np.clip(q, -q_neg, q_neg - 1).astype(np.int16).reshape(nb, -1)
    return d, ls.astype(np.int16), q


def _q2_k(x):
    d, dmin, ls, lm, q = _scale_min_subblocks(x, 16, 3, 15)
    return np.concatenate([ls | (lm << 4), _pack_planes(q, 2, 32),
                           _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _dq2_k(b):
    sc, q = b[:, :16], _unpack_planes(b[:, 16:80], 2, 32).astype(np.float32)
    d, dmin = _f16_from(b[:, 80:82]), _f16_from(b[:, 82:84])
    scale = np.repeat(d * (sc & 0x0F), 16, axis=1)
    offset = np.repeat(dmin * (sc >> 4), 16, axis=1)
    return scale * q - offset


def _q3_k(x):
    d, ls, q = _symmetric_subblocks(x, 16, 4, 32)
    q = (q + 4).astype(np.uint8)
    return np.concatenate([_pack_planes(q >> 2, 1, 32), _pack_planes(q & 3, 2, 32),
                           _pack_scales_q3k((ls + 32).astype(np.uint8)), _f16_bytes(d)], axis=1)


def _dq3_k(b):
    high = _unpack_planes(b[:, :32], 1, 32)
    q = (_unpack_planes(b[:, 32:96], 2, 32) | (high << 2)).astype(np.float32) - 4
    sc = _unpack_scales_q3k(b[:, 96:108]).astype(np.float32) - 32
    return np.repeat(_f16_from(b[:, 108:110]) * sc, 16, axis=1) * q


def _q4_k(x):
    d, dmin, ls, lm, q = _scale_min_subblocks(x, 8, 15, 63)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(ls, lm),
                           _pack_planes(q, 4, 32)], axis=1)


def _dequant_scale_min_k4(b, q):
    d, dmin = _f16_from(b[:, 0:2]), _f16_from(b[:, 2:4])
    ls, lm = _unpack_scale_min_k4(b[:, 4:16])
    return np.repeat(d * ls, 32, axis=1) * q - np.repeat(dmin * lm, 32, axis=1)


def _dq4_k(b):
    return _dequant_scale_min_k4(b, _unpack_planes(b[:, 16:], 4, 32).astype(np.float32))


def _q5_k(x):
    d, dmin, ls, lm, q = _scale_min_subblocks(x, 8, 31, 63)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(ls, lm),
                           _pack_planes(q >> 4, 1, 32), _pack_planes(q & 0x0F, 4, 32)], axis=1)


def _dq5_k(b):
    q = _unpack_planes(b[:, 48:], 4, 32) | (_unpack_planes(b[:, 16:48], 1, 32) << 4)
    return _dequant_scale_min_k4(b, q.astype(np.float32))


def _q6_k(x):
    d, ls, q = _symmetric_subblocks(x, 16, 32, 128)
    q = (q + 32).astype(np.uint8)
    # Each 128-element half: ql packs nibbles of elements l | l+64 (bytes 0-31) and
    # l+32 | l+96 (bytes 32-63); qh packs the top two bits of l, l+32, l+64, l+96.
    halves = q.reshape(-1, 2, 4, 32)  # [half, quarter, l]
    low, high = halves & 0x0F, halves >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, ls.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _dq6_k(b):
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [half, byte group, l]
    qh = b[:, 128:192].reshape(-1, 2, 32)
    low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4],
                   axis=2)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (low | (high << 4)).reshape(-1, 256).astype(np.float32) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    return np.repeat(_f16_from(b[:, 208:210]) * sc, 16, axis=1) * q


def _iq4_nearest(v):
    """Index of the level nearest each value (v already divided by the scale)."""
    return np.abs(v[..., None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_nl(x):
    d = (_signed_absmax(x) / np.float32(-127)).astype(np.float16).astype(np.float32)
    idx = _iq4_nearest(x * _safe_inverse(d)[:, None])
    return np.concatenate([_f16_bytes(d), _pack_nibbles_split16(idx)], axis=1)


def _diq4_nl(b):
    return _f16_from(b[:, :2]) * IQ4_VALUES[_unpack_nibbles_split16(b[:, 2:])]


def _iq4_xs(x):
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    scale = _signed_absmax(sub) / np.float32(-127)  # per sub-block
    d = (_signed_absmax(scale) / np.float32(-32)).astype(np.float16).astype(np.float32)
    ls = np.clip(round_half_away(scale * _safe_inverse(d)[:, None]), -32, 31).astype(np.int16)
    eff = d[:, None] * ls
    idx = _iq4_nearest(sub * _safe_inverse(eff)[:, :, None])  # (nb, 8, 32)
    u = (ls + 32).astype(np.uint16)
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    scales_l = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = _pack_nibbles_split16(idx.reshape(nb * 8, 32)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


def _diq4_xs(b):
    nb = b.shape[0]
    d = _f16_from(b[:, :2])[:, 0]
    scales_h = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)[:, 0]
    scales_l = b[:, 4:8]
    j = np.arange(8)
    ls = ((scales_l[:, j // 2] >> (4 * (j % 2))) & 15) | (((scales_h[:, None] >> (2 * j)) & 3) << 4)
    dl = d[:, None] * (ls.astype(np.float32) - 32)
    q = IQ4_VALUES[_unpack_nibbles_split16(b[:, 8:].reshape(nb * 8, 16))].reshape(nb, 8, 32)
    return (dl[:, :, None] * q).reshape(nb, 256)


_QUANTIZERS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
               "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
               "iq4_nl": _iq4_nl, "iq4_xs": _iq4_xs}
_DEQUANTIZERS = {"q4_0": _dq4_0, "q4_1": _dq4_1, "q5_0": _dq5_0, "q5_1": _dq5_1, "q8_0": _dq8_0,
                 "q2_k": _dq2_k, "q3_k": _dq3_k, "q4_k": _dq4_k, "q5_k": _dq5_k, "q6_k": _dq6_k,
                 "iq4_nl": _diq4_nl, "iq4_xs": _diq4_xs}

# Rows processed per numpy call: bounds the temporaries when quantizing a 1B-parameter model.
_CHUNK_ELEMENTS = 1 << 22


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float (..., n) -> uint8 (..., n // block_elems * block_bytes) in ggml's layout."""
    block, nbytes = BLOCK_SIZES[qtype]
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"{qtype}: row length {x.shape[-1]} is not a multiple of {block}")
    flat = x.reshape(-1, block)
    out = np.empty((flat.shape[0], nbytes), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // block)
    for i in range(0, flat.shape[0], step):
        out[i:i + step] = _QUANTIZERS[qtype](flat[i:i + step])
    return out.reshape(*x.shape[:-1], x.shape[-1] // block * nbytes)


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 (..., n_bytes) in ggml's layout -> float32 (..., n_elements)."""
    block, nbytes = BLOCK_SIZES[qtype]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.shape[-1] % nbytes:
        raise ValueError(f"{qtype}: row of {data.shape[-1]} bytes is not a whole number of blocks")
    out = _DEQUANTIZERS[qtype](data.reshape(-1, nbytes))
    return out.reshape(*data.shape[:-1], data.shape[-1] // nbytes * block).astype(np.float32)


def row_bytes(qtype: str, n: int) -> int:
    block, nbytes = BLOCK_SIZES[qtype]
    return n // block * nbytes


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat, out = x.reshape(-1).view(np.uint32), np.empty(x.size, np.uint16)
    for i in range(0, flat.size, _CHUNK_ELEMENTS):  # chunks bound the uint32 temporaries
        bits = flat[i:i + _CHUNK_ELEMENTS]
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out[i:i + _CHUNK_ELEMENTS] = np.where(is_nan, (bits >> 16) | 0x40, rounded)
    return out.reshape(x.shape)


def bf16_bits_to_float(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
