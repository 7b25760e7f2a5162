"""THOR's curvature state as named objects, created on (and saved with) the optimizer.

* per block, the update rule's layer state (:mod:`thor_tf.rules`): ``A`` ``[nb_a, d_a, d_a]``
  and ``G`` ``[nb_g, d_g, d_g]`` (the diagonal blocks of the undamped factors in use: the only
  part the split inverse or eigendecomposition needs, so the only part computed), and the
  rule's products: split inverses (:class:`LayerFactors`, the inverse rule) or bases,
  eigenvalues and moments (the eigenbasis rule).
* :class:`ThorState`: the layers' factors, then one vector per statistic with one entry per block
  (vectors, so a cadence point writes every layer's decision in one assignment): traces of the
  factors in use, the trace filter (a :class:`~thor_tf.trace_rule.FilterState` of vectors), the
  count of consecutive Δ < ω2 (``calm``), last Δ, refresh / reuse counts, frozen flag and step,
  last refresh step; and the model-wide scalars: next cadence step, cadence points, non-finite
  steps, epoch, cadence interval, non-finite traces, the last KL-clip scale ν; then the rule's
  model-wide state, if it has one.

Variables are created in a fixed order with fixed names (checkpoints match by them).
"""

from __future__ import annotations

import dataclasses
from typing import List

import keras
import tensorflow as tf

from thor_tf import trace_rule
from thor_tf.block_diagonal import split_layout
from thor_tf.rules import inverse as inverse_rule


def variable_name(block_name):
    """A block name as Keras accepts it in a variable name (layer paths have '/')."""
    return block_name.replace("/", "__")


# One block's factors and split inverses under the inverse rule (kept here for older imports).
LayerFactors = inverse_rule.LayerFactors


#: Model-wide scalars (int64 unless noted) in creation order: attribute -> (variable name, initial).
COUNTERS = {
    "next_cadence": ("thor_next_cadence_step", 0),
    "cadence_points": ("thor_cadence_points", 0),
    "nonfinite_steps": ("thor_nonfinite_steps", 0),
    "epoch": ("thor_epoch", 0),
    "interval": ("thor_interval", None),  # the cadence's base interval
    "nonfinite_traces": ("thor_nonfinite_traces", 0),
}


@dataclasses.dataclass
class ThorState:
    """Everything THOR keeps between steps (see the module docstring)."""

    layers: List[object]  # the rule's layer states (each has A, G, shapes())
    trace_a: object
    trace_g: object
    filter: trace_rule.FilterState
    calm: object
    last_delta: object
    refreshes: object
    reuses: object
    frozen: object
    frozen_at: object
    last_refresh: object
    next_cadence: object
    cadence_points: object
    nonfinite_steps: object
    epoch: object
    interval: object
    nonfinite_traces: object
    kl_scale: object
    #: The update rule's model-wide state (:meth:`thor_tf.rules.UpdateRule.create_model_state`).
    rule_state: object = None

    @classmethod
    def create(cls, optimizer, blocks, split_dim, interval_base, rule=None):
        """Add the state's variables to ``optimizer`` (inside its ``build``); the per-block
        factors and products are the update rule's (:meth:`thor_tf.rules.UpdateRule.
        create_layer_state`; the inverse rule when ``rule`` is None)."""
        rule = rule or inverse_rule.Inverse()
        n = len(blocks)
        layers = []
        for b in blocks:
            layouts = [split_layout(dim, size)
                       for dim, size in zip((b.a_dim, b.g_dim), b.split_sizes(split_dim))]
            layers.append(rule.create_layer_state(optimizer, b, variable_name(b.name), *layouts))

        def vector(name, dtype, value):
            return optimizer.add_variable(
                (n,), initializer=keras.initializers.Constant(value), dtype=dtype, name=name)

        def scalar(name, value):
            return optimizer.add_variable(
                (), initializer=keras.initializers.Constant(value), dtype="int64", name=name)

        trace_a = vector("thor_trace_a", "float32", 0.0)
        trace_g = vector("thor_trace_g", "float32", 0.0)
        window = optimizer.add_variable((n, trace_rule.TRACE_WINDOW), initializer="zeros",
                                        dtype="float32", name="thor_filter_window")
        trace_filter = trace_rule.FilterState(
            window=window,
            count=vector("thor_filter_count", "int64", 0),
            ref_mean=vector("thor_filter_ref_mean", "float32", 0.0),
            ref_count=vector("thor_filter_ref_count", "int64", 0),
            last=vector("thor_filter_last", "float32", 0.0),
            noise=vector("thor_filter_noise", "float32", 0.0),
            noise_count=vector("thor_filter_noise_count", "int64", 0))
        per_block = dict(
            calm=vector("thor_calm", "int64", 0),
            last_delta=vector("thor_last_delta", "float32", float("nan")),
            refreshes=vector("thor_refreshes", "int64", 0),
            reuses=vector("thor_reuses", "int64", 0),
            frozen=vector("thor_frozen", "int64", 0),
            frozen_at=vector("thor_frozen_at", "int64", -1),
            last_refresh=vector("thor_last_refresh", "int64", -1))
        counters = {attr: scalar(name, interval_base if initial is None else initial)
                    for attr, (name, initial) in COUNTERS.items()}
        kl_scale = optimizer.add_variable(
            (), initializer=keras.initializers.Constant(1.0), dtype="float32", name="thor_kl_scale")
        return cls(layers=layers, trace_a=trace_a, trace_g=trace_g, filter=trace_filter,
                   **per_block, **counters, kl_scale=kl_scale,
                   rule_state=rule.create_model_state(optimizer))

    def counters(self):
        """The model-wide scalars as Python numbers (host values)."""
        out = {attr: int(getattr(self, attr).numpy()) for attr in COUNTERS}
        out["kl_scale"] = float(self.kl_scale.numpy())
        return out


#: Decision codes of :class:`DecisionLog` (and ``TraceRuleLogger``'s names for them).
DECISION_CODES = {0: "frozen", 1: "reuse", 2: "refresh", 3: "freeze"}


class DecisionLog:
    """The last ``size`` cadence points' decisions, written inside the train step.

    ``TraceRuleLogger`` reads it between batches: with ``steps_per_execution > 1`` several cadence
    points pass between two reads, and each still gets its row. Telemetry, not training state:
    plain ``tf.Variable`` s on the engine, not saved with the optimizer. Row ``c % size`` holds
    cadence point ``c``: ``step`` and ``epoch`` ``[size]``; per block ``[size, n]``: ``code``
    (:data:`DECISION_CODES`), ``delta`` (Δ, NaN when not evaluated), cumulative ``refreshes`` and
    ``reuses``.
    """

    def __init__(self, num_blocks, size=64):
        self.size = int(size)

        def variable(shape, dtype, value=0):
            return tf.Variable(tf.fill(shape, tf.constant(value, dtype)), trainable=False,
                               aggregation=tf.VariableAggregation.NONE)

        n = max(int(num_blocks), 1)
        self.step = variable([self.size], tf.int64, -1)
        self.epoch = variable([self.size], tf.int64)
        self.code = variable([self.size, n], tf.int64)
        self.delta = variable([self.size, n], tf.float32, float("nan"))
        self.refreshes = variable([self.size, n], tf.int64)
        self.reuses = variable([self.size, n], tf.int64)

    def write(self, point, step, epoch, code, delta, refreshes, reuses):
        """Row ``point % size`` := this cadence point (tensors; ``[n]`` per block)."""
        # The row index as one tensor and each value's new axis by ExpandDims: a nested list
        # is packed again at each use and ``value[None]`` is a strided slice with three index
        # constants (the same values, ~25 ops fewer at each cadence point).
        row = tf.reshape(tf.cast(point, tf.int64) % self.size, [1, 1])
        for variable, value in ((self.step, step), (self.epoch, epoch), (self.code, code),
                                (self.delta, delta), (self.refreshes, refreshes),
                                (self.reuses, reuses)):
            value = tf.expand_dims(tf.cast(value, variable.dtype), 0)
            variable.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(variable), row,
                                                        value))

    def rows(self, first, last):
        """Host rows of cadence points ``first .. last-1`` (at most the last ``size``)."""
        arrays = {k: getattr(self, k).numpy() for k in
                  ("step", "epoch", "code", "delta", "refreshes", "reuses")}
        out = []
        for point in range(max(first, last - self.size), last):
            r = point % self.size
            out.append({k: v[r] for k, v in arrays.items()})
        return out
