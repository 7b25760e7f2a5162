"""Preconditioning: the natural-gradient step of every block, then K-FAC's KL clip.

For a block with gradient matrix ``M`` (``[a_dim, g_dim]``, see :mod:`thor_tf.blocks.base`) and
split inverses ``A_inv`` ``[nb_a, d_a, d_a]`` and ``G_inv`` ``[nb_g, d_g, d_g]`` of its damped
factors, the preconditioned gradient is

    Δ = (1/c) · A_inv · M · G_inv

(``c = R/D`` the block's rows per data point of the loss: ``P`` positions per example for a loss
with one term per example, 1 for a per-token loss on a Transformer's ``[B, T]`` rows; see
:mod:`thor_tf.loss_terms`). The whole model's preconditioner is the block-diagonal
mat (:mod:`thor_tf.algebra`, seed 000's vec/mat algebra) of the blocks' Kronecker operators,
applied to the vec of all gradient matrices with ``mat_vec_prod``: no Kronecker product is formed
and no off-diagonal block is stored.

KL clip (Ba et al. 2017; kfac-pytorch's ``kl_clip``): the quadratic model of the KL change of a
step ``lr·Δ`` is ``lr²·Σ_l⟨Δ_l, M_l⟩``; all blocks are scaled by
``ν = min(1, sqrt(κ / (lr²·Σ_l⟨Δ_l, M_l⟩)))``, which keeps stale inverses (reused between
refreshes) from amplifying directions their batch did not see. The gradients must be the true
(unscaled) ones: the engine divides out any loss scale first.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf import algebra


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
    index = {id(v): k for k, v in enumerate(variables)}
    usable = [b for b in blocks if grads[index[id(b.kernel)]] is not None]
    if not usable:
        return grads, None
    matrices, operators = [], []
    for b in usable:
        bias_grad = grads[index[id(b.bias)]] if b.bias is not None else None
        if b.bias is not None and bias_grad is None:
            bias_grad = tf.zeros_like(b.bias)
        kernel_grad = (use_grads or {}).get(b.name, grads[index[id(b.kernel)]])
        matrices.append(b.to_matrix(kernel_grad, bias_grad))
        a_inv, g_inv = inverses[b.name]
        operators.append(algebra.KroneckerOperator(
            algebra.BlockDiagonal(tf.convert_to_tensor(a_inv), b.a_dim),
            algebra.BlockDiagonal(tf.convert_to_tensor(g_inv), b.g_dim),
            scale=1.0 / rows_per_term[b.name]))
    preconditioner = algebra.block_diagonal_mat(operators)
    updates = algebra.mat_vec_prod(preconditioner, matrices, mode="right")
    nu = None
    if kl_clip is not None:
        nu = kl_scale(updates, matrices, kl_clip, learning_rate)
        updates = [nu * u for u in updates]
    out, written = list(grads), set()
    for b, update in zip(usable, updates):
        kernel_update, bias_update = b.from_matrix(update)
        k = index[id(b.kernel)]
        kernel_update = tf.cast(kernel_update, grads[k].dtype)
        out[k] = out[k] + kernel_update if k in written else kernel_update  # tied: summed
        written.add(k)
        if b.bias is not None:
            out[index[id(b.bias)]] = bias_update
    return out, nu


def kl_scale(updates, matrices, kappa, learning_rate):
    """``ν = min(1, sqrt(κ / (lr²·Σ⟨Δ, M⟩)))`` (1 where that is not finite)."""
    lr = tf.cast(learning_rate, tf.float32)
    predicted = tf.square(lr) * algebra.vec_inner_prod(updates, matrices, mode="all")
    nu = tf.minimum(1.0, tf.sqrt(kappa / tf.maximum(predicted, 1e-30)))
    return tf.where(tf.math.is_finite(nu), nu, tf.ones_like(nu))
