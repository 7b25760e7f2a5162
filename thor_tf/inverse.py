"""Split inversion of damped Kronecker factors: the H of THOR.

A factor ``F`` ([n, n], symmetric PSD) is damped, ``M = F + d·I``, cut into diagonal blocks of
``split_dim`` (the last block padded with the identity) and only those blocks are inverted, as one
batched Cholesky over a ``[num_blocks, d, d]`` tensor. The result is the inverse of the
block-diagonal part of ``M``; with ``split_dim >= n`` it is the exact inverse.

Robustness: a block whose float32 Cholesky fails (NaN/Inf, the way TF reports a non-positive-definite
input) is retried in float64 with more damping; a block that still fails keeps the inverse it had
before, so non-finite values never reach the stored inverses.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf.algebra import BlockDiagonal


def split_layout(dim: int, split_dim: int) -> tuple[int, int]:
    """``(num_blocks, block_size)`` for a factor of size ``dim`` split at ``split_dim``.

    ``split_dim >= dim`` gives one exact block of size ``dim`` (no padding).
    """
    if split_dim >= dim:
        return 1, dim
    return -(-dim // split_dim), split_dim


def _cholesky_inverse(blocks):
    """Inverse of each SPD matrix in ``blocks`` ([b, d, d]) through its Cholesky factor."""
    chol = tf.linalg.cholesky(blocks)
    eye = tf.eye(tf.shape(blocks)[-1], batch_shape=tf.shape(blocks)[:1], dtype=blocks.dtype)
    return tf.linalg.cholesky_solve(chol, eye)


def _finite_per_block(blocks):
    return tf.reduce_all(tf.math.is_finite(blocks), axis=[1, 2])


def split_inverse(factor, damping, split_dim: int, previous=None, retry_scale: float = 10.0):
    """Inverse of the diagonal blocks of ``factor + damping·I``.

    Args:
      factor: ``[n, n]`` float32 symmetric PSD factor (undamped).
      damping: scalar tensor, the damping ``d`` added to this factor's diagonal.
      split_dim: python int, block size (see :func:`split_layout`).
      previous: ``[num_blocks, d, d]`` inverses to keep for blocks that cannot be inverted even in
        float64 (default: the identity).
      retry_scale: how much the damping grows for the float64 retry.

    Returns:
      ``[num_blocks, d, d]`` float32 inverses (padding rows/cols of the last block are identity).
    """
    factor = tf.convert_to_tensor(factor, tf.float32)
    n = int(factor.shape[-1])
    num_blocks, size = split_layout(n, split_dim)
    damping = tf.cast(damping, tf.float32)
    damped = factor + damping * tf.eye(n, dtype=tf.float32)
    blocks = BlockDiagonal.from_dense(damped, size).blocks
    inverse = _cholesky_inverse(blocks)
    ok = _finite_per_block(inverse)
    if previous is None:
        previous = tf.eye(size, batch_shape=[num_blocks], dtype=tf.float32)

    def retry():
        blocks64 = tf.cast(blocks, tf.float64)
        # More damping, scaled to the block so that it helps whatever the factor's magnitude.
        mean_diag = tf.reduce_mean(tf.linalg.diag_part(blocks64), axis=-1)
        extra = retry_scale * tf.cast(damping, tf.float64) + 1e-6 * tf.abs(mean_diag) + 1e-12
        extra = tf.where(tf.math.is_finite(extra), extra, tf.ones_like(extra))
        boosted = blocks64 + extra[:, None, None] * tf.eye(size, dtype=tf.float64)
        inverse64 = tf.cast(_cholesky_inverse(boosted), tf.float32)
        ok64 = _finite_per_block(inverse64)
        fixed = tf.where(ok64[:, None, None], inverse64, previous)
        return tf.where(ok[:, None, None], inverse, fixed)

    return tf.cond(tf.reduce_all(ok), lambda: inverse, retry)
