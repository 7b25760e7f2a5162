"""A cadence point (:class:`CadencePoint`, one of :class:`~thor_tf.engine.ThorEngine`'s bases):
when one is due, the live layers' traces → combined over replicas → the trace rule's decision
per layer (:func:`thor_tf.trace_rule.judge`) → the refreshing layers' factors and the update
rule's products (:class:`thor_tf.refresh.Refresher`) → the decisions recorded; then the next
point is scheduled. Everything runs inside the traced step, as tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from thor_tf import capture, distributed, trace_rule


class CadenceLayer(NamedTuple):
    """What one active block brings to a cadence point (this replica's batch)."""

    index: int  # position in the engine's blocks (and state vectors)
    block: object  # the KroneckerBlock
    records: list  # [capture.Record] (first ``factor_examples`` examples when set)
    grads: list  # per-term dℓ/dz tensors aligned with ``records``
    rows_per_term: tf.Tensor  # c = R/D: rows per data point of the loss (KFC's P; float32 scalar)
    masks: object  # None, or per record None / [R_call] 0/1 row weights (valid terms)


def _rows_per_example(block, record):
    """Static mask rows per example of one call (``z``'s size past the batch over the block's
    ``mask_width``: ``g_dim`` but for a LoRA A side)."""
    return record.z.shape[1:].num_elements() // block.mask_width


def _valid_rows(block, records, masks):
    """float32 number of valid rows of ``block``'s calls: Σ mask (times ``mask_repeats``: a LoRA
    B side's rows are positions × heads), or all rows of a call without one."""
    return float(block.mask_repeats) * tf.add_n(
        [tf.reduce_sum(m) if m is not None
         else tf.cast(tf.size(r.z), tf.float32) / float(block.mask_width)
         for m, r in zip(masks, records)])


class CadencePoint:
    """The cadence-point half of the engine's step (a mixin: it uses the engine's ``optimizer``,
    ``state``, ``config``, ``blocks``, ``refresher`` and ``decision_log``)."""

    def curvature_step(self, active, records, ok, output_grads_fn, batch_size, rows_per_term,
                       masks):
        """At a due cadence point, apply the trace rule per layer and refresh where it says so.

        ``output_grads_fn()`` returns ``{block name: [per-term dℓ/dz, ...]}`` (empirical or
        sampled) of this replica's batch; it is called only inside the cadence branch.
        ``rows_per_term``: ``{block name: R/D}``; ``masks``: ``{block name: row masks or None}``
        (:mod:`thor_tf.loss_terms`). The stages
        (each identical on every replica; collectives only under a strategy, see
        :mod:`thor_tf.distributed`): traces of the live layers → combined over replicas →
        decisions → factors of the refreshing layers → combined → inverses → recorded.
        """
        opt = self.optimizer
        s = self.state
        step = tf.cast(opt.iterations, tf.int64)
        due = tf.logical_and(ok, step >= s.next_cadence)

        def cadence():
            layers, weight = self._cadence_inputs(active, records, output_grads_fn(), batch_size,
                                                  rows_per_term, masks)
            refreshed_any = tf.constant(False)
            if layers:
                damping = opt.current_damping()
                local = trace_rule.local_traces(s, layers)  # [n, 2]
                traces, = distributed.weighted_mean(
                    [local], [tf.stack(weight)[:, None]] if isinstance(weight, list) else weight)
                decisions = trace_rule.judge(s, self.config, layers, traces, damping, step)
                self.refresher.refresh(layers, tf.unstack(decisions.refresh, num=len(layers)), damping,
                              weight)
                refreshed_any = trace_rule.record_decisions(s, self.decision_log, len(self.blocks),
                                                            layers, decisions, step)
            if self.config.cadence.adaptive is not None:
                s.interval.assign(trace_rule.adapt_interval(
                    s.interval, refreshed_any, self.config.cadence.adaptive.base,
                    self.config.cadence.adaptive.max_interval))
            interval = self.config.cadence.interval(step, s.epoch, s.interval)
            s.interval.assign(interval)
            s.next_cadence.assign(step + interval)
            s.cadence_points.assign_add(1)

        distributed.run_if(due, cadence)

    def _cadence_inputs(self, active, records, output_grads, batch_size, rows_per_term, masks):
        """``([CadenceLayer per active block], weight)`` with ``factor_examples`` applied;
        ``weight`` is this replica's weight when the statistics are combined over replicas: the
        number of examples behind them (float32 scalar), or under a masked loss a list with each
        layer's valid rows (per layer: its traces' and then its factors')."""
        k = self.config.factor_examples
        examples = tf.cast(batch_size, tf.float32)
        if k is not None:
            # Statistics from the first examples of the batch only (K-FAC's sub-batch): the
            # batch order is random, and im2col + factor matmuls shrink in proportion.
            examples = tf.minimum(examples, float(k))
        layers = []
        for b in active:
            recs, gs, layer_masks = records[b.name], output_grads[b.name], masks[b.name]
            if k is not None:
                if layer_masks is not None:
                    layer_masks = [None if m is None else m[:k * _rows_per_example(b, r)]
                                   for m, r in zip(layer_masks, recs)]
                recs = [capture.Record(r.inputs[:k], r.z[:k]) for r in recs]
                gs = [g[:k] for g in gs]
            layers.append(CadenceLayer(self._block_index[b.name], b, recs, gs,
                                        rows_per_term[b.name], layer_masks))
        if any(layer.masks is not None for layer in layers):
            rows = [examples if layer.masks is None else _valid_rows(layer.block, layer.records,
                                                                    layer.masks)
                    for layer in layers]
            return layers, rows
        return layers, examples
