"""The inverse rule's maths: split inversion of damped Kronecker factors (the H of THOR),
then the preconditioned step with K-FAC's KL clip. :class:`thor_tf.rules.inverse.Inverse`
calls it; the bucket loop both rules share is :mod:`thor_tf.buckets`.

**Split inversion.** A factor ``F`` ([n, n], symmetric PSD) is damped, ``M = F + d·I``, cut into diagonal blocks of
``split_dim`` (the last block padded with the identity) and only those blocks are inverted, as one
batched Cholesky over a ``[num_blocks, d, d]`` tensor. The result is the inverse of the
block-diagonal part of ``M``; with ``split_dim >= n`` it is the exact inverse. Training never forms
the off-diagonal part at all: :func:`thor_tf.blocks.block_gram` computes only the diagonal blocks.

Robustness: a block whose float32 Cholesky fails (NaN/Inf, the way TF reports a non-positive-definite
input) is retried in float64 with more damping; a block that still fails keeps the inverse it had
before, so non-finite values never reach the stored inverses.

**The step.** For a block with gradient matrix ``M`` (``[a_dim, g_dim]``, see
:mod:`thor_tf.blocks.base`) and split inverses ``A_inv`` ``[nb_a, d_a, d_a]`` and ``G_inv`` ``[nb_g, d_g, d_g]`` of its damped
factors, the preconditioned gradient is

    Δ = (1/c) · A_inv · M · G_inv

(``c = R/D`` the block's rows per data point of the loss: ``P`` positions per example for a loss
with one term per example, 1 for a per-token loss on a Transformer's ``[B, T]`` rows; see
:mod:`thor_tf.loss_terms`). The whole model's preconditioner is the block-diagonal
mat of the blocks' Kronecker operators (:mod:`thor_tf.block_diagonal`), applied to the vec of all
gradient matrices (:func:`~thor_tf.block_diagonal.apply_blockwise`, seed 000's ``mat_vec_prod``
of a block-diagonal mat): no Kronecker product is formed and no off-diagonal block is stored.

KL clip (Ba et al. 2017; kfac-pytorch's ``kl_clip``): the quadratic model of the KL change of a
step ``lr·Δ`` is ``lr²·Σ_l⟨Δ_l, M_l⟩``; all blocks are scaled by
``ν = min(1, sqrt(κ / (lr²·Σ_l⟨Δ_l, M_l⟩)))``, which keeps stale inverses (reused between
refreshes) from amplifying directions their batch did not see. The gradients must be the true
(unscaled) ones: the engine divides out any loss scale first.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf import _keras_compat, block_matrices
from thor_tf.block_diagonal import (BlockDiagonal, KroneckerOperator, apply_blockwise,
                                    diagonal_blocks, inner_product, split_layout)
from thor_tf.buckets import batched_layout

__all__ = ["DAMPING_SPLITS", "damped_diagonal", "factor_dampings", "invert_blocks",
           "invert_damped", "invert_owned", "invert_selected", "kl_scale", "pi_adjustment",
           "precondition_gradients", "split_inverse", "split_layout"]  # split_layout: from block_diagonal


#: How a block's damping λ_b (λ/P) is shared between its two factors (``damping_split``).
DAMPING_SPLITS = ("sqrt", "pi")


def _trace(blocks):
    """Trace of a factor stored as diagonal blocks ``[nb, d, d]`` (padding is zero)."""
    return tf.reduce_sum(tf.linalg.diag_part(tf.convert_to_tensor(blocks, tf.float32)))


def pi_adjustment(factor_a, factor_g, a_dim: int, g_dim: int):
    """π of Martens & Grosse (2015, §6.3), float32 scalar: ``√((tr A / dim A) / (tr G / dim G))``.

    ``factor_a``/``factor_g`` are the undamped factors as diagonal blocks (``[nb, d, d]``, zero
    padding), ``a_dim``/``g_dim`` their true dimensions. A π that is not finite or not > 0 (a
    zero factor, e.g. before the first refresh) is 1, the unadjusted split.
    """
    ratio = (_trace(factor_a) / float(a_dim)) / (_trace(factor_g) / float(g_dim))
    pi = tf.sqrt(ratio)
    ok = tf.logical_and(tf.math.is_finite(pi), pi > 0)
    return tf.where(ok, pi, tf.ones_like(pi))


def factor_dampings(block_damping, factor_a, factor_g, a_dim: int, g_dim: int, split="sqrt"):
    """``(d_A, d_G)``: what is added to the diagonals of A and G for the block damping λ_b.

    ``split="sqrt"`` (THOR): both get ``√λ_b``. ``split="pi"`` (factored Tikhonov damping of
    Martens & Grosse 2015 §6.3, kfac-jax's): ``d_A = π·√λ_b``, ``d_G = √λ_b / π`` with π of
    :func:`pi_adjustment`, so ``d_A·d_G = λ_b`` either way.
    """
    base = tf.sqrt(tf.cast(block_damping, tf.float32))
    if split == "sqrt":
        return base, base
    if split != "pi":
        raise ValueError(f"`damping_split` must be one of {list(DAMPING_SPLITS)}; got {split!r}.")
    pi = pi_adjustment(factor_a, factor_g, a_dim, g_dim)
    return base * pi, base / pi


def _cholesky_inverse(blocks):
    """Inverse of each SPD matrix in ``blocks`` ([b, d, d]) through its Cholesky factor."""
    chol = tf.linalg.cholesky(blocks)
    eye = tf.eye(tf.shape(blocks)[-1], batch_shape=tf.shape(blocks)[:1], dtype=blocks.dtype)
    return tf.linalg.cholesky_solve(chol, eye)


def _finite_per_block(blocks):
    return tf.reduce_all(tf.math.is_finite(blocks), axis=[1, 2])


def damped_diagonal(mask, damping):
    """``[B, S]``: what to add to each block's diagonal: ``damping[b]`` on block ``b``'s true
    entries (``mask`` 1, see :func:`batched_layout`), 1 on its padding (padded rows stay
    decoupled, so the inverse of the padded block is the true block's inverse plus identity)."""
    mask = tf.convert_to_tensor(mask, tf.float32)
    return mask * tf.cast(damping, tf.float32)[:, None] + (1.0 - mask)


def invert_blocks(blocks, damping, dim: int, previous=None, retry_scale: float = 10.0):
    """Inverses of the damped diagonal blocks of a factor.

    Args:
      blocks: ``[nb, d, d]`` float32 diagonal blocks of the undamped factor (symmetric PSD), as
        :func:`thor_tf.blocks.block_gram` returns them; padding past ``dim`` is zero.
      damping: scalar tensor, the damping ``d`` added to this factor's diagonal.
      dim: the factor's true dimension ``n`` (padding rows/cols beyond it become identity).
      previous: ``[nb, d, d]`` inverses to keep for blocks that cannot be inverted even in
        float64 (default: the identity).
      retry_scale: how much the damping grows for the float64 retry.

    Returns:
      ``[nb, d, d]`` float32 inverses of ``block + damping·I`` (padding rows/cols: identity).
    """
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    num_blocks, size = int(blocks.shape[0]), int(blocks.shape[-1])
    _, mask, _ = batched_layout([(0, num_blocks, size, dim)], size)
    block_damping = tf.fill([num_blocks], tf.cast(damping, tf.float32))
    return invert_damped(blocks, damped_diagonal(mask, block_damping), block_damping, previous,
                         retry_scale)


def invert_owned(blocks, damping, dim: int, owned, previous=None):
    """Inverses of the damped diagonal blocks a replica owns, zeros for the others.

    Args:
      blocks: ``[nb, d, d]`` float32 undamped diagonal blocks of one factor (see
        :func:`invert_blocks`).
      damping: scalar tensor, this factor's damping.
      dim: the factor's true dimension.
      owned: ``[nb]`` bool tensor: the blocks this replica inverts.
      previous: ``[nb, d, d]`` inverses in use (kept where a block cannot be inverted).

    Returns:
      ``[nb, d, d]``: the inverses of the owned blocks, zeros elsewhere, so that a SUM over
      replicas that own disjoint blocks gives every inverse. Only the owned blocks are inverted
      (gathered into one batch); under XLA (static shapes) all are, and the others masked.
    """
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    num_blocks, size = int(blocks.shape[0]), int(blocks.shape[-1])
    if previous is None:
        previous = tf.eye(size, batch_shape=[num_blocks], dtype=tf.float32)
    if _keras_compat.in_xla_context():
        inverse = invert_blocks(blocks, damping, dim, previous)
        return tf.where(owned[:, None, None], inverse, tf.zeros_like(inverse))
    _, mask, _ = batched_layout([(0, num_blocks, size, dim)], size)
    block_damping = tf.fill([num_blocks], tf.cast(damping, tf.float32))
    index = tf.where(owned)  # [k, 1]
    picked = [tf.gather_nd(t, index) for t in
              (blocks, damped_diagonal(mask, block_damping), block_damping, previous)]
    inverse = invert_damped(*picked)
    return tf.scatter_nd(index, inverse, [num_blocks, size, size])


def invert_damped(blocks, diagonal, block_damping, previous=None, retry_scale: float = 10.0):
    """Inverses of ``blocks + diag(diagonal)``: one batched Cholesky for blocks that may come
    from several factors (each with its own damping), the float64 retry for those that fail.

    Args:
      blocks: ``[B, d, d]`` float32 undamped diagonal blocks.
      diagonal: ``[B, d]`` what to add to each block's diagonal (:func:`damped_diagonal`).
      block_damping: ``[B]`` each block's damping (scales the retry's extra damping).
      previous: ``[B, d, d]`` inverses kept where even the retry fails (default: identity).
      retry_scale: how much the damping grows for the float64 retry.
    """
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    size = int(blocks.shape[-1])
    blocks = blocks + tf.linalg.diag(diagonal)
    inverse = _cholesky_inverse(blocks)
    ok = _finite_per_block(inverse)
    if previous is None:
        previous = tf.eye(size, batch_shape=tf.shape(blocks)[:1], dtype=tf.float32)

    def retry():
        blocks64 = tf.cast(blocks, tf.float64)
        # More damping, scaled to the block so that it helps whatever the factor's magnitude.
        mean_diag = tf.reduce_mean(tf.linalg.diag_part(blocks64), axis=-1)
        extra = retry_scale * tf.cast(block_damping, tf.float64) + 1e-6 * tf.abs(mean_diag) + 1e-12
        extra = tf.where(tf.math.is_finite(extra), extra, tf.ones_like(extra))
        boosted = blocks64 + extra[:, None, None] * tf.eye(size, dtype=tf.float64)
        inverse64 = tf.cast(_cholesky_inverse(boosted), tf.float32)
        ok64 = _finite_per_block(inverse64)
        fixed = tf.where(ok64[:, None, None], inverse64, previous)
        return tf.where(ok[:, None, None], inverse, fixed)

    return tf.cond(tf.reduce_all(ok), lambda: inverse, retry)


def invert_selected(blocks, in_use, mask, damping, selected):
    """``in_use`` with the ``selected`` blocks replaced by the inverses of ``blocks`` damped.

    Args:
      blocks: ``[B, d, d]`` undamped factor blocks; in_use: ``[B, d, d]`` their inverses in use.
      mask: ``[B, d]`` 1 on each block's true diagonal entries, 0 on padding (NumPy).
      damping: ``[B]`` each block's damping; selected: ``[B]`` bool.
    """
    if _keras_compat.in_xla_context():
        # XLA needs static shapes: all blocks are inverted when one is selected.
        diagonal = damped_diagonal(mask, damping)
        return tf.cond(tf.reduce_any(selected), lambda: tf.where(
            selected[:, None, None], invert_damped(blocks, diagonal, damping, in_use), in_use),
            lambda: in_use)
    due = tf.where(selected)  # [K, 1]
    chosen = tf.gather_nd(damping, due)
    diagonal = damped_diagonal(tf.gather_nd(mask, due), chosen)
    inverses = invert_damped(tf.gather_nd(blocks, due), diagonal, chosen, tf.gather_nd(in_use, due))
    return tf.tensor_scatter_nd_update(in_use, due, inverses)


def split_inverse(factor, damping, split_dim: int, previous=None):
    """Split inverse of a dense ``[n, n]`` factor: :func:`invert_blocks` of its diagonal blocks.

    Args:
      factor: ``[n, n]`` float32 symmetric PSD factor (undamped).
      damping: scalar, added to the diagonal.
      split_dim: block size (see :func:`split_layout`).
      previous: see :func:`invert_blocks`.

    Returns:
      ``[nb, d, d]`` inverses of the damped diagonal blocks (for calibration and tests; training
      calls :func:`invert_blocks` on blocks it computed directly).
    """
    factor = tf.convert_to_tensor(factor, tf.float32)
    n = int(factor.shape[-1])
    return invert_blocks(diagonal_blocks(factor, split_dim), damping, n, previous=previous)


def precondition_gradients(blocks, rows_per_term, inverses, grads, variables, kl_clip=None,
                           learning_rate=None, use_grads=None):
    """Replace each block's kernel/bias gradients by its (KL-clipped) preconditioned gradient.

    Args:
      blocks: the blocks active in this step (a record exists for each).
      rows_per_term: ``{block name: c}`` (float32 scalars): the block's rows per data point of
        the loss (``P`` for one term per example; :mod:`thor_tf.loss_terms`).
      inverses: ``{block name: (A_inv, G_inv)}`` split inverses (tensors or variables).
      grads: gradients aligned with ``variables`` (None where a variable has none).
      variables: the trainable variables.
      kl_clip: κ, or None for no clip.
      learning_rate: the step's learning rate (for the clip).
      use_grads: ``{block name: gradient}`` for blocks that take a part of their variable's
        gradient (a tied embedding's two uses); their updates are summed into the variable's.

    Returns:
      ``(grads, ν)``: the new gradient list (variables without a block keep theirs) and the clip
      scale (float32 scalar tensor; None without a clip or without a usable block).
    """
    gathered = block_matrices.gather(blocks, grads, variables, use_grads)
    if not gathered:
        return grads, None
    matrices, operators = [], []
    for b, _, matrix in gathered:
        matrices.append(matrix)
        a_inv, g_inv = inverses[b.name]
        operators.append(KroneckerOperator(
            BlockDiagonal(tf.convert_to_tensor(a_inv), b.a_dim),
            BlockDiagonal(tf.convert_to_tensor(g_inv), b.g_dim),
            scale=1.0 / rows_per_term[b.name]))
    updates = apply_blockwise(operators, matrices)
    nu = None
    if kl_clip is not None:
        nu = kl_scale(updates, matrices, kl_clip, learning_rate)
        updates = [nu * u for u in updates]
    out, _ = block_matrices.scatter(
        grads, variables, [(b, k, u) for (b, k, _), u in zip(gathered, updates)])
    return out, nu


def kl_scale(updates, matrices, kappa, learning_rate):
    """``ν = min(1, sqrt(κ / (lr²·Σ⟨Δ, M⟩)))`` (1 where that is not finite)."""
    lr = tf.cast(learning_rate, tf.float32)
    predicted = tf.square(lr) * inner_product(updates, matrices)
    nu = tf.minimum(1.0, tf.sqrt(kappa / tf.maximum(predicted, 1e-30)))
    return tf.where(tf.math.is_finite(nu), nu, tf.ones_like(nu))
