"""Independent NumPy (float64 unless stated) formulas of the model, for the component tests.

Written from the equations of ``docs/architecture.md`` directly -- loops and explicit indices
rather than the model's vectorised layout -- so a shared misunderstanding is unlikely to hide
in both.
"""
import math

import numpy as np


def rms_norm(x, w=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


def rope_freqs(dim, base, original=0, factor=1.0, beta_fast=32, beta_slow=1):
    f = np.array([base ** (-2 * i / dim) for i in range(dim // 2)])
    if original > 0:
        corr = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        for i in range(dim // 2):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            f[i] = f[i] / factor * ramp + f[i] * (1 - ramp)
    return f


def rope(x, pos, freqs, inverse=False):
    """Interleaved pairs of the last dim as complex numbers times exp(+-i pos f).

    The angle ``pos * f`` is formed in f32 as the reference's table is (at large positions
    that rounding is the dominant error); the rotation itself is exact."""
    x = np.asarray(x, np.float64)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    angle = (np.asarray(pos, np.float32)[..., None] * np.asarray(freqs, np.float32))
    rot = np.exp((-1j if inverse else 1j) * angle.astype(np.float64))
    z = z * rot
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def sinkhorn(mix, scale, base, n=4, iters=20, eps=1e-6):
    mix = np.asarray(mix, np.float64)
    sig = lambda v: 1 / (1 + np.exp(-v))
    pre = sig(mix[:n] * scale[0] + base[:n]) + eps
    post = 2 * sig(mix[n:2 * n] * scale[1] + base[n:2 * n])
    m = (mix[2 * n:] * scale[2] + base[2 * n:]).reshape(n, n)
    m = np.exp(m - m.max(axis=1, keepdims=True))
    m = m / m.sum(axis=1, keepdims=True) + eps
    m = m / (m.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(axis=1, keepdims=True) + eps)
        m = m / (m.sum(axis=0, keepdims=True) + eps)
    return pre, post, m


def attention_with_sink(q, keys, sink, scale):
    """q [H, D], keys [K, D] (values = keys), sink [H] -> o [H, D]."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    if len(keys) == 0:
        return np.zeros_like(q)
    logits = scale * q @ keys.T                                     # [H, K]
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    denom = p.sum(axis=1, keepdims=True) + np.exp(np.asarray(sink)[:, None] - m)
    return (p @ keys) / denom


def compress_prefill(a, z, ape, ratio, overlap):
    """Pooled (pre-norm) entries of a sequence from position 0, docs/architecture.md §3.4.

    a, z: [T, coff*D] raw projections; returns [T // ratio, D].
    """
    a, z = np.asarray(a, np.float64), np.asarray(z, np.float64)
    t_total, width = a.shape
    d = width // 2 if overlap else width
    out = []
    for j in range(t_total // ratio):
        rows_a, rows_z = [], []
        cur = range(j * ratio, (j + 1) * ratio)
        if overlap:
            for t in range(j * ratio - ratio, j * ratio):
                if t >= 0:
                    rows_a.append(a[t, :d])
                    rows_z.append(z[t, :d] + ape[t % ratio, :d])
            for t in cur:
                rows_a.append(a[t, d:])
                rows_z.append(z[t, d:] + ape[t % ratio, d:])
        else:
            for t in cur:
                rows_a.append(a[t])
                rows_z.append(z[t] + ape[t % ratio])
        za, aa = np.stack(rows_z), np.stack(rows_a)
        w = np.exp(za - za.max(axis=0))
        w = w / w.sum(axis=0)
        out.append((w * aa).sum(axis=0))
    return np.stack(out) if out else np.zeros((0, d))


def window_positions(t, window):
    return list(range(max(0, t - window + 1), t + 1))
