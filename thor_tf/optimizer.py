"""``ThorOptimizer``: THOR's hyper-parameters, its state, and the update chain.

The update of one variable, in THOR's order (each step a small function below):

    Δ = precondition(∇w)          (done by the engine for variables with a Kronecker block,
                                   scaled by K-FAC's KL clip ν <= 1)
    Δ = Δ + wd · w                (weight decay, not preconditioned; a filter chooses variables)
    Δ = clip_by_norm(Δ, c)        (optional, per tensor)
    v = μ v + Δ ;  w ← w − lr · v (momentum)

Variables without a block (BatchNorm, LayerNorm, unsupported layers) get the same chain on the raw
gradient. A step whose loss or gradients are non-finite changes no weight and no momentum.

All state lives here, created in ``build`` before tracing, so ``model.save``, ``keras.models.
load_model`` and ``tf.train.Checkpoint`` keep the whole optimizer: momentum, factors, inverses,
trace history and counters (created by :meth:`thor_tf.engine.ThorEngine.build_state`).
"""

from __future__ import annotations

import json
import numbers
import os

import keras
import tensorflow as tf
from keras import ops

from thor_tf.scheduler import PRESETS, TRACE_FILTERS, CadenceSchedule

FISHER_TYPES = ("empirical", "sampled")
#: Who inverts a refreshing layer's factors under a multi-replica strategy (README "Distributed").
INVERSE_ASSIGNMENTS = ("all", "balanced")
DEFAULT_FREQUENCY = 10
#: Noise filter of the trace rule ("none" = the rule as published); see README and scheduler.py.
DEFAULT_TRACE_FILTER = "mean"
#: K-FAC's trust region on the preconditioned step (kfac-pytorch's default); see README.
DEFAULT_KL_CLIP = 0.001


def _is_schedule(value):
    return isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or callable(value)


def _check_positive_or_schedule(name, value, allow_zero=False):
    if _is_schedule(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"`{name}` must be a float {bound} or a LearningRateSchedule / callable of the step; "
            f"got {value!r}.")


def resolve_split_dim(split_dim):
    """``split_dim`` as an int: an int >= 1, or the path of a calibration JSON with key ``split_dim``."""
    if isinstance(split_dim, (str, os.PathLike)):
        path = os.fspath(split_dim)
        try:
            with open(path) as fh:
                value = json.load(fh)["split_dim"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"`split_dim` must be an int >= 1 or the path of a calibration JSON file with a "
                f"'split_dim' key; could not read one from {path!r}: {err}") from err
        split_dim = value
    if isinstance(split_dim, bool) or not isinstance(split_dim, numbers.Integral) or split_dim < 1:
        raise ValueError(
            f"`split_dim` must be an int >= 1 or the path of a calibration JSON file; "
            f"got {split_dim!r}.")
    return int(split_dim)


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


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorOptimizer(keras.optimizers.Optimizer):
    """Kronecker-factored natural gradient with THOR's trace rule and split inverses.

    Args:
      learning_rate: float or ``LearningRateSchedule`` (see :mod:`thor_tf.schedules`).
      momentum: μ in ``v = μ v + Δ``, in [0, 1).
      damping: λ (float > 0 or schedule of the step); each factor gets ``√(λ/P)`` (P: positions).
      weight_decay: coupled L2 added to the (preconditioned) update, float >= 0.
      weight_decay_exclude: variable-name patterns (regex, as Keras' ``exclude_from_weight_decay``)
        that get no weight decay, e.g. ``["bias", "gamma", "beta"]``.
      clip_norm: optional per-tensor clip-by-norm of the update before momentum (float > 0).
      frequency: cadence of factor work: int, list of ``(epoch, interval)``, callable of the step,
        or ``"adaptive"`` / ``thor_tf.scheduler.AdaptiveCadence(base, max_interval)``: the interval
        doubles (up to ``max_interval``, default 8·base) after a cadence point where no layer
        refreshed and halves (down to ``base``) after one where some did; ``"adaptive"`` is base 10.
      preset: ``"thor"`` (ω1, ω2) = (0.01, 0), ``"thor_stop"`` (0.01, 0.001), ``"thor_nt"`` (0, 0).
      omega1, omega2: explicit trace-rule thresholds (override the preset), 0 <= ω2 <= ω1.
      split_dim: block size of the split inverse (int) or a calibration JSON path.
      fisher: ``"empirical"`` (labels from the data, THOR) or ``"sampled"`` (labels drawn from the
        model's predictive distribution, K-FAC's true Fisher; second backward on cadence steps only).
      factor_decay: 0 uses the current batch's factors (THOR); β in (0, 1) keeps a running average
        ``β·old + (1−β)·new`` seeded by the first batch.
      kl_clip: κ of K-FAC's trust region: the preconditioned gradients are scaled by
        ``min(1, sqrt(κ / (lr²·⟨Δ, ∇⟩)))``; None turns it off.
      factor_examples: None uses the whole batch for the factors and traces; k uses its first k
        examples (a sub-batch: Conv2D im2col and factor cost shrink in proportion).
      trace_filter: ``"mean"`` (default) compares the mean of the traces observed since the last
        refresh (the last ``scheduler.TRACE_WINDOW`` = 8 at most) with the mean that produced the
        block in use, less 2 standard errors of sampling noise, and freezes only after
        ``scheduler.FREEZE_AFTER`` = 5 consecutive Δ < ω2; ``"none"`` is THOR's rule as published
        (the current batch's traces, immediate freeze). See :mod:`thor_tf.scheduler`. Replaces
        ``trace_smoothing`` (which now raises ValueError).
      inverse_assignment: under a strategy with several replicas, ``"all"`` (default): every
        replica inverts every refreshing layer (no communication of inverses); ``"balanced"``:
        each layer is inverted by one replica (greedy balance of the cost ``Σ d³`` of its
        blocks, as KAISA and kfac-jax assign work) and one packed all-reduce shares the
        inverses. Both give the same step; see README "Distributed training" for when each wins.
    """

    def __init__(
        self,
        learning_rate=0.05,
        momentum=0.9,
        damping=0.03,
        weight_decay=0.0,
        weight_decay_exclude=None,
        clip_norm=None,
        frequency=DEFAULT_FREQUENCY,
        preset="thor",
        omega1=None,
        omega2=None,
        split_dim=128,
        fisher="empirical",
        factor_decay=0.0,
        trace_filter=DEFAULT_TRACE_FILTER,
        kl_clip=DEFAULT_KL_CLIP,
        factor_examples=None,
        inverse_assignment="all",
        name="thor",
        **kwargs,
    ):
        for unsupported in ("clipnorm", "clipvalue", "global_clipnorm"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"`{unsupported}` is not supported by ThorOptimizer (it would clip before "
                    f"preconditioning); use `clip_norm`, which clips the update in THOR's order.")
        if kwargs.get("gradient_accumulation_steps"):
            raise ValueError(
                "`gradient_accumulation_steps` is not supported by ThorOptimizer (factors are "
                "per batch); use a larger batch size.")
        _check_positive_or_schedule("learning_rate", learning_rate)
        _check_positive_or_schedule("damping", damping)
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum < 1:
            raise ValueError(f"`momentum` must be a float in [0, 1); got {momentum!r}.")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or weight_decay < 0:
            raise ValueError(f"`weight_decay` must be a float >= 0; got {weight_decay!r}.")
        if clip_norm is not None and (not isinstance(clip_norm, numbers.Real) or clip_norm <= 0):
            raise ValueError(f"`clip_norm` must be None or a float > 0; got {clip_norm!r}.")
        if fisher not in FISHER_TYPES:
            raise ValueError(f"`fisher` must be one of {list(FISHER_TYPES)}; got {fisher!r}.")
        if isinstance(factor_decay, bool) or not isinstance(factor_decay, numbers.Real) or not 0 <= factor_decay < 1:
            raise ValueError(f"`factor_decay` must be a float in [0, 1); got {factor_decay!r}.")
        if "trace_smoothing" in kwargs:
            raise ValueError(
                f"`trace_smoothing` was replaced by `trace_filter` (one of {list(TRACE_FILTERS)}; "
                f"\"none\" is the rule as published); got trace_smoothing="
                f"{kwargs['trace_smoothing']!r}.")
        if not isinstance(trace_filter, str) or trace_filter not in TRACE_FILTERS:
            raise ValueError(
                f"`trace_filter` must be one of {list(TRACE_FILTERS)}; got {trace_filter!r}.")
        if kl_clip is not None and (isinstance(kl_clip, bool) or not isinstance(kl_clip, numbers.Real)
                                    or kl_clip <= 0):
            raise ValueError(f"`kl_clip` must be None or a float > 0; got {kl_clip!r}.")
        if factor_examples is not None and (isinstance(factor_examples, bool) or not isinstance(
                factor_examples, numbers.Integral) or factor_examples < 1):
            raise ValueError(f"`factor_examples` must be None or an int >= 1; got {factor_examples!r}.")
        if not isinstance(inverse_assignment, str) or inverse_assignment not in INVERSE_ASSIGNMENTS:
            raise ValueError(f"`inverse_assignment` must be one of {list(INVERSE_ASSIGNMENTS)}; "
                             f"got {inverse_assignment!r}.")
        if weight_decay_exclude is not None and (
                isinstance(weight_decay_exclude, str)
                or not all(isinstance(p, str) for p in weight_decay_exclude)):
            raise ValueError(
                f"`weight_decay_exclude` must be None or a list of variable-name patterns; "
                f"got {weight_decay_exclude!r}.")

        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = float(momentum)
        self.damping = damping
        self.thor_weight_decay = float(weight_decay)
        self.weight_decay_exclude = list(weight_decay_exclude) if weight_decay_exclude else None
        if self.weight_decay_exclude:
            self.exclude_from_weight_decay(var_names=self.weight_decay_exclude)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.frequency = frequency
        self.cadence = CadenceSchedule(frequency)
        self.preset = preset
        self._omega_args = (omega1, omega2)
        self.omega1, self.omega2 = resolve_omegas(preset, omega1, omega2)
        self.split_dim = resolve_split_dim(split_dim)
        self.fisher = fisher
        self.factor_decay = float(factor_decay)
        self.trace_filter = trace_filter
        self.kl_clip = None if kl_clip is None else float(kl_clip)
        self.factor_examples = None if factor_examples is None else int(factor_examples)
        self.inverse_assignment = inverse_assignment
        self.engine = None
        self._gradients_reduced = False
        self._step_ok = None

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, engine):
        """Bind the model's engine (its registered blocks); must happen before ``build``."""
        if self.built and self.engine is not engine:
            raise ValueError("this ThorOptimizer is already built for another model")
        self.engine = engine

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums = [
            self.add_variable_from_reference(v, name="momentum") for v in var_list
        ]
        if self.engine is None:
            raise ValueError(
                "ThorOptimizer has no model attached: compile a model returned by thor_tf.wrap() "
                "with it (model.compile(optimizer=thor_tf.ThorOptimizer(...))).")
        self.engine.build_state(self, var_list)

    def current_damping(self):
        """λ at the current step (float32 scalar tensor)."""
        damping = self.damping
        if isinstance(damping, keras.optimizers.schedules.LearningRateSchedule):
            damping = damping(self.iterations)
        elif callable(damping):
            damping = damping(self.iterations)
        return tf.cast(damping, tf.float32)

    # -- the update chain ----------------------------------------------------------------------------
    def apply_masked(self, grads, variables, ok, reduced=False):
        """``apply`` of already unscaled gradients, every change masked by the boolean ``ok``.

        The engine divides the gradients by the loss scale before preconditioning (the KL clip
        must see true gradients), so Keras' own unscaling by ``loss_scale_factor`` is switched off
        here. A skipped step (``ok`` False) changes no weight and no momentum, and does not count
        in ``iterations`` (the convention of Keras' ``LossScaleOptimizer``): learning-rate and
        damping schedules and the cadence do not move over skipped batches.

        ``reduced=True``: the gradients are already the global batch's (the engine all-reduces
        them before preconditioning, so that every replica preconditions the same gradient), and
        Keras' all-reduce of the gradients it is given is switched off: summing R identical
        preconditioned gradients would multiply the step by R.
        """
        self._step_ok = ok
        loss_scale_factor, self.loss_scale_factor = self.loss_scale_factor, None
        self._gradients_reduced = reduced
        try:
            self.apply(grads, variables)
        finally:
            self._step_ok = None
            self._gradients_reduced = False
            self.loss_scale_factor = loss_scale_factor
        self.iterations.assign_sub(tf.cast(tf.logical_not(ok), self.iterations.dtype))

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras' TF backend all-reduces the gradients passed to ``apply`` (private hook, see
        # thor_tf/_keras_compat.py); THOR's are reduced before preconditioning.
        if self._gradients_reduced:
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def _weight_decay_term(self, update, variable):
        if self.thor_weight_decay and self._use_weight_decay(variable):
            return update + ops.cast(self.thor_weight_decay, variable.dtype) * variable
        return update

    def _clip(self, update):
        if self.clip_norm is None:
            return update
        return tf.clip_by_norm(update, self.clip_norm)

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        update = ops.cast(gradient, variable.dtype)
        update = self._weight_decay_term(update, variable)
        update = self._clip(update)
        velocity = self._momentums[self._get_variable_index(variable)]
        new_velocity = self.momentum * velocity + update
        if self._step_ok is not None:
            new_velocity = tf.where(self._step_ok, new_velocity, velocity)
            step = tf.where(self._step_ok, lr * new_velocity, tf.zeros_like(new_velocity))
        else:
            step = lr * new_velocity
        self.assign(velocity, new_velocity)
        self.assign_sub(variable, step)

    # -- config ----------------------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        damping = self.damping
        if _is_schedule(damping) and not isinstance(damping, numbers.Real):
            damping = keras.saving.serialize_keras_object(damping)
        frequency = self.cadence.get_config()
        if frequency is None:
            frequency = DEFAULT_FREQUENCY  # callables do not serialize (README)
        config.update({
            "momentum": self.momentum,
            "damping": damping,
            "weight_decay": self.thor_weight_decay,
            "weight_decay_exclude": self.weight_decay_exclude,
            "clip_norm": self.clip_norm,
            "frequency": frequency,
            "preset": self.preset,
            "omega1": self._omega_args[0],
            "omega2": self._omega_args[1],
            "split_dim": self.split_dim,
            "fisher": self.fisher,
            "factor_decay": self.factor_decay,
            "trace_filter": self.trace_filter,
            "kl_clip": self.kl_clip,
            "factor_examples": self.factor_examples,
            "inverse_assignment": self.inverse_assignment,
        })
        for key in ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps"):
            config.pop(key, None)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Configs saved before trace_filter replaced trace_smoothing: its setting is not carried.
        config.pop("trace_smoothing", None)
        if isinstance(config.get("damping"), dict):
            config["damping"] = keras.saving.deserialize_keras_object(
                config["damping"], custom_objects=custom_objects)
        if isinstance(config.get("frequency"), list):
            config["frequency"] = [tuple(p) for p in config["frequency"]]
        return super().from_config(config, custom_objects=custom_objects)
