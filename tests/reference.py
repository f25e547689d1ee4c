"""float64 numpy references for the backend ops (the definitions the kernels are tested against)."""
import numpy as np


def rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_tables(max_pos, head_dim, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def rope(x, positions, cos, sin, interleaved):
    """x [T, H, hd] rotated by positions[T]."""
    x = x.astype(np.float64).copy()
    half = cos.shape[1]
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = a * c - b * s
        x[..., 1:2 * half:2] = b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = a * c - b * s
        x[..., half:2 * half] = b * c + a * s
    return x


def attention(q, k_seq, v_seq, token_seq, token_pos, window=0, scale=None):
    """q [T, H, hd]; k_seq/v_seq: per sequence [len, KV, hd] (all positions). Causal, GQA."""
    T, H, hd = q.shape
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    out = np.zeros((T, H, hd))
    for t in range(T):
        k, v, p = k_seq[token_seq[t]], v_seq[token_seq[t]], token_pos[t]
        kv_heads = k.shape[1]
        first = max(0, p - window + 1) if window else 0
        for h in range(H):
            kh = h // (H // kv_heads)
            s = k[first:p + 1, kh] @ q[t, h].astype(np.float64) * scale
            s = np.exp(s - s.max())
            s /= s.sum()
            out[t, h] = s @ v[first:p + 1, kh]
    return out


def swiglu(gate_up):
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def nmse(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def moe_route(logits, top_k, normalize):
    """Softmax over all experts, the top_k largest (lower id first on ties), optionally
    renormalised: (ids [T, k], weights [T, k])."""
    l = logits.astype(np.float64)
    p = np.exp(l - l.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, -1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return ids.astype(np.int32), w


def moe_experts(x, gate, up, down, ids, weights):
    """sum_j weights[t, j] * SwiGLU MLP of expert ids[t, j]; ids outside [0, E) add nothing.
    gate/up [E, I, H], down [E, H, I]."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            if 0 <= e < gate.shape[0]:
                act = swiglu(np.concatenate([gate[e] @ x[t], up[e] @ x[t]]))
                out[t] += w * (down[e] @ act)
    return out
