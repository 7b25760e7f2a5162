"""Float64 NumPy references built from first principles, for the engine's tests.

Explicit per-example activations and gradients, explicit patches, explicit Kronecker products.
Nothing here calls thor_tf.
"""

import numpy as np


def same_padding(size, kernel, stride, dilation):
    """TF 'SAME' padding (before, after) for one spatial axis."""
    effective = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


def conv_patches(x, kernel_size, strides, padding, dilation):
    """Explicit im2col: x [N, H, W, C] -> patches [N, Ho, Wo, kh*kw*C] in (kh, kw, C) order."""
    n, h, w, c = x.shape
    kh, kw = kernel_size
    sh, sw = strides
    dh, dw = dilation
    if padding == "same":
        (pt, pb), (pl, pr) = same_padding(h, kh, sh, dh), same_padding(w, kw, sw, dw)
    else:
        pt = pb = pl = pr = 0
    xp = np.zeros((n, h + pt + pb, w + pl + pr, c))
    xp[:, pt:pt + h, pl:pl + w] = x
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    ho = (xp.shape[1] - eh) // sh + 1
    wo = (xp.shape[2] - ew) // sw + 1
    out = np.zeros((n, ho, wo, kh * kw * c))
    for i in range(ho):
        for j in range(wo):
            feats = []
            for a in range(kh):
                for b in range(kw):
                    feats.append(xp[:, i * sh + a * dh, j * sw + b * dw, :])
            out[:, i, j] = np.concatenate(feats, axis=-1)
    return out


def homogeneous(rows, use_bias):
    return np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1) if use_bias else rows


def mean_outer(rows):
    """Mean over rows of r rᵀ, one explicit outer product per row."""
    total = np.zeros((rows.shape[1], rows.shape[1]))
    for r in rows:
        total += np.outer(r, r)
    return total / rows.shape[0]


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def block_diagonal_part(m, size):
    """Copy of m with everything outside the diagonal blocks of `size` set to 0."""
    out = np.zeros_like(m)
    for s in range(0, m.shape[0], size):
        out[s:s + size, s:s + size] = m[s:s + size, s:s + size]
    return out


def conv1d_patches(x, kernel, stride, padding, dilation):
    """Explicit im2col over T: x [N, T, C] -> patches [N, T_out, k*C] in (k, C) order.

    ``padding="causal"`` pads dilation·(k−1) zeros on the left, then takes valid patches.
    """
    if padding == "causal":
        left = dilation * (kernel - 1)
        x = np.concatenate([np.zeros((x.shape[0], left, x.shape[2])), x], axis=1)
        padding = "valid"
    return conv_patches(x[:, None], (1, kernel), (1, stride), padding, (1, dilation))[:, 0]


def one_hot(tokens, vocabulary):
    """[...] int -> [..., V] float64 one-hot rows."""
    return np.eye(vocabulary)[np.asarray(tokens)]


def einsum_rows(t, spec, leading, trailing):
    """Rows of an einsum operand: axes ``leading`` first (flattened to rows), ``trailing`` last
    (flattened to the row features), by explicit transposition of ``t`` whose axes are ``spec``."""
    perm = [spec.index(c) for c in leading + trailing]
    moved = np.transpose(t, perm)
    features = int(np.prod([t.shape[spec.index(c)] for c in trailing]))
    return moved.reshape(-1, features)


def softmax_dense_kfac_step(x, y, w0, damping, lr, kappa):
    """``(Δ, ν)`` of one K-FAC step of a single softmax Dense layer (bias folded in), float64.

    ``Δ = (A + √λ I)⁻¹ ∇ (G + √λ I)⁻¹`` from explicit per-example inputs and output gradients of
    the cross-entropy, ``ν = min(1, sqrt(κ / (lr²·⟨Δ, ∇⟩)))``; ``w0`` is ``[in + 1, out]``.
    """
    n, d = x.shape
    k = w0.shape[1]
    xa = homogeneous(x.astype(np.float64), True)
    g = softmax(xa @ w0) - np.eye(k)[y]
    grad = xa.T @ g / n
    damp = np.sqrt(damping)
    delta = (np.linalg.inv(mean_outer(xa) + damp * np.eye(d + 1)) @ grad
             @ np.linalg.inv(mean_outer(g) + damp * np.eye(k)))
    nu = min(1.0, np.sqrt(kappa / (lr ** 2 * np.sum(delta * grad))))
    return delta, nu
