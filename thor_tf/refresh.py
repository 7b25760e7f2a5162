"""Refreshing blocks at a cadence point: factors → (combined over replicas) → inverses → state.

:class:`Refresher` holds the refresh half of the engine's step (:mod:`thor_tf.engine` decides
who refreshes): it computes the factors of the refreshing layers only (a ``tf.cond`` per layer, or
one ``tf.map_fn`` per group of layers with the same factor graph), combines them over replicas
under a strategy, blends and checks them (``factor_decay``, non-finite factors keep the old ones),
hands them to the update rule (:mod:`thor_tf.rules`: split inverses, or eigenbases, of the
refreshing layers' blocks, batched by block size) and writes factors and used traces.

Every method works on the engine's state (:class:`thor_tf.state.ThorState`) and config, over a
list of ``CadenceLayer`` (one per active block: index, block, records, output gradients, P).
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf import capture, distributed


class Refresher:
    """The refresh work of one :class:`~thor_tf.engine.ThorEngine` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def state(self):
        return self.engine.state

    @property
    def config(self):
        return self.engine.config

    def refresh(self, layers, refresh, damping, weight):
        """Refresh the layers whose decision says so: new factors, inverses and used traces.

        Factors are computed only for the refreshing layers (:meth:`_local_factors_where`: a
        ``tf.cond`` per layer, or per group of layers with the same factor graph; the others pass
        their factors in use through). Under a strategy, and only when some layer
        refreshes, each replica computes its batch's factors (zeros for the other layers) and
        one packed collective makes them the global batch's. The update rule then makes its
        products from them (:meth:`thor_tf.rules.UpdateRule.refresh`: split inverses in one
        batched Cholesky per bucket of block sizes, or one batched ``eigh`` per bucket), identical
        on every replica.
        """
        rule = self.config.rule
        if distributed.replica_context() is None:
            local = self._local_factors_where(layers, refresh)
            factors = self._refreshed_factors(layers, refresh, local)
            rule.refresh(self.engine.rule_step(), layers, refresh, factors, damping)
            self._install(layers, refresh, factors)
            return

        def exchange():
            local = self._local_factors_where(layers, refresh)
            # Per layer its valid rows under a masked loss (A's and G's), else the examples.
            weights = [w for w in weight for _ in range(2)] if isinstance(weight, list) else weight
            combined = distributed.weighted_mean([f for pair in local for f in pair], weights)
            factors = self._refreshed_factors(
                layers, refresh, [(combined[2 * k], combined[2 * k + 1]) for k in range(len(layers))])
            rule.refresh(self.engine.rule_step(), layers, refresh, factors, damping)
            self._install(layers, refresh, factors)

        distributed.run_if(tf.reduce_any(tf.stack(refresh)), exchange)

    def _refreshed_factors(self, layers, refresh, new):
        """``[(A, G)]`` after this point: the batch's factors ``new`` in use (blended, checked)
        for the refreshing layers, the factors in use for the others."""
        return [self._factors_in_use(layer, flag, fa, fg)
                for layer, flag, (fa, fg) in zip(layers, refresh, new)]

    def _local_factors_where(self, layers, refresh):
        """``[(A, G)]`` of this replica's batch for the refreshing layers, zeros for the others.

        Layers whose factor computations are the same graph (:meth:`_factor_groups`: e.g. the
        repeated convolutions of a ResNet stage) share one: their inputs are stacked and a
        ``tf.map_fn`` computes each refreshing member's factors with one traced body, under one
        cond on whether any member refreshes. Any other layer has a cond of its own. Either way
        only the refreshing layers' factors are computed; the graph grows with the number of
        distinct layer shapes rather than with depth.
        """
        out = [None] * len(layers)
        for members in self._factor_groups(layers):
            if len(members) == 1:
                k = members[0]
                layer, shapes = layers[k], self.state.layers[layers[k].index].shapes()
                out[k] = tf.cond(refresh[k], lambda layer=layer: self._local_factors(layer),
                                 lambda shapes=shapes: tuple(tf.zeros(sh) for sh in shapes))
                continue
            group = self._group_local_factors([layers[k] for k in members],
                                              tf.stack([refresh[k] for k in members]))
            for k, pair in zip(members, group):
                out[k] = pair
        return out

    @staticmethod
    def _factor_groups(layers):
        """Positions in ``layers`` grouped by factor graph: blocks with equal
        :meth:`~thor_tf.blocks.KroneckerBlock.factor_signature` and one call whose input and
        output gradient have the same static sizes past the batch axis and dtypes. A layer
        without a signature, with several calls or with dynamic sizes is a group of its own."""
        groups = {}
        for k, layer in enumerate(layers):
            signature, key = layer.block.factor_signature(), ("alone", k)
            if (signature is not None and layer.masks is None and len(layer.records) == 1
                    and len(layer.grads) == 1):
                x, g = layer.records[0].inputs, layer.grads[0]
                shapes = (x.shape[1:], g.shape[1:])
                if all(sh.is_fully_defined() for sh in shapes):
                    key = (signature, tuple(shapes[0]), x.dtype, tuple(shapes[1]), g.dtype)
            groups.setdefault(key, []).append(k)
        return list(groups.values())

    def _group_local_factors(self, members, flags):
        """``[(A, G)]`` per member of a factor group (:meth:`_factor_groups`), zeros for those
        whose ``flags`` entry is False."""
        first, count = members[0], len(members)
        shapes = self.state.layers[first.index].shapes()

        def compute():
            inputs = tf.stack([layer.records[0].inputs for layer in members])
            grads = tf.stack([layer.grads[0] for layer in members])

            def one(args):
                x, g, flag = args
                member = first._replace(records=[capture.Record(x, None)], grads=[g])
                return tf.cond(flag, lambda: self._local_factors(member),
                               lambda: tuple(tf.zeros(sh) for sh in shapes))

            return tf.map_fn(one, (inputs, grads, flags), fn_output_signature=tuple(
                tf.TensorSpec(sh, tf.float32) for sh in shapes))

        stacked = tf.cond(tf.reduce_any(flags), compute,
                          lambda: tuple(tf.zeros([count, *sh]) for sh in shapes))
        # One Unpack per factor, not a strided slice (and its three index constants) per member.
        return list(zip(tf.unstack(stacked[0], num=count), tf.unstack(stacked[1], num=count)))

    def _local_factors(self, layer):
        """This replica's diagonal factor blocks ``(A [nb, d, d], G [nb, d, d])``."""
        split = self.config.split_dim
        if layer.masks is not None:  # a masked loss: the valid rows only
            return (layer.block.factor_a(layer.records, split, masks=layer.masks),
                    layer.block.factor_g(layer.grads, split, masks=layer.masks))
        return (layer.block.factor_a(layer.records, split),
                layer.block.factor_g(layer.grads, split))

    def _factors_in_use(self, layer, flag, factor_a, factor_g):
        """The factors in use after this point: where ``flag`` (the layer refreshes), the batch's
        factors blended with the old ones (``factor_decay``), unless a factor is not finite
        (e.g. a sampled-Fisher overflow: it keeps the one in use); elsewhere those in use. One
        select per factor (the refresh flag and the finiteness together), the old factors read
        once."""
        s, i, beta = self.state, layer.index, self.config.factor_decay
        old_a, old_g = tf.convert_to_tensor(s.layers[i].A), tf.convert_to_tensor(s.layers[i].G)
        if beta > 0:
            has_used = s.refreshes[i] > 0
            factor_a = tf.where(has_used, beta * old_a + (1 - beta) * factor_a, factor_a)
            factor_g = tf.where(has_used, beta * old_g + (1 - beta) * factor_g, factor_g)
        take_a = tf.logical_and(flag, tf.reduce_all(tf.math.is_finite(factor_a)))
        take_g = tf.logical_and(flag, tf.reduce_all(tf.math.is_finite(factor_g)))
        return tf.where(take_a, factor_a, old_a), tf.where(take_g, factor_g, old_g)

    def _install(self, layers, refresh, factors):
        """Write the refreshing layers' factors and used traces (``factors`` of the other layers
        are those in use: writing them changes nothing)."""
        s = self.state
        traces_a, traces_g = [], []
        both_axes = tf.constant([0, 1])  # once, not an axis constant per trace
        for layer, (fa, fg) in zip(layers, factors):
            held = s.layers[layer.index]
            held.A.assign(fa)
            held.G.assign(fg)
            traces_a.append(tf.reduce_sum(tf.linalg.diag_part(fa), axis=both_axes))  # [nb, d]
            traces_g.append(tf.reduce_sum(tf.linalg.diag_part(fg), axis=both_axes))
        positions = [layer.index for layer in layers]
        flags = tf.stack(refresh)
        for variable, new in ((s.trace_a, traces_a), (s.trace_g, traces_g)):
            old = tf.convert_to_tensor(variable)
            if positions == list(range(int(old.shape[0]))):  # every block, in order: no scatter
                variable.assign(tf.where(flags, tf.stack(new), old))
                continue
            index = tf.constant([[k] for k in positions], tf.int64)
            variable.assign(tf.tensor_scatter_nd_update(
                old, index, tf.where(flags, tf.stack(new), tf.gather(old, positions))))

    def inversion_cost(self, i):
        """Flops-proportional cost of inverting block ``i``'s factors: ``Σ nb·d³``."""
        return float(sum(int(sh[0]) * int(sh[1]) ** 3 for sh in self.state.layers[i].shapes()))
