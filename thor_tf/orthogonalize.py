"""Newton–Schulz orthogonalization of step matrices, batched over matrices of one shape.

The orthogonal (polar) factor of ``X = U Σ Vᵀ`` is ``U Vᵀ``: every singular value set to 1. Muon
(Jordan et al. 2024) approximates it by five iterations of a quintic polynomial whose slope at 0
is large, so that small singular values grow quickly; the result has singular values in about
[0.7, 1.2] rather than exactly 1 (``US'Vᵀ``), which trains as well as the exact factor and costs
only matrix products. The eigenbasis rule orthogonalizes its step after Adam's division in the
eigenbasis (SOAP-Muon), not the gradient: orthogonalizing the rotated gradient would be Muon,
since ``orth(Q_Aᵀ M Q_G) = Q_Aᵀ orth(M) Q_G``.

Conventions: matrices are ``[..., r, c]`` float32; the iteration runs on the wide orientation
(``r ≤ c``, transposing when needed) so that ``X Xᵀ`` is the small ``[r, r]`` Gram matrix.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["NS_COEFFICIENTS", "NS_STEPS", "newton_schulz"]

#: Muon's quintic coefficients (a, b, c): ``X ← a X + (b A + c A²) X`` with ``A = X Xᵀ``.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: Iterations (Muon's default).
NS_STEPS = 5


def newton_schulz(x, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, epsilon=1e-7):
    """Approximate orthogonal factor of each matrix of ``x`` (``[..., r, c]``, float32).

    ``X ← X / (‖X‖_F + ε)`` (spectral norm ≤ 1), then ``steps`` times ``A = X Xᵀ``,
    ``X ← aX + (bA + cA²)X``, on the wide orientation. A zero matrix stays zero.
    """
    x = tf.convert_to_tensor(x, tf.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = tf.linalg.matrix_transpose(x)
    a, b, c = coefficients
    norm = tf.sqrt(tf.reduce_sum(tf.square(x), axis=[-2, -1], keepdims=True))
    x = x / (norm + epsilon)
    for _ in range(int(steps)):
        gram = tf.matmul(x, x, transpose_b=True)
        x = a * x + tf.matmul(b * gram + c * tf.matmul(gram, gram), x)
    return tf.linalg.matrix_transpose(x) if tall else x
