"""An example update rule: K-FAC's step with damped split inverses on plain SGD."""
import tensorflow as tf

from thor_tf import block_matrices
from thor_tf.block_diagonal import BlockDiagonal
from thor_tf.rules.base import UpdateRule
from thor_tf.rules.inverse import InverseSplitCost, LayerFactors, identity_blocks
from thor_tf.rules.inverse_ops import invert_blocks


class KroneckerSGD(UpdateRule):
    """Per block ``Δ = (1/c)·(A + dI)⁻¹ M (G + dI)⁻¹`` with ``d = √(λ/c)`` (``c``: the block's rows
    per data point), each factor inverted on its split's diagonal blocks; ``w ← w − lr·Δ``, and
    ``w ← w − lr·∇w`` for the variables without a block."""

    name = "kronecker_sgd"
    default_learning_rate = 0.1
    uses_damping = True

    def create_layer_state(self, optimizer, block, prefix, layout_a, layout_g):
        made = {}
        for side, (nb, d) in zip(("A", "G"), (layout_a, layout_g)):
            made[side] = optimizer.add_variable((nb, d, d), dtype="float32",
                                                name=f"{prefix}_{side}")
            made[side + "_inv"] = optimizer.add_variable(
                (nb, d, d), initializer=identity_blocks(nb, d), dtype="float32",
                name=f"{prefix}_{side}_inv")
        return LayerFactors(**made)

    def build_slots(self, optimizer, var_list):
        return {}  # no per-variable state: no momentum

    def refresh(self, step, layers, refresh, factors, damping):
        for layer, flag, (fa, fg) in zip(layers, refresh, factors):
            held = step.state.layers[layer.index]
            d = tf.sqrt(damping / layer.rows_per_term)
            for inverse, factor, dim in ((held.A_inv, fa, layer.block.a_dim),
                                         (held.G_inv, fg, layer.block.g_dim)):
                inverse.assign(tf.where(flag, invert_blocks(factor, d, dim), inverse))

    def precondition(self, step, active, rows_per_term, grads, variables, use_grads):
        steps = []
        for b, k, m in block_matrices.gather(active, grads, variables, use_grads):
            held = step.layer(b)
            a_inv = BlockDiagonal(tf.convert_to_tensor(held.A_inv), b.a_dim)
            g_inv = BlockDiagonal(tf.convert_to_tensor(held.G_inv), b.g_dim)
            steps.append((b, k, g_inv.rmatmul(a_inv.matmul(m)) / rows_per_term[b.name]))
        return block_matrices.scatter(grads, variables, steps)  # (gradients, marked)

    def update_step(self, optimizer, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        if optimizer.step_ok is not None:  # a skipped step (non-finite batch) changes nothing
            lr = tf.where(optimizer.step_ok, lr, tf.zeros_like(lr))
        optimizer.assign_sub(variable, lr * tf.cast(tf.convert_to_tensor(gradient),
                                                    variable.dtype))

    def split_cost(self):
        return InverseSplitCost()  # the inverse rule's work and information
