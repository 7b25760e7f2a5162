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


# -- dense networks, one example at a time ----------------------------------------------------------
def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def activation(name, z):
    """``(value, elementwise derivative)`` of a Keras activation by name, float64."""
    if name in (None, "linear"):
        return z, np.ones_like(z)
    if name == "tanh":
        t = np.tanh(z)
        return t, 1.0 - t ** 2
    if name == "relu":
        return np.maximum(z, 0.0), (z > 0).astype(np.float64)
    if name == "sigmoid":
        s = sigmoid(z)
        return s, s * (1.0 - s)
    if name == "softmax":
        return softmax(z), None  # not elementwise: the loss gives dℓ/dz of a softmax layer
    raise ValueError(name)


def dense_forward(x, layers):
    """A chain of Dense layers ``[(kernel [in, out], bias, activation name)]`` on ``x`` [N, in]:
    ``(inputs, zs, output)`` with each layer's input rows and pre-activations, float64."""
    h = np.asarray(x, np.float64)
    inputs, zs = [], []
    for kernel, bias, act in layers:
        inputs.append(h)
        z = h @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
        zs.append(z)
        h = activation(act, z)[0]
    return inputs, zs, h


def dense_backward(g_last, layers, zs):
    """Per-example ``dℓ_n/dz`` of every layer of the chain (rows), from the last layer's
    ``g_last`` [N, out], by the chain rule one layer at a time; and ``dℓ_n/dx`` of the input."""
    gs = [np.asarray(g_last, np.float64)]
    for k in range(len(layers) - 1, 0, -1):
        upstream = gs[0] @ np.asarray(layers[k][0], np.float64).T
        gs.insert(0, upstream * activation(layers[k - 1][2], zs[k - 1])[1])
    return gs, gs[0] @ np.asarray(layers[0][0], np.float64).T


def kfac_direction(a_rows, g_rows, grad, damping, positions=1, split_dim=None):
    """``(1/P)·(A + dI)⁻¹ M (G + dI)⁻¹`` of one block, float64, with ``A`` = mean over
    ``a_rows`` (homogeneous: bias column included) of ā āᵀ, ``G`` = mean over ``g_rows`` of g gᵀ
    (one explicit outer product per row), ``d = √(λ/P)`` and ``M = grad`` ``[a_dim, g_dim]``.

    ``split_dim`` smaller than a factor: only its diagonal blocks are inverted (the inverse of
    the block-diagonal part of the damped factor)."""
    a_rows = np.asarray(a_rows, np.float64)
    g_rows = np.asarray(g_rows, np.float64)
    d = np.sqrt(damping / positions)
    big_a = mean_outer(a_rows) + d * np.eye(a_rows.shape[1])
    big_g = mean_outer(g_rows) + d * np.eye(g_rows.shape[1])
    if split_dim is not None:
        big_a = block_diagonal_part(big_a, split_dim)
        big_g = block_diagonal_part(big_g, split_dim)
    return np.linalg.inv(big_a) @ np.asarray(grad, np.float64) @ np.linalg.inv(big_g) / positions


def dense_kfac_steps(inputs, gs, damping, split_dim=None):
    """``[(Δ, M)]`` per Dense layer of a chain: ``M = āᵀ g / N`` (the gradient of the mean loss,
    bias as the last row) and its K-FAC direction, from per-example inputs and ``dℓ_n/dz``."""
    out = []
    for a, g in zip(inputs, gs):
        a_bar = homogeneous(np.asarray(a, np.float64), True)
        m = a_bar.T @ g / a_bar.shape[0]
        out.append((kfac_direction(a_bar, g, m, damping, split_dim=split_dim), m))
    return out


def kl_clip_scale(pairs, kappa, lr):
    """K-FAC's ``ν = min(1, sqrt(κ / (lr²·Σ⟨Δ, M⟩)))`` over ``[(Δ, M)]``."""
    return min(1.0, np.sqrt(kappa / (lr ** 2 * sum(np.sum(d * m) for d, m in pairs))))


class DenseKfac:
    """THOR's update for Dense blocks in float64, step by step from DESIGN §2: at a refresh the
    damped factors of the batch are inverted (their diagonal blocks only, with ``split_dim``),
    between refreshes those inverses are reused; ``Δ = (A + dI)⁻¹ M (G + dI)⁻¹`` per block, all
    blocks scaled by the KL clip ν (``kl_clip`` None: ν = 1), then ``v = μv + νΔ; w ← w − lr·v``.

    Parameters are ``[in + 1, out]`` matrices (bias as the last row)."""

    def __init__(self, learning_rate, momentum=0.0, damping=0.03, kl_clip=None, split_dim=None):
        self.lr, self.momentum, self.damping = learning_rate, momentum, damping
        self.kl_clip, self.split_dim = kl_clip, split_dim
        self.inverses, self.velocity = None, None

    def _inverse(self, rows):
        big = mean_outer(rows) + np.sqrt(self.damping) * np.eye(rows.shape[1])
        if self.split_dim is not None:
            big = block_diagonal_part(big, self.split_dim)
        return np.linalg.inv(big)

    def step(self, params, inputs, gs, refresh):
        """New parameters after one step; ``inputs`` and ``gs``: per layer, the per-example input
        rows and ``dℓ_n/dz`` rows of the batch (the loss: their mean)."""
        a_bars = [homogeneous(np.asarray(a, np.float64), True) for a in inputs]
        grads = [a.T @ g / a.shape[0] for a, g in zip(a_bars, gs)]
        if refresh or self.inverses is None:
            self.inverses = [(self._inverse(a), self._inverse(np.asarray(g, np.float64)))
                             for a, g in zip(a_bars, gs)]
        deltas = [ia @ m @ ig for (ia, ig), m in zip(self.inverses, grads)]
        nu = 1.0 if self.kl_clip is None else kl_clip_scale(list(zip(deltas, grads)),
                                                             self.kl_clip, self.lr)
        if self.velocity is None:
            self.velocity = [np.zeros_like(d) for d in deltas]
        self.velocity = [self.momentum * v + nu * d for v, d in zip(self.velocity, deltas)]
        return [p - self.lr * v for p, v in zip(params, self.velocity)]


def folded(kernel, bias):
    """``[kernel; bias]`` as one float64 ``[in + 1, out]`` matrix."""
    return np.concatenate([np.asarray(kernel, np.float64), np.asarray(bias, np.float64)[None]])
