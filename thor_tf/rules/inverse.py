"""``Inverse``: THOR's rule. ``Δ = (1/c)·A_inv·M·G_inv`` from the damped split inverses, K-FAC's
KL clip, then (in THOR's order) weight decay, per-tensor clip and momentum.

The inverses are refreshed with the factors: the refreshing layers' diagonal blocks of similar
sizes are inverted in one batched Cholesky (:func:`thor_tf.rules.inverse_ops.invert_selected`),
or, with ``inverse_assignment="balanced"`` under a multi-replica strategy, each block by the
replica it is assigned to and shared with one packed all-reduce. Its maths (the split inversion,
the step and the KL clip) is :mod:`thor_tf.rules.inverse_ops`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from keras import ops

from thor_tf import _keras_compat, distributed
from thor_tf.buckets import per_size_bucket
from thor_tf.rules.inverse_ops import (DAMPING_SPLITS, factor_dampings, invert_blocks, invert_owned,
                                       invert_selected,
                                       precondition_gradients)
from thor_tf.block_diagonal import BlockDiagonal
from thor_tf.split.information import loss_fractions
from thor_tf.rules.base import (SideWork, SplitCost, UpdateRule, keras_serializable, side_matrix,
                                split_blocks)


def identity_blocks(num_blocks, size):
    """A Keras initializer of ``num_blocks`` identity ``[size, size]`` blocks."""
    def init(shape=None, dtype=None):
        return tf.eye(size, batch_shape=[num_blocks], dtype=dtype or "float32")

    return init


@dataclasses.dataclass
class LayerFactors:
    """One block's factors and split inverses (optimizer variables)."""

    A: object
    A_inv: object
    G: object
    G_inv: object

    def shapes(self):
        """``(A's shape, G's shape)`` as tuples (the inverses have the same)."""
        return tuple(tuple(int(d) for d in v.shape) for v in (self.A, self.G))


@keras_serializable
class Inverse(UpdateRule):
    """THOR's inverse rule (the module docstring).

    Args (the rule's own options; ``wrap`` / ``ThorOptimizer`` also take them by name and hand
    them here, so ``thor_tf.wrap(model, update_rule="inverse", kl_clip=None)`` is
    ``update_rule=Inverse(kl_clip=None)``):
      momentum: μ in ``v = μ v + Δ``, in [0, 1).
      damping_split: how a block's damping ``λ_b = λ/P`` is shared between its factors:
        ``"sqrt"`` (THOR's): A and G each get ``√λ_b``; ``"pi"``: the π-adjusted factored
        Tikhonov damping of Martens & Grosse (2015, §6.3), as kfac-jax does: ``A + π·√λ_b·I``
        and ``G + (√λ_b/π)·I`` with ``π = √((tr A/dim A) / (tr G/dim G))`` of the factors being
        inverted (1 where that is not finite or is 0).
      kl_clip: κ of K-FAC's trust region: the preconditioned gradients are scaled by
        ``min(1, sqrt(κ / (lr²·⟨Δ, ∇⟩)))``; None turns it off.
      inverse_assignment: under a strategy with several replicas, ``"all"``: every replica
        inverts every refreshing layer (no communication of inverses); ``"balanced"``: each
        diagonal block of each refreshing layer is inverted by one replica (longest-processing-
        time over all blocks by their cost ``d³``) and one packed all-reduce shares the
        inverses. Both give the same step.

    ``damping`` (λ) stays ``ThorOptimizer``'s: it is also the trace rule's, under every rule.
    """

    name = "inverse"
    default_learning_rate = 0.05
    uses_damping = True
    DAMPING_SPLITS = DAMPING_SPLITS
    INVERSE_ASSIGNMENTS = ("all", "balanced")

    def __init__(self, momentum=0.9, damping_split="sqrt", kl_clip=0.001,
                 inverse_assignment="all"):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
                0 <= momentum < 1):
            raise ValueError(f"`momentum` must be a float in [0, 1); got {momentum!r}.")
        if not isinstance(damping_split, str) or damping_split not in self.DAMPING_SPLITS:
            raise ValueError(f"`damping_split` must be one of {list(self.DAMPING_SPLITS)}; "
                             f"got {damping_split!r}.")
        if kl_clip is not None and (isinstance(kl_clip, bool) or not isinstance(
                kl_clip, (int, float)) or not kl_clip > 0):
            raise ValueError(f"`kl_clip` must be None or a float > 0; got {kl_clip!r}.")
        if (not isinstance(inverse_assignment, str)
                or inverse_assignment not in self.INVERSE_ASSIGNMENTS):
            raise ValueError(f"`inverse_assignment` must be one of "
                             f"{list(self.INVERSE_ASSIGNMENTS)}; got {inverse_assignment!r}.")
        self.momentum, self.damping_split = float(momentum), damping_split
        self.kl_clip = None if kl_clip is None else float(kl_clip)
        self.inverse_assignment = inverse_assignment

    def get_config(self):
        return {"momentum": self.momentum, "damping_split": self.damping_split,
                "kl_clip": self.kl_clip, "inverse_assignment": self.inverse_assignment}

    def create_layer_state(self, optimizer, block, prefix, layout_a, layout_g):
        made = {}
        for factor, (nb, size) in zip(("A", "G"), (layout_a, layout_g)):
            # float32 whatever floatx is: every statistic is computed in float32.
            made[factor] = optimizer.add_variable((nb, size, size), dtype="float32",
                                                  name=f"{prefix}_{factor}")
            made[factor + "_inv"] = optimizer.add_variable(
                (nb, size, size), initializer=identity_blocks(nb, size), dtype="float32",
                name=f"{prefix}_{factor}_inv")
        return LayerFactors(**made)

    # -- refresh -----------------------------------------------------------------------------------
    def refresh(self, step, layers, refresh, factors, damping):
        if (distributed.replica_context() is not None
                and self.inverse_assignment == "balanced"):
            inverses = self._shared_inverses(step, layers, refresh, factors, damping)
        else:
            inverses = self._batched_inverses(step, layers, refresh, factors, damping)
        state = step.state
        for layer, (ia, ig) in zip(layers, inverses):
            held = state.layers[layer.index]
            held.A_inv.assign(ia)
            held.G_inv.assign(ig)

    def _batched_inverses(self, step, layers, refresh, factors, damping):
        """Split inverses of the refreshing layers' damped factors, one batched inversion per
        bucket of block sizes (:func:`thor_tf.buckets.size_buckets`: sizes within 0.75× of a
        larger one are padded to it, identity on the padding).

        The diagonal blocks of a bucket's sizes of every layer's A and G form one batch;
        the blocks of the refreshing layers are gathered, inverted together
        (:func:`thor_tf.rules.inverse_ops.invert_damped`: one Cholesky, each block with its factor's damping
        on its true diagonal, 1 on padding: ``√(λ/P)``, or with ``damping_split="pi"`` π·√(λ/P)
        for A and √(λ/P)/π for G, :meth:`_factor_dampings`) and scattered over the inverses in
        use. No branch: with no layer refreshing the gathered batch is empty. A handful of ops per
        bucket, where a cond per layer (or per size) made tracing and graph optimization grow with
        the model; sizes are not all padded to the largest (on the CNN that cost 9 ms per refresh
        of all blocks). Under XLA (static shapes) all blocks of a bucket are inverted when one of
        their layers refreshes, and the refreshing ones kept.

        Returns ``[(A_inv, G_inv)]`` aligned with ``layers``: the new inverses of refreshing
        layers, the ones in use for the others.
        """
        s = step.state
        factors_flat, dims, held, per_factor = [], [], [], []  # per factor: A, G, A, G, ...
        for layer, (fa, fg) in zip(layers, factors):
            state = s.layers[layer.index]
            factors_flat += [fa, fg]
            dims += [layer.block.a_dim, layer.block.g_dim]
            held += [(state.A_inv,), (state.G_inv,)]
            per_factor.extend(self._factor_dampings(layer, fa, fg, damping))
        per_factor = tf.stack(per_factor)
        flags = tf.repeat(tf.stack(refresh), 2)  # per factor

        def invert(blocks, mask, owner, in_use):
            return (invert_selected(blocks, in_use[0], mask, tf.gather(per_factor, owner),
                                    tf.gather(flags, owner)),)

        out = per_size_bucket(factors_flat, dims, held, invert)
        return [(out[2 * k][0], out[2 * k + 1][0]) for k in range(len(layers))]

    def _factor_dampings(self, layer, factor_a, factor_g, damping):
        """``(d_A, d_G)`` of one layer: its block damping ``λ/P`` split between the factors as
        ``damping_split`` says (:func:`thor_tf.rules.inverse_ops.factor_dampings`; ``"pi"`` reads π from
        the factors being inverted)."""
        return factor_dampings(damping / layer.rows_per_term, factor_a, factor_g,
                               layer.block.a_dim, layer.block.g_dim, self.damping_split)

    def _shared_inverses(self, step, layers, refresh, factors, damping):
        """``inverse_assignment="balanced"``: every diagonal block of every layer is inverted on
        one replica (longest-processing-time over all blocks, cost ``d³``:
        :func:`thor_tf.distributed.balanced_block_owners`; a layer is not the unit, so one large
        layer cannot hold the cut), zeros elsewhere; one packed SUM shares the inverses. Only
        refreshing layers' blocks are inverted. Returns ``[(A_inv, G_inv)]``: the new inverses of
        refreshing layers, those in use for the others."""
        state = step.state
        shapes = [state.layers[layer.index].shapes() for layer in layers]
        owners = distributed.balanced_block_owners(
            [[int(sh[1]) ** 3] * int(sh[0]) for pair in shapes for sh in pair],
            distributed.num_replicas())
        me = distributed.replica_id()
        local = []
        for k, (layer, flag, (fa, fg)) in enumerate(zip(layers, refresh, factors)):
            held = state.layers[layer.index]
            damp_a, damp_g = self._factor_dampings(layer, fa, fg, damping)
            pairs = ((fa, layer.block.a_dim, held.A_inv, owners[2 * k], damp_a),
                     (fg, layer.block.g_dim, held.G_inv, owners[2 * k + 1], damp_g))
            for factor, dim, previous, own, per_factor in pairs:
                owned = tf.logical_and(flag, tf.equal(tf.constant(own, tf.int32), me))
                local.append(invert_owned(factor, per_factor, dim, owned, previous))
        shared = distributed.sum_packed(local)
        out = []
        for k, (layer, flag) in enumerate(zip(layers, refresh)):
            held = state.layers[layer.index]
            out.append((tf.where(flag, shared[2 * k], held.A_inv),
                        tf.where(flag, shared[2 * k + 1], held.G_inv)))
        return out

    # -- precondition ------------------------------------------------------------------------------
    def precondition(self, step, active, rows_per_term, grads, variables, use_grads):
        """``(1/c)·A_inv·M·G_inv`` per block and the KL clip (:mod:`thor_tf.rules.inverse_ops`); the
        clip scale ν of a finite step is kept in ``counters()["kl_scale"]``."""
        s = step.state
        inverses = {}
        for b in active:
            layer = step.layer(b)
            inverses[b.name] = (layer.A_inv, layer.G_inv)
        out, nu = precondition_gradients(
            active, rows_per_term, inverses, grads, variables, kl_clip=self.kl_clip,
            learning_rate=step.learning_rate, use_grads=use_grads)
        if nu is not None:
            s.kl_scale.assign(tf.where(step.ok, nu, s.kl_scale))
        return out, ()  # every variable takes the same chain: nothing to mark

    # -- what a split costs and keeps -------------------------------------------------------------
    def split_cost(self):
        """:class:`InverseSplitCost`: the product by the split inverses, their Cholesky, the
        seed's information curve."""
        return InverseSplitCost()

    # -- the optimizer's chain ---------------------------------------------------------------------
    def build_slots(self, optimizer, var_list):
        """The momentum ``v`` of every variable."""
        return {"momentum": [optimizer.add_variable_from_reference(v, name="momentum")
                             for v in var_list]}

    def update_step(self, optimizer, gradient, variable, learning_rate):
        """``Δ + wd·w`` → per-tensor clip → ``v = μv + Δ``; ``w ← w − lr·v``."""
        config = optimizer.config
        lr = ops.cast(learning_rate, variable.dtype)
        update = ops.cast(gradient, variable.dtype)
        if config.weight_decay and _keras_compat.uses_weight_decay(optimizer, variable):
            update = update + ops.cast(config.weight_decay, variable.dtype) * variable
        if config.clip_norm is not None:
            update = tf.clip_by_norm(update, config.clip_norm)
        velocity = optimizer.slot("momentum", variable)
        new_velocity = self.momentum * velocity + update
        ok = optimizer.step_ok
        if ok is not None:
            # A skipped step keeps the velocity (a non-finite gradient never enters it) and
            # moves nothing: the learning rate is masked, a scalar, not every update.
            new_velocity = tf.where(ok, new_velocity, velocity)
            step = tf.where(ok, lr, tf.zeros_like(lr)) * new_velocity
        else:
            step = lr * new_velocity
        optimizer.assign(velocity, new_velocity)
        optimizer.assign_sub(variable, step)


class InverseSplitCost(SplitCost):
    """What a split costs the inverse rule and what it keeps (:meth:`Inverse.split_cost`);
    without a crossing the seed's choice, the largest split timed."""

    fallback = "largest"
    #: The damping a factor is timed with (``sqrt`` of the default λ = 0.03): it changes the
    #: time only where a Cholesky fails and takes the float64 retry.
    TIMING_DAMPING = 0.03 ** 0.5

    def side_work(self, factor, previous, split, other_dim, side):
        """Per step: the product of the gradient matrix by the side's split inverse
        (``A⁻¹ M`` or ``M G⁻¹``, :class:`thor_tf.block_diagonal.BlockDiagonal`). Per refresh: the
        damped blocks' batched Cholesky inverse with its float64 retry
        (:func:`thor_tf.rules.inverse_ops.invert_blocks`)."""
        del previous  # the inverse does not start from the one in use
        n = int(np.shape(factor)[0])
        matrix = side_matrix(n, other_dim, side)
        blocks, _ = split_blocks(factor, split)
        damping = tf.constant(self.TIMING_DAMPING, tf.float32)
        inverse = invert_blocks(blocks, damping, n)

        def product(m, inverse):
            operator = BlockDiagonal(inverse, n)
            return operator.matmul(m) if side == "A" else operator.rmatmul(m)

        return SideWork(step=(product, (matrix, inverse)),
                        refresh=(lambda b, d: invert_blocks(b, d, n), (blocks, damping)))

    def information_curve(self, pairs, cands):
        """The seed's curve: the fraction of the factors (each pair's first) whose information
        loss ``1 − ‖Â‖₂/‖A‖₂`` is below 1 %
        (:func:`thor_tf.split.information.loss_fractions`)."""
        return loss_fractions([f for f, _ in pairs], cands)
