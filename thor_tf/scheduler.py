"""Cadence and the trace rule: when a layer's Kronecker block is refreshed, reused or frozen.

Everything here is tensor arithmetic usable inside the one traced train step: decisions are boolean
tensors, never Python branches.

Cadence
-------
A cadence point is due when ``step >= next_cadence_step``; after it, ``next_cadence_step = step +
interval`` where ``interval`` comes from the ``frequency`` option (an int, a list of
``(epoch, interval)`` pairs, or a callable of the step). Step 0 is always a cadence point. A cadence
point skipped because its batch was non-finite is simply taken at the next finite step.

Trace rule (THOR)
-----------------
At a cadence point every layer that is not frozen compares the damped block it would build now with
the damped block it is using (the last refreshed one), through their traces::

    T(A, G) = tr(A + d_l·I) · tr(G + d_l·I) = (tr A + d_l·a_dim) · (tr G + d_l·g_dim)
    Δ = |T(A_new, G_new) − T(A_used, G_used)| / T(A_used, G_used)

with ``d_l = sqrt(λ / P_l)`` the per-factor damping of the layer (``P_l`` its positions per example,
see :mod:`thor_tf.blocks`), i.e. ``T`` is the trace of the Kronecker product of the two damped
factors that are actually inverted, ``tr((A + d I) ⊗ (G + d I))``. Both traces use the current
damping, so a damping schedule alone does not trigger refreshes. ``tr A`` and ``tr G`` come from the
captured rows without forming the factors (mean squared row norms).

* ``Δ > ω1``: refresh (new factors, new inverses);
* ``ω2 <= Δ <= ω1``: reuse the stored inverses;
* ``Δ < ω2``: freeze the block for the rest of training (no factor work at all any more).

A layer that has never been refreshed always refreshes (Δ is reported as +inf).

Trace smoothing (option ``trace_smoothing = s``, default 0): with small batches a single batch's
traces fluctuate by several percent, so Δ > ω1 = 0.01 mostly measures sampling noise. With s > 0
the "new" traces are a running estimate ``s·previous + (1 − s)·batch`` updated at every cadence
point of a non-frozen layer (two scalars per layer, no factor work), and the reference stored at a
refresh is that estimate, so Δ measures drift of the block rather than noise.
"""

from __future__ import annotations

import numbers

import tensorflow as tf

PRESETS = {
    "thor": (0.01, 0.0),
    "thor_stop": (0.01, 0.001),
    "thor_nt": (0.0, 0.0),
}


def damped_trace_product(trace_a, trace_g, damping, a_dim, g_dim):
    """``tr(A + d·I) · tr(G + d·I)`` for scalar traces and per-factor damping ``d``."""
    return (trace_a + damping * a_dim) * (trace_g + damping * g_dim)


def relative_trace_change(new_product, used_product, has_used):
    """``Δ = |new − used| / used``; +inf where the layer has no block in use yet."""
    delta = tf.abs(new_product - used_product) / tf.maximum(used_product, 1e-30)
    return tf.where(has_used, delta, tf.constant(float("inf"), delta.dtype))


def decide(delta, omega1, omega2):
    """``(refresh, freeze)`` booleans of THOR's rule; ``reuse`` is neither.

    refresh: Δ > ω1. freeze: Δ < ω2 (never for a layer without a block in use: Δ = inf).
    ω1 = 0 (THOR_NT) refreshes at every cadence point, even when Δ is exactly 0.
    """
    if omega1 <= 0:
        refresh = tf.ones_like(delta, dtype=tf.bool)
        return refresh, tf.logical_not(refresh)
    refresh = delta > omega1
    freeze = tf.logical_and(tf.logical_not(refresh), delta < omega2)
    return refresh, freeze


class CadenceSchedule:
    """The ``frequency`` option as a function ``(step, epoch) -> interval`` (int64 tensor).

    Accepted forms:
      * ``int >= 1``: a fixed interval (refreshes at steps 0, f, 2f, ...);
      * a list of ``(epoch, interval)`` pairs, epochs increasing from 0: the interval in force from
        that (0-based) epoch on, e.g. ``[(0, 10), (2, 50), (5, 200)]`` thins refreshes as training
        settles, as THOR does on ResNet-50;
      * a callable ``step -> interval`` (tensor in, tensor out).
    """

    def __init__(self, frequency):
        self.spec = frequency
        if isinstance(frequency, bool):
            raise ValueError(_frequency_error(frequency))
        if isinstance(frequency, numbers.Integral):
            if frequency < 1:
                raise ValueError(_frequency_error(frequency))
            self._pairs = [(0, int(frequency))]
            self._fn = None
        elif callable(frequency):
            self._pairs = None
            self._fn = frequency
        elif isinstance(frequency, (list, tuple)) and frequency:
            pairs = []
            for item in frequency:
                if (not isinstance(item, (list, tuple)) or len(item) != 2
                        or not all(isinstance(v, numbers.Integral) for v in item)):
                    raise ValueError(_frequency_error(frequency))
                pairs.append((int(item[0]), int(item[1])))
            epochs = [e for e, _ in pairs]
            if epochs[0] != 0 or epochs != sorted(set(epochs)) or min(i for _, i in pairs) < 1:
                raise ValueError(_frequency_error(frequency))
            self._pairs = pairs
            self._fn = None
        else:
            raise ValueError(_frequency_error(frequency))

    @property
    def is_constant(self):
        return self._pairs is not None and len(self._pairs) == 1

    def interval(self, step, epoch):
        """Interval (int64 scalar tensor) in force at ``step`` / 0-based ``epoch``."""
        if self._fn is not None:
            return tf.maximum(tf.cast(self._fn(step), tf.int64), 1)
        epoch = tf.cast(epoch, tf.int64)
        value = tf.constant(self._pairs[0][1], tf.int64)
        for start, interval in self._pairs[1:]:
            value = tf.where(epoch >= start, tf.constant(interval, tf.int64), value)
        return value

    def get_config(self):
        if self._fn is not None:
            return None  # callables do not serialize; documented
        if self.is_constant:
            return self._pairs[0][1]
        return [list(p) for p in self._pairs]


def _frequency_error(value):
    return (
        f"`frequency` must be an int >= 1, a list of (epoch, interval) pairs with epochs starting "
        f"at 0 and increasing and intervals >= 1, or a callable step -> interval; got {value!r}."
    )
