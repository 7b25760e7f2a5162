"""Between the optimizer's variables and the blocks' matrices: the gather and the scatter.

Every update rule works on a block's gradient as one matrix ``M`` ``[a_dim, g_dim]`` (kernel and
bias together, the block's own layout: :meth:`thor_tf.blocks.base.KroneckerBlock.to_matrix`) and
returns its step in the same layout. Getting there from the gradient list aligned with the
optimizer's variables, and back, is the same for every rule and lives here once:

* :func:`gather`: ``[(block, k, M)]`` for the active blocks whose kernel has a gradient (``k`` the
  kernel's position in ``variables``); a bias without a gradient counts as zeros; a block in
  ``use_grads`` (a tied embedding's two uses) takes that part of its variable's gradient.
* :func:`scatter`: the gradient list with each block's kernel and bias gradients replaced by its
  step (cast to the kernel gradient's dtype); the steps of two blocks on one variable (the tied
  uses) are summed. Returns the positions written, which the rules leave to their own chain.
"""

from __future__ import annotations

import tensorflow as tf


def gather(blocks, grads, variables, use_grads=None):
    """``[(block, k, M)]``: each usable block's gradient matrix (see the module docstring).

    Args:
      blocks: the blocks active in this step.
      grads: gradients aligned with ``variables`` (None where a variable has none).
      variables: the trainable variables.
      use_grads: ``{block name: kernel gradient}`` for blocks that take a part of their
        variable's gradient, or None.
    """
    index = {id(v): k for k, v in enumerate(variables)}
    use_grads = use_grads or {}
    out = []
    for b in blocks:
        k = index[id(b.kernel)]
        if grads[k] is None:
            continue
        bias_grad = None
        if b.bias is not None:
            bias_grad = grads[index[id(b.bias)]]
            if bias_grad is None:
                bias_grad = tf.zeros_like(b.bias)
        out.append((b, k, b.to_matrix(use_grads.get(b.name, grads[k]), bias_grad)))
    return out


def scatter(grads, variables, steps):
    """``(out, written)``: ``grads`` with the blocks' steps in place of their gradients.

    Args:
      grads: gradients aligned with ``variables``.
      variables: the trainable variables.
      steps: ``[(block, k, step matrix)]`` (``k`` as :func:`gather` gives it).

    Returns:
      the new gradient list (variables without a block keep theirs) and the set of positions
      written (kernels and biases).
    """
    index = {id(v): k for k, v in enumerate(variables)}
    out, written = list(grads), set()
    for b, k, update in steps:
        kernel_update, bias_update = b.from_matrix(update)
        kernel_update = tf.cast(kernel_update, grads[k].dtype)
        out[k] = out[k] + kernel_update if k in written else kernel_update  # tied: summed
        written.add(k)
        if b.bias is not None:
            out[index[id(b.bias)]] = bias_update
            written.add(index[id(b.bias)])
    return out, written
