"""Cadence and the trace rule: when a layer's Kronecker block is refreshed, reused or frozen.

Everything here is tensor arithmetic usable inside the one traced train step: decisions are boolean
tensors, never Python branches. The filter functions work element-wise, on one layer's scalars or
on vectors (the engine's active layers at once; tests feed them synthetic trace sequences).

The engine's cadence point calls, in order: :func:`local_traces` (this replica's ``[tr A, tr G]``
per active layer), then, on the traces combined over replicas, :func:`judge` (the rule for every
active layer at once) and, after the refresh, :func:`record_decisions` (the decisions written into
the per-block state vectors and the decision log). :mod:`thor_tf.scheduler` re-exports the public
names of this module under their old home.

Cadence
-------
A cadence point is due when ``step >= next_cadence_step``; after it, ``next_cadence_step = step +
interval``. ``frequency`` gives the interval: an int, a list of ``(epoch, interval)`` pairs, a
callable of the step, or ``"adaptive"`` / :class:`AdaptiveCadence` (below). Step 0 is always a
cadence point. A cadence point skipped because its batch was non-finite is taken at the next finite
step.

Adaptive cadence (``frequency="adaptive"``, i.e. ``AdaptiveCadence(base=10, max_interval=80)``):
the interval starts at ``base``; after a cadence point where the rule refreshed no layer (every
evaluated layer reused or froze) it doubles, up to ``max_interval``; after a point with at least one
refresh it halves, down to ``base``. The interval is a state variable of the optimizer (saved with
it) updated inside the graph.

Trace rule (THOR, the seed's formula)
-------------------------------------
At a cadence point every layer that is not frozen compares the block it would build now with the
block in use (the last refreshed one) through the trace of the damped Kronecker block::

    T = tr(A ⊗ G + λ_b·I) = tr A · tr G + λ_b · a_dim · g_dim
    Δ = |T_new − T_used| / T_used

with ``λ_b = λ / P`` the block's damping (``P`` the positions per example, see
:mod:`thor_tf.blocks`; the engine's per-factor damping is ``d = √(λ/P)``, so ``λ_b = d²``). Both
sides use the current damping, so a damping schedule alone does not trigger refreshes. ``tr A`` and
``tr G`` are the mean squared row norms (no factor is formed).

* ``Δ > ω1``: refresh (new factors, new inverses);
* ``ω2 <= Δ <= ω1``: reuse the stored inverses;
* ``Δ < ω2``: freeze the block for the rest of training (no factor work any more).

A layer that has never been refreshed always refreshes (Δ is +inf). ω1 = 0 (THOR_NT) refreshes at
every cadence point. With ``max_block_age`` = N (steps), a block in use for N steps or more is
refreshed at the next cadence point whatever Δ says (the trace is blind to a change of a factor's
shape at a fixed trace: behind a LayerNorm, ``tr A`` hardly moves while A does).

Trace filter (option ``trace_filter``)
--------------------------------------
``"none"``: the rule as published. ``T_new`` is the current batch's (``trace_product``), ``T_used``
the refreshed batch's, and a single ``Δ < ω2`` freezes.

``"mean"`` (default): one batch's ``tr A · tr G`` is a noisy sample of the block's (3–15 % per
batch on the Fashion-MNIST CNN), far above ω1 = 1 %. Per layer the filter keeps, for
``r = tr A · tr G`` (undamped; the damping term is added at comparison time):

* the *reference* ``(m_ref, n_ref)``: the mean of the observations that produced the block in use
  and their number (at a refresh, the current window's mean and count);
* the *window*: the last ``min(n, W)`` observations since the last refresh (``W = TRACE_WINDOW``),
  mean ``m_w``; it restarts at every refresh, so a change right after a refresh is seen at once;
* a noise scale: the mean absolute relative successive difference ``|r_k − r_{k−1}| / r_{k−1}``
  over the layer's observations (``2σ/√π`` for independent observations of relative s.d. σ), a
  running mean over the last ~``NOISE_HORIZON`` of them, each capped at ``NOISE_CAP`` × the current
  mean so that a level shift barely raises it; a point is judged with the noise seen before it.

Then, with ``σ = noise·√π/2``, ``se = σ · m_ref · √(1/n_w + 1/n_ref)`` is the standard error of
``m_w − m_ref`` and::

    Δ = max(0, |m_w − m_ref| − z·se) / (m_ref + λ_b·a_dim·g_dim),   z = NOISE_Z

Both means are unbiased, so the difference estimates the real change of the block; the ``z·se``
term removes what sampling noise alone explains (it shrinks as the counts grow, to
``z·σ·√(2/W)`` with full windows, and is not applied before ``MIN_NOISE_SAMPLES`` noise samples
exist). A window that straddles a step has a mixed mean; if it becomes the reference, the next
points read the rest of the step, so a large step can cost two refreshes. A stationary noisy sequence reads
Δ ≈ 0; a step change of x reads ≈ x − z·se, i.e. ≈ x once x is large against the noise, within
``W`` cadence points (within one right after a refresh). Freezing is irreversible, so the filtered
rule freezes only after ``FREEZE_AFTER`` consecutive evaluated cadence points with Δ < ω2 (a
refresh or a Δ >= ω2 restarts the count).

A batch whose traces are not finite (an overflowing ``‖a‖²``) changes nothing: no decision, no
filter update, the traces in use are kept; the engine counts it (``counters()["nonfinite_traces"]``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple, Optional

import tensorflow as tf

PRESETS = {
    "thor": (0.01, 0.0),
    "thor_stop": (0.01, 0.001),
    "thor_nt": (0.0, 0.0),
}

TRACE_FILTERS = ("mean", "none")
#: Observations in the filter's window (the last W since the last refresh).
TRACE_WINDOW = 8
#: Standard errors of noise removed from the filtered Δ.
NOISE_Z = 2.0
#: The noise variance is a running mean over the first NOISE_HORIZON samples, then an EMA 1/NOISE_HORIZON.
NOISE_HORIZON = 32
#: Noise samples needed before the filter removes noise from Δ.
MIN_NOISE_SAMPLES = 2
#: Cap of one noise sample, in multiples of the current mean absolute difference.
NOISE_CAP = 4.0
_SQRT_PI = 1.7724538509055159
#: Consecutive cadence points with Δ < ω2 before the filtered rule freezes a layer.
FREEZE_AFTER = 5


def trace_product(trace_a, trace_g, block_damping, a_dim, g_dim):
    """The seed's ``T = tr A · tr G + λ_b · a_dim · g_dim`` (trace of ``A ⊗ G + λ_b I``)."""
    return trace_a * trace_g + block_damping * a_dim * g_dim


def relative_trace_change(new_product, used_product, has_used):
    """``Δ = |new − used| / used``; +inf where the layer has no block in use yet."""
    delta = tf.abs(new_product - used_product) / tf.maximum(used_product, 1e-30)
    return tf.where(has_used, delta, tf.constant(float("inf"), delta.dtype))


def decide(delta, omega1, omega2, calm=None, freeze_after=1, force=None):
    """``(refresh, freeze)`` booleans of THOR's rule; ``reuse`` is neither.

    refresh: Δ > ω1, or ``force`` (bool tensor: the block in use is too old, ``max_block_age``;
    a forced refresh is neither quiet nor counted toward freezing). freeze: Δ < ω2 (never for a layer without a block in use: Δ = inf) at
    ``freeze_after`` consecutive evaluated cadence points; ``calm`` (int tensor) counts the previous
    consecutive points with Δ < ω2. ω1 = 0 (THOR_NT) refreshes at every cadence point, even when Δ
    is exactly 0. With ``calm`` given, returns ``(refresh, freeze, new_calm)``.
    """
    if omega1 <= 0:
        refresh = tf.ones_like(delta, dtype=tf.bool)
        quiet = tf.zeros_like(delta, dtype=tf.bool)
    else:
        refresh = delta > omega1
        quiet = tf.logical_and(tf.logical_not(refresh), delta < omega2)
    if force is not None:
        refresh = tf.logical_or(refresh, force)
        quiet = tf.logical_and(quiet, tf.logical_not(force))
    if calm is None:
        return refresh, quiet
    new_calm = tf.where(quiet, calm + 1, tf.zeros_like(calm))
    freeze = tf.logical_and(quiet, new_calm >= freeze_after)
    return refresh, freeze, new_calm


class FilterState(NamedTuple):
    """The trace filter of one layer (scalars) or of several (leading dims): all tensors.

    window: ``[..., W]`` ring buffer of observations since the last refresh; count: their number
    (int64, may exceed W); ref_mean / ref_count: the reference; last: the previous observation
    (0: none yet); noise / noise_count: the mean absolute relative successive difference and its
    samples (see :func:`filter_noise`).
    """

    window: tf.Tensor
    count: tf.Tensor
    ref_mean: tf.Tensor
    ref_count: tf.Tensor
    last: tf.Tensor
    noise: tf.Tensor
    noise_count: tf.Tensor


def initial_filter_state(shape=(), window=TRACE_WINDOW):
    shape = tuple(shape)
    return FilterState(
        window=tf.zeros(shape + (window,)), count=tf.zeros(shape, tf.int64),
        ref_mean=tf.zeros(shape), ref_count=tf.zeros(shape, tf.int64), last=tf.zeros(shape),
        noise=tf.zeros(shape), noise_count=tf.zeros(shape, tf.int64))


def window_mean(state):
    """``(m_w, n_w)``: mean of the last ``min(count, W)`` observations and that number (float)."""
    size = state.window.shape[-1]
    n = tf.minimum(state.count, size)
    filled = tf.range(size, dtype=tf.int64) < n[..., None]
    total = tf.reduce_sum(tf.where(filled, state.window, tf.zeros_like(state.window)), axis=-1)
    n = tf.cast(n, state.window.dtype)
    return total / tf.maximum(n, 1.0), n


def filter_observe(state, obs):
    """Add observation ``obs`` (``tr A · tr G`` of a batch) to the window (the noise estimate is
    updated apart, by :func:`filter_noise`, after Δ is judged: a change is measured against the
    noise seen before it)."""
    size = state.window.shape[-1]
    slot = tf.one_hot(state.count % size, size, on_value=True, off_value=False, dtype=tf.bool)
    window = tf.where(slot, obs[..., None], state.window)
    return state._replace(window=window, count=state.count + 1)


def filter_noise(state, obs):
    """Update the noise scale with ``obs`` and make it the last observation.

    ``noise`` is the mean absolute relative successive difference ``|r_k − r_{k−1}| / r_{k−1}``
    (for independent observations of relative s.d. σ its mean is 2σ/√π), a running mean over the
    first ``NOISE_HORIZON`` samples, then an EMA of weight 1/NOISE_HORIZON. Once
    ``MIN_NOISE_SAMPLES`` exist, a sample is capped at ``NOISE_CAP`` × the current mean, so that a
    level shift (which the rule must see as a change) barely raises the noise estimate.
    """
    have_last = state.last > 0
    rel = tf.abs(obs - state.last) / tf.where(have_last, state.last, tf.ones_like(state.last))
    capped = tf.where(state.noise_count >= MIN_NOISE_SAMPLES,
                      tf.minimum(rel, NOISE_CAP * state.noise), rel)
    weight = 1.0 / tf.minimum(tf.cast(state.noise_count + 1, obs.dtype), float(NOISE_HORIZON))
    noise = tf.where(have_last, state.noise + weight * (capped - state.noise), state.noise)
    noise_count = state.noise_count + tf.cast(have_last, tf.int64)
    return state._replace(last=obs, noise=noise, noise_count=noise_count)


def filter_step(state, obs, damping_term, has_used, omega1, omega2, calm,
                freeze_after=FREEZE_AFTER, force=None):
    """One cadence point of the filtered rule: ``(delta, refresh, freeze, new_calm, new_state)``.

    ``force``: refresh regardless of Δ (see :func:`decide`); the reference restarts as at any
    refresh."""
    state = filter_observe(state, obs)
    delta = filter_delta(state, damping_term, has_used)
    refresh, freeze, new_calm = decide(delta, omega1, omega2, calm, freeze_after, force)
    state = filter_refresh(state, refresh)
    state = filter_noise(state, obs)
    return delta, refresh, freeze, new_calm, state


def filter_delta(state, damping_term, has_used, z=NOISE_Z):
    """Filtered Δ of the damped trace (see the module docstring); +inf without a block in use."""
    m_w, n_w = window_mean(state)
    n_ref = tf.cast(tf.maximum(state.ref_count, 1), m_w.dtype)
    sigma = state.noise * (_SQRT_PI / 2.0)  # relative s.d. of one observation
    se = sigma * tf.sqrt(1.0 / tf.maximum(n_w, 1.0) + 1.0 / n_ref) * state.ref_mean
    se = tf.where(state.noise_count >= MIN_NOISE_SAMPLES, se, tf.zeros_like(se))
    excess = tf.maximum(tf.abs(m_w - state.ref_mean) - z * se, 0.0)
    delta = excess / tf.maximum(state.ref_mean + damping_term, 1e-30)
    return tf.where(has_used, delta, tf.constant(float("inf"), delta.dtype))


def filter_refresh(state, refresh):
    """Where ``refresh``: the window's mean becomes the reference and the window restarts."""
    m_w, _ = window_mean(state)
    n_w = tf.minimum(state.count, state.window.shape[-1])
    return state._replace(
        ref_mean=tf.where(refresh, m_w, state.ref_mean),
        ref_count=tf.where(refresh, n_w, state.ref_count),
        count=tf.where(refresh, tf.zeros_like(state.count), state.count))


def adapt_interval(interval, refreshed_any, base, max_interval):
    """Adaptive cadence: ×2 (≤ max_interval) after a point without refresh, ÷2 (≥ base) after one."""
    interval = tf.cast(interval, tf.int64)
    return tf.where(refreshed_any, tf.maximum(interval // 2, base),
                    tf.minimum(interval * 2, max_interval))


class AdaptiveCadence:
    """``frequency`` that adapts: interval from ``base``, doubling up to ``max_interval`` while the
    trace rule refreshes no layer at a cadence point, halving back toward ``base`` when layers refresh.

    ``frequency="adaptive"`` is ``AdaptiveCadence(10, 80)``.
    """

    def __init__(self, base=10, max_interval=None):
        if isinstance(base, bool) or not isinstance(base, numbers.Integral) or base < 1:
            raise ValueError(_frequency_error(f"AdaptiveCadence(base={base!r})"))
        max_interval = 8 * base if max_interval is None else max_interval
        if (isinstance(max_interval, bool) or not isinstance(max_interval, numbers.Integral)
                or max_interval < base):
            raise ValueError(_frequency_error(
                f"AdaptiveCadence(base={base!r}, max_interval={max_interval!r})"))
        self.base = int(base)
        self.max_interval = int(max_interval)

    def get_config(self):
        return {"adaptive": {"base": self.base, "max_interval": self.max_interval}}

    def __repr__(self):
        return f"AdaptiveCadence(base={self.base}, max_interval={self.max_interval})"


class CadenceSchedule:
    """The ``frequency`` option as a function ``(step, epoch) -> interval`` (int64 tensor).

    Accepted forms:
      * ``int >= 1``: a fixed interval (refreshes at steps 0, f, 2f, ...);
      * a list of ``(epoch, interval)`` pairs, epochs increasing from 0: the interval in force from
        that (0-based) epoch on, e.g. ``[(0, 10), (2, 50), (5, 200)]`` thins refreshes as training
        settles, as THOR does on ResNet-50;
      * a callable ``step -> interval`` (tensor in, tensor out);
      * ``"adaptive"``, an :class:`AdaptiveCadence`, or its config
        ``{"adaptive": {"base": b, "max_interval": m}}``: the interval is the optimizer's state
        variable ``thor_interval``, updated at each cadence point by :func:`adapt_interval`.
    """

    def __init__(self, frequency):
        self.spec = frequency
        self.adaptive = None
        if isinstance(frequency, bool):
            raise ValueError(_frequency_error(frequency))
        if isinstance(frequency, str) and frequency == "adaptive":
            frequency = AdaptiveCadence()
        elif isinstance(frequency, dict) and set(frequency) == {"adaptive"}:
            options = frequency["adaptive"]
            if not isinstance(options, dict):
                raise ValueError(_frequency_error(frequency))
            try:
                frequency = AdaptiveCadence(**options)
            except TypeError as err:
                raise ValueError(_frequency_error(frequency)) from err
        if isinstance(frequency, AdaptiveCadence):
            self.adaptive = frequency
            self._pairs = [(0, frequency.base)]
            self._fn = None
        elif isinstance(frequency, numbers.Integral):
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
        return self.adaptive is None and self._pairs is not None and len(self._pairs) == 1

    def interval_base(self):
        """The first interval (int): the adaptive base, or the interval of epoch 0 / step 0."""
        if self._pairs is not None:
            return self._pairs[0][1]
        return 1

    def interval(self, step, epoch, current=None):
        """Interval (int64 scalar tensor) in force at ``step`` / 0-based ``epoch``.

        ``current``: the adaptive interval (state variable), returned as is in adaptive mode.
        """
        if self.adaptive is not None:
            if current is None:
                return tf.constant(self.adaptive.base, tf.int64)
            return tf.cast(current, tf.int64)
        if self._fn is not None:
            return tf.maximum(tf.cast(self._fn(step), tf.int64), 1)
        epoch = tf.cast(epoch, tf.int64)
        value = tf.constant(self._pairs[0][1], tf.int64)
        for start, interval in self._pairs[1:]:
            value = tf.where(epoch >= start, tf.constant(interval, tf.int64), value)
        return value

    def get_config(self):
        if self.adaptive is not None:
            if (self.adaptive.base, self.adaptive.max_interval) == (10, 80):
                return "adaptive"
            return self.adaptive.get_config()
        if self._fn is not None:
            return None  # callables do not serialize; documented
        if self.is_constant:
            return self._pairs[0][1]
        return [list(p) for p in self._pairs]


def _frequency_error(value):
    return (
        f"`frequency` must be an int >= 1, a list of (epoch, interval) pairs with epochs starting "
        f"at 0 and increasing and intervals >= 1, a callable step -> interval, \"adaptive\" or "
        f"AdaptiveCadence(base >= 1, max_interval >= base); got {value!r}."
    )


# --- The rule's options ------------------------------------------------------------------------

#: Cadence of factor work (``frequency``): every 10 steps.
DEFAULT_FREQUENCY = 10
#: Noise filter of the rule ("none" = the rule as published).
DEFAULT_TRACE_FILTER = "mean"
#: Steps after which a block is refreshed whatever the trace rule says (issue 18's 3-seed
#: benchmark on the CNN, ResNet-20 and ViT, docs/results.md); None: the rule alone.
DEFAULT_MAX_BLOCK_AGE = 50


def resolve_omegas(preset, omega1, omega2):
    """``(ω1, ω2)`` from a preset name and/or explicit values (explicit values win)."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(PRESETS)} or None; got {preset!r}.")
    base1, base2 = PRESETS[preset or "thor"]
    omega1 = base1 if omega1 is None else omega1
    omega2 = base2 if omega2 is None else omega2
    for name, value in (("omega1", omega1), ("omega2", omega2)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ValueError(f"`{name}` must be a float >= 0; got {value!r}.")
    if omega2 > omega1:
        raise ValueError(
            f"`omega2` must be <= `omega1` (0 <= omega2 <= omega1); got omega1={omega1}, "
            f"omega2={omega2}.")
    return float(omega1), float(omega2)


@dataclasses.dataclass(frozen=True)
class TraceRule:
    """The trace rule's options, validated on construction: ``thor_tf.wrap(model,
    trace_rule=thor_tf.TraceRule(preset="thor_stop"))``; ``wrap`` and ``ThorOptimizer`` also take
    each by name (``wrap(model, preset="thor_stop")``). See ``ThorOptimizer`` for each one's
    meaning and docs/trace_rule.md for the rule.

    Derived, read-only: ``omegas`` (ω1, ω2 after the preset), ``cadence`` (the
    :class:`CadenceSchedule` of ``frequency``).
    """

    frequency: Any = DEFAULT_FREQUENCY
    preset: Optional[str] = "thor"
    omega1: Optional[float] = None
    omega2: Optional[float] = None
    trace_filter: str = DEFAULT_TRACE_FILTER
    max_block_age: Optional[int] = DEFAULT_MAX_BLOCK_AGE

    def __post_init__(self):
        if not isinstance(self.trace_filter, str) or self.trace_filter not in TRACE_FILTERS:
            raise ValueError(
                f"`trace_filter` must be one of {list(TRACE_FILTERS)}; got {self.trace_filter!r}.")
        age = self.max_block_age
        if age is not None and (isinstance(age, bool) or not isinstance(age, numbers.Integral)
                                or age < 1):
            raise ValueError(f"`max_block_age` must be None or an int >= 1 (steps); got {age!r}.")
        object.__setattr__(self, "max_block_age", None if age is None else int(age))
        object.__setattr__(self, "_omegas", resolve_omegas(self.preset, self.omega1, self.omega2))
        object.__setattr__(self, "_cadence", CadenceSchedule(self.frequency))

    @property
    def omegas(self):
        """``(ω1, ω2)``: the preset's thresholds overridden by explicit ``omega1``/``omega2``."""
        return self._omegas

    @property
    def cadence(self):
        return self._cadence

    @classmethod
    def options(cls):
        """The option names (also taken by name by ``wrap`` and ``ThorOptimizer``)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_options(self, given, explicit):
        """This rule with ``given`` (``{name: value}``, by name) set; ``explicit``: this instance
        was given as ``trace_rule`` too, so a name it sets to another value is given twice."""
        if not given:
            return self
        for name, value in given.items():
            if explicit and getattr(self, name) != value and getattr(self, name) != getattr(
                    TraceRule, name):
                raise ValueError(
                    f"`{name}` is given twice, {value!r} by name and {getattr(self, name)!r} in "
                    f"trace_rule={self!r}; give it once.")
        return dataclasses.replace(self, **given)

    def get_config(self):
        """JSON-able (a callable ``frequency`` becomes the default: callables do not serialize)."""
        out = {name: getattr(self, name) for name in self.options()}
        frequency = self.cadence.get_config()
        out["frequency"] = DEFAULT_FREQUENCY if frequency is None else frequency
        return out

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("frequency"), list):
            config["frequency"] = [tuple(p) for p in config["frequency"]]
        return cls(**config)


# --- The rule over the engine's active layers (one cadence point) ----------------------------


class Decisions(NamedTuple):
    """One cadence point's trace-rule outcome, one entry per active layer (``[n_active]``)."""

    delta: tf.Tensor  # Δ (NaN: frozen, or traces not finite)
    refresh: tf.Tensor  # bool
    freeze: tf.Tensor  # bool
    nonfinite: tf.Tensor  # bool: the traces were not finite (nothing changed)
    calm: tf.Tensor  # int64: consecutive Δ < ω2 after this point
    filter: FilterState  # the trace filter after this point ([n_active, ...])


def per_block_rows(variable, positions):
    """Rows ``positions`` (a list of block positions) of a per-block state vector (``[n, ...]``):
    the vector itself when ``positions`` is every block in order (the usual step: no gather)."""
    value = tf.convert_to_tensor(variable)
    if positions == list(range(int(value.shape[0]))):
        return value
    return tf.gather(value, positions)


def layer_traces(layer):
    """``(tr A, tr G)`` of one cadence layer (over its valid rows under a masked loss)."""
    if layer.masks is None:
        return layer.block.trace_a(layer.records), layer.block.trace_g(layer.grads)
    return (layer.block.trace_a(layer.records, masks=layer.masks),
            layer.block.trace_g(layer.grads, masks=layer.masks))


def local_traces(state, layers):
    """``[n, 2]``: ``[tr A, tr G]`` of this replica's batch per layer (zeros for a frozen
    layer). Computed for every layer without a branch: a trace is a sum of squares, cheaper
    at run time than a ``tf.cond`` per layer is to trace and optimize.

    ``state``: the engine's :class:`~thor_tf.state.ThorState`; ``layers``: the active layers'
    ``CadenceLayer`` (:mod:`thor_tf.cadence_point`: index, block, records, output gradients, masks).
    """
    traces = tf.stack([tf.stack(layer_traces(layer)) for layer in layers])
    frozen = per_block_rows(state.frozen, [layer.index for layer in layers]) > 0
    return tf.where(frozen[:, None], tf.zeros_like(traces), traces)


def judge(state, config, layers, traces, damping, step):
    """The trace rule for every active layer at once, from the global batch's traces.

    Args:
      state: the engine's :class:`~thor_tf.state.ThorState` (read only).
      config: the :class:`~thor_tf.config.ThorConfig` (its ``trace_rule``: ``omegas``,
        ``trace_filter``, ``max_block_age``; and ``factor_decay``).
      layers: the active layers' ``CadenceLayer``.
      traces: ``[n_active, 2]`` float32, ``[tr A, tr G]`` per layer.
      damping: λ (float32 scalar).
      step: the optimizer step (int64 scalar), for ``max_block_age``.

    Returns:
      :class:`Decisions` of ``[n_active]`` vectors. Every formula is elementwise over layers,
      so one set of ops serves all layers (no per-layer branch). A frozen layer decides nothing;
      a layer whose traces are not finite (e.g. ``‖a‖²`` overflowing float32) decides nothing,
      changes nothing and is counted.
    """
    s = state
    index = [layer.index for layer in layers]

    def rows(v):
        return per_block_rows(v, index)

    frozen = rows(s.frozen) > 0
    has_used = rows(s.refreshes) > 0
    used_a, used_g = rows(s.trace_a), rows(s.trace_g)
    calm = rows(s.calm)
    old_filter = FilterState(*[rows(v) for v in s.filter])
    # λ_b = λ/c with c = R/D rows per data point (KFC's λ/P for one term per example).
    block_damping = damping / tf.stack([layer.rows_per_term for layer in layers])
    a_dims = tf.constant([float(layer.block.a_dim) for layer in layers])
    g_dims = tf.constant([float(layer.block.g_dim) for layer in layers])
    batch_a, batch_g = traces[:, 0], traces[:, 1]
    rule = config.trace_rule
    omega1, omega2 = rule.omegas
    aged = None
    if rule.max_block_age is not None:
        age = step - tf.cast(rows(s.last_refresh), tf.int64)
        aged = tf.logical_and(has_used, age >= rule.max_block_age)
    if rule.trace_filter == "mean":
        delta, refresh, freeze, new_calm, new_filter = filter_step(
            old_filter, batch_a * batch_g, block_damping * a_dims * g_dims, has_used, omega1,
            omega2, calm, FREEZE_AFTER, aged)
    else:
        new_filter = old_filter
        beta = config.factor_decay
        trace_a, trace_g = batch_a, batch_g
        if beta > 0:
            trace_a = tf.where(has_used, beta * used_a + (1 - beta) * trace_a, trace_a)
            trace_g = tf.where(has_used, beta * used_g + (1 - beta) * trace_g, trace_g)
        new = trace_product(trace_a, trace_g, block_damping, a_dims, g_dims)
        used = trace_product(used_a, used_g, block_damping, a_dims, g_dims)
        delta = relative_trace_change(new, used, has_used)
        refresh, freeze, new_calm = decide(delta, omega1, omega2, calm, 1, aged)
    finite = tf.logical_and(tf.math.is_finite(batch_a * batch_g),
                            tf.reduce_all(tf.math.is_finite(traces), axis=1))
    live = tf.logical_and(tf.logical_not(frozen), finite)

    def keep(new, old):
        mask = live if new.shape.rank == 1 else live[:, None]
        return tf.where(mask, new, old)

    return Decisions(
        delta=tf.where(live, delta, tf.fill(tf.shape(delta), float("nan"))),
        refresh=tf.logical_and(live, refresh), freeze=tf.logical_and(live, freeze),
        nonfinite=tf.logical_and(tf.logical_not(frozen), tf.logical_not(finite)),
        calm=keep(new_calm, calm),
        filter=FilterState(*[keep(n, o) for n, o in zip(new_filter, old_filter)]))


def record_decisions(state, decision_log, n_blocks, layers, decisions, step):
    """Write one cadence point's decisions (:class:`Decisions` over the active layers) into
    the per-block vectors of ``state`` and a row of ``decision_log``
    (:class:`~thor_tf.state.DecisionLog`); layers not active this step keep their entries.
    ``n_blocks``: the engine's number of blocks (the length of the per-block vectors).

    Returns a boolean scalar: whether any layer refreshed.
    """
    s = state
    positions = [layer.index for layer in layers]
    # Every block active, in order (the usual step): the decisions are the whole vectors,
    # written without gathers and scatters (the same values; fewer ops to trace and run).
    every = positions == list(range(n_blocks))
    index = None if every else tf.constant([[k] for k in positions], tf.int64)
    frozen_before = tf.identity(s.frozen)
    refreshes_before = tf.identity(s.refreshes)

    def put(variable, values):
        values = tf.cast(values, variable.dtype)
        variable.assign(values if every else tf.tensor_scatter_nd_update(
            tf.convert_to_tensor(variable), index, values))

    def add(variable, flags):
        flags = tf.cast(flags, variable.dtype)
        if every:
            variable.assign_add(flags)
        else:
            variable.assign(tf.tensor_scatter_nd_add(tf.convert_to_tensor(variable), index,
                                                     flags))

    def rows(variable):
        return per_block_rows(variable, positions)

    was_frozen = rows(s.frozen) > 0
    evaluated = tf.logical_not(was_frozen)
    reuse = tf.logical_and(evaluated, tf.logical_not(
        tf.logical_or(decisions.refresh, decisions.freeze)))
    put(s.calm, decisions.calm)
    for variable, values in zip(s.filter, decisions.filter):
        put(variable, values)
    last_delta = rows(s.last_delta)
    put(s.last_delta, tf.where(evaluated, decisions.delta, last_delta))  # NaN: non-finite traces
    add(s.refreshes, decisions.refresh)
    add(s.reuses, reuse)
    step_vector = tf.fill(tf.shape(decisions.refresh), step)
    last_refresh = rows(s.last_refresh)
    put(s.last_refresh, tf.where(decisions.refresh, step_vector, last_refresh))
    frozen_at = rows(s.frozen_at)
    put(s.frozen_at, tf.where(decisions.freeze, step_vector, frozen_at))
    add(s.frozen, decisions.freeze)
    s.nonfinite_traces.assign_add(tf.reduce_sum(tf.cast(decisions.nonfinite, tf.int64)))
    frozen = tf.convert_to_tensor(s.frozen) > 0
    code = tf.where(tf.convert_to_tensor(s.refreshes) > refreshes_before, 2,
                    tf.where(tf.logical_and(frozen, frozen_before <= 0), 3,
                             tf.where(frozen, 0, 1)))
    decision_log.write(s.cadence_points, step, s.epoch, code, s.last_delta, s.refreshes,
                       s.reuses)
    return tf.reduce_any(decisions.refresh)
