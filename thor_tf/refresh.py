"""Refreshing blocks at a cadence point: factors → (combined over replicas) → inverses → state.

:class:`Refresher` holds the refresh half of the engine's step (:mod:`thor_tf.engine` decides
who refreshes): it computes the factors of the refreshing layers only (a ``tf.cond`` per layer, or
one ``tf.map_fn`` per group of layers with the same factor graph), combines them over replicas
under a strategy, blends and checks them (``factor_decay``, non-finite factors keep the old ones),
inverts them in batches of similar block sizes (or, with ``inverse_assignment="balanced"``, each
layer on the replica it is assigned to) and writes factors, inverses and used traces.

Every method works on the engine's state (:class:`thor_tf.state.ThorState`) and config, over a
list of ``_CadenceLayer`` (one per active block: index, block, records, output gradients, P).
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf import capture, distributed
from thor_tf.inverse import (batched_layout, factor_dampings, invert_owned, invert_selected,
                             pad_blocks, size_buckets)


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
        one packed collective makes them the global batch's. Inversion is batched
        (:meth:`_batched_inverses`): the refreshing layers' blocks of similar sizes are inverted
        in one batched Cholesky (``inverse_assignment="balanced"``: each diagonal block is inverted by
        the replica it is assigned to, one more packed collective shares them).
        """
        if distributed.replica_context() is None:
            local = self._local_factors_where(layers, refresh)
            factors = self._refreshed_factors(layers, refresh, local)
            self._install(layers, refresh, factors, self._batched_inverses(
                layers, refresh, factors, damping))
            return

        def exchange():
            local = self._local_factors_where(layers, refresh)
            # Per layer its valid rows under a masked loss (A's and G's), else the examples.
            weights = [w for w in weight for _ in range(2)] if isinstance(weight, list) else weight
            combined = distributed.weighted_mean([f for pair in local for f in pair], weights)
            factors = self._refreshed_factors(
                layers, refresh, [(combined[2 * k], combined[2 * k + 1]) for k in range(len(layers))])
            if self.config.inverse_assignment == "balanced":
                inverses = self._shared_inverses(layers, refresh, factors, damping)
            else:
                inverses = self._batched_inverses(layers, refresh, factors, damping)
            self._install(layers, refresh, factors, inverses)

        distributed.run_if(tf.reduce_any(tf.stack(refresh)), exchange)

    def _refreshed_factors(self, layers, refresh, new):
        """``[(A, G)]`` after this point: the batch's factors ``new`` in use (blended, checked)
        for the refreshing layers, the factors in use for the others."""
        out = []
        for layer, flag, (fa, fg) in zip(layers, refresh, new):
            out.append(tuple(tf.where(flag, fresh, now) for fresh, now in
                             zip(self._factors_in_use(layer, fa, fg), self._factors_now(layer))))
        return out

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
        return [(stacked[0][i], stacked[1][i]) for i in range(count)]

    def _factors_now(self, layer):
        """The factors in use (``(A, G)`` tensors): what a layer that does not refresh keeps."""
        state = self.state.layers[layer.index]
        return tf.identity(state.A), tf.identity(state.G)

    def _local_factors(self, layer):
        """This replica's diagonal factor blocks ``(A [nb, d, d], G [nb, d, d])``."""
        split = self.config.split_dim
        if layer.masks is not None:  # a masked loss: the valid rows only
            return (layer.block.factor_a(layer.records, split, masks=layer.masks),
                    layer.block.factor_g(layer.grads, split, masks=layer.masks))
        return (layer.block.factor_a(layer.records, split),
                layer.block.factor_g(layer.grads, split))

    def _factors_in_use(self, layer, factor_a, factor_g):
        """The batch's factors blended with the old ones (``factor_decay``); a non-finite factor
        (e.g. a sampled-Fisher overflow) keeps the one in use."""
        s, i, beta = self.state, layer.index, self.config.factor_decay
        if beta > 0:
            has_used = s.refreshes[i] > 0
            factor_a = tf.where(has_used, beta * s.layers[i].A + (1 - beta) * factor_a, factor_a)
            factor_g = tf.where(has_used, beta * s.layers[i].G + (1 - beta) * factor_g, factor_g)
        factor_a = tf.where(tf.reduce_all(tf.math.is_finite(factor_a)), factor_a, s.layers[i].A)
        factor_g = tf.where(tf.reduce_all(tf.math.is_finite(factor_g)), factor_g, s.layers[i].G)
        return factor_a, factor_g

    def _batched_inverses(self, layers, refresh, factors, damping):
        """Split inverses of the refreshing layers' damped factors, one batched inversion per
        bucket of block sizes (:func:`thor_tf.inverse.size_buckets`: sizes within 0.75× of a
        larger one are padded to it, identity on the padding).

        The diagonal blocks of a bucket's sizes of every layer's A and G form one batch;
        the blocks of the refreshing layers are gathered, inverted together
        (:func:`thor_tf.inverse.invert_damped`: one Cholesky, each block with its factor's damping
        on its true diagonal, 1 on padding: ``√(λ/P)``, or with ``damping_split="pi"`` π·√(λ/P)
        for A and √(λ/P)/π for G, :meth:`_factor_dampings`) and scattered over the inverses in use. No
        branch: with no layer refreshing the gathered batch is empty. A handful of ops per bucket,
        where a cond per layer (or per size) made tracing and graph optimization grow with the
        model; sizes are not all padded to the largest (on the CNN that cost 9 ms per refresh of
        all blocks). Under XLA (static shapes) all blocks of a bucket are inverted when one of
        their layers refreshes, and the refreshing ones kept.

        Returns ``[(A_inv, G_inv)]`` aligned with ``layers``: the new inverses of refreshing layers,
        the ones in use for the others.
        """
        s = self.state
        entries = []  # (layer position, factor [nb, d, d], true dim, inverse in use): A, G, A, ...
        per_factor = []  # entry n's damping (A: 2k, G: 2k + 1)
        for k, (layer, (fa, fg)) in enumerate(zip(layers, factors)):
            held = s.layers[layer.index]
            entries.append((k, fa, layer.block.a_dim, held.A_inv))
            entries.append((k, fg, layer.block.g_dim, held.G_inv))
            per_factor.extend(self._factor_dampings(layer, fa, fg, damping))
        per_factor = tf.stack(per_factor)
        flags = tf.repeat(tf.stack(refresh), 2)  # per entry
        sizes = [int(factor.shape[-1]) for _, factor, _, _ in entries]
        pairs = [[None, None] for _ in layers]
        for size, joined in sorted(size_buckets(sizes).items()):
            members = [n for n, d in enumerate(sizes) if d in joined]
            group = [entries[n] for n in members]
            owner, mask, counts = batched_layout(  # owner: the entry (factor) of each block
                [(n, int(f.shape[0]), int(f.shape[-1]), dim)
                 for n, (_, f, dim, _) in zip(members, group)], size)
            blocks = tf.concat([pad_blocks(f, size) for _, f, _, _ in group], axis=0)  # [B, S, S]
            in_use = tf.concat([pad_blocks(inv, size) for _, _, _, inv in group], axis=0)
            out = invert_selected(blocks, in_use, mask, tf.gather(per_factor, owner),
                                   tf.gather(flags, owner))
            for n, part in zip(members, tf.split(out, counts)):
                d = sizes[n]
                pairs[entries[n][0]][n % 2] = part[:, :d, :d] if d < size else part
        return [tuple(pair) for pair in pairs]

    def _factor_dampings(self, layer, factor_a, factor_g, damping):
        """``(d_A, d_G)`` of one layer: its block damping ``λ/P`` split between the factors as
        ``damping_split`` says (:func:`thor_tf.inverse.factor_dampings`; ``"pi"`` reads π from
        the factors being inverted)."""
        return factor_dampings(damping / layer.rows_per_term, factor_a, factor_g, layer.block.a_dim,
                               layer.block.g_dim, self.config.damping_split)

    def _install(self, layers, refresh, factors, inverses):
        """Write the refreshing layers' factors, inverses and used traces (``factors`` and
        ``inverses`` of the other layers are those in use: writing them changes nothing)."""
        s = self.state
        traces_a, traces_g = [], []
        for layer, (fa, fg), (ia, ig) in zip(layers, factors, inverses):
            held = s.layers[layer.index]
            held.A.assign(fa)
            held.G.assign(fg)
            held.A_inv.assign(ia)
            held.G_inv.assign(ig)
            traces_a.append(tf.reduce_sum(tf.linalg.diag_part(fa)))
            traces_g.append(tf.reduce_sum(tf.linalg.diag_part(fg)))
        index = tf.constant([[layer.index] for layer in layers], tf.int64)
        flags = tf.stack(refresh)
        for variable, new in ((s.trace_a, traces_a), (s.trace_g, traces_g)):
            old = tf.gather(tf.convert_to_tensor(variable), index[:, 0])
            variable.assign(tf.tensor_scatter_nd_update(
                tf.convert_to_tensor(variable), index, tf.where(flags, tf.stack(new), old)))

    def _shared_inverses(self, layers, refresh, factors, damping):
        """``inverse_assignment="balanced"``: every diagonal block of every layer is inverted on
        one replica (longest-processing-time over all blocks, cost ``d³``:
        :func:`thor_tf.distributed.balanced_block_owners`; a layer is not the unit, so one large
        layer cannot hold the cut), zeros elsewhere; one packed SUM shares the inverses. Only
        refreshing layers' blocks are inverted. Returns ``[(A_inv, G_inv)]``: the new inverses of
        refreshing layers, those in use for the others."""
        shapes = [self.state.layers[layer.index].shapes() for layer in layers]
        owners = distributed.balanced_block_owners(
            [[int(sh[1]) ** 3] * int(sh[0]) for pair in shapes for sh in pair],
            distributed.num_replicas())
        me = distributed.replica_id()
        local = []
        for k, (layer, flag, (fa, fg)) in enumerate(zip(layers, refresh, factors)):
            held = self.state.layers[layer.index]
            damp_a, damp_g = self._factor_dampings(layer, fa, fg, damping)
            pairs = ((fa, layer.block.a_dim, held.A_inv, owners[2 * k], damp_a),
                     (fg, layer.block.g_dim, held.G_inv, owners[2 * k + 1], damp_g))
            for factor, dim, previous, own, per_factor in pairs:
                owned = tf.logical_and(flag, tf.equal(tf.constant(own, tf.int32), me))
                local.append(invert_owned(factor, per_factor, dim, owned, previous))
        shared = distributed.sum_packed(local)
        out = []
        for k, (layer, flag) in enumerate(zip(layers, refresh)):
            held = self.state.layers[layer.index]
            out.append((tf.where(flag, shared[2 * k], held.A_inv),
                        tf.where(flag, shared[2 * k + 1], held.G_inv)))
        return out

    def inversion_cost(self, i):
        """Flops-proportional cost of inverting block ``i``'s factors: ``Σ nb·d³``."""
        return float(sum(int(sh[0]) * int(sh[1]) ** 3 for sh in self.state.layers[i].shapes()))
