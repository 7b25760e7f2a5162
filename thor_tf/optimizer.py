"""``ThorOptimizer``: THOR's hyper-parameters, its state, and the update chain.

How a block's factors become its step is the update rule's (:mod:`thor_tf.rules`, option
``update_rule``): ``"eigenbasis"`` (the default: Adam in the eigenbasis of each split factor
block, AdamW for the variables without a block, decoupled weight decay) or ``"inverse"``
(THOR's). Under the inverse rule the update of one variable, in THOR's order:

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

import dataclasses
import warnings

import keras
import tensorflow as tf

from thor_tf import _keras_compat
from thor_tf.config import (REFUSED_KERAS_ARGUMENTS, RULE_OPTIONS, THOR_OPTIONS, TRACE_OPTIONS,
                            saved_options, split_options)
from thor_tf.schedules import FitWarmupCosine
from thor_tf.split.plan import AUTO


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorOptimizer(keras.optimizers.Optimizer):
    """Kronecker-factored curvature with THOR's trace rule: Adam in the eigenbasis of the split
    factors (the default update rule) or THOR's split inverses (``update_rule="inverse"``).

    Args:
      learning_rate: float or ``LearningRateSchedule`` (see :mod:`thor_tf.schedules`); None
        (default): ``thor_tf.schedules.FitWarmupCosine``, warmup + cosine over the length of the
        wrapped model's ``fit`` (constant outside it: a custom loop, a GAN's optimizer), peaking
        at the update rule's rate (eigenbasis 0.03, eigenbasis_adam 0.01, inverse 0.05), also
        the peak of a ``WarmupCosine`` given without one.
      update_rule: ``"eigenbasis"`` (default; None means it), ``"inverse"`` (THOR's damped
        inverses, KL clip and momentum) or a :class:`thor_tf.rules.UpdateRule` instance such as
        ``thor_tf.rules.Eigenbasis(beta_2=0.99)``. Each rule holds its own options
        (``Eigenbasis``: β1, β2, ε, ...; ``Inverse``: ``momentum``, ``damping_split``,
        ``kl_clip``, ``inverse_assignment``); the inverse rule's four are also taken here by name
        and handed to it, and raise ``ValueError`` naming the rule when the rule in use has no
        use for them. ``weight_decay`` is coupled (added to the update before momentum) under
        the inverse rule, decoupled (AdamW's) under the eigenbasis rule; ``clip_norm`` clips the
        update before momentum under the inverse rule, each gradient before the moments under
        the eigenbasis rule.
      momentum, damping_split, kl_clip, inverse_assignment: the inverse rule's
        (:class:`thor_tf.rules.Inverse`, where each is described).
      damping: λ (float > 0 or schedule of the step), under every rule: the trace rule's Δ
        compares traces of the damped factors (a block's damping is ``λ_b = λ/P``, P: positions
        per example), and the inverse rule inverts them, sharing ``λ_b`` between the factors as
        its ``damping_split`` says.
      weight_decay: coupled L2 added to the (preconditioned) update, float >= 0.
      weight_decay_exclude: variable-name patterns (regex, as Keras' ``exclude_from_weight_decay``)
        that get no weight decay, e.g. ``["bias", "gamma", "beta"]``.
      clip_norm: optional per-tensor clip-by-norm of the update before momentum (float > 0).
      trace_rule: the trace rule's options as one :class:`thor_tf.TraceRule` (default
        ``TraceRule()``): ``frequency``, ``preset``, ``omega1``, ``omega2``, ``trace_filter`` and
        ``max_block_age`` below, each also taken here by name.
      frequency: cadence of factor work: int, list of ``(epoch, interval)``, callable of the step,
        or ``"adaptive"`` / ``thor_tf.scheduler.AdaptiveCadence(base, max_interval)``: the interval
        doubles (up to ``max_interval``, default 8·base) after a cadence point where no layer
        refreshed and halves (down to ``base``) after one where some did; ``"adaptive"`` is base 10.
      preset: ``"thor"`` (ω1, ω2) = (0.01, 0), ``"thor_stop"`` (0.01, 0.001), ``"thor_nt"`` (0, 0).
      omega1, omega2: explicit trace-rule thresholds (override the preset), 0 <= ω2 <= ω1.
      split_dim: the factors' diagonal block size: an int, a :class:`thor_tf.SplitPlan`,
        ``"auto"`` or a calibration JSON path; None: the update rule's ``default_split``.
      fisher: ``"empirical"`` (labels from the data, THOR) or ``"sampled"`` (labels drawn from the
        model's predictive distribution, K-FAC's true Fisher; second backward on cadence steps only).
      factor_decay: 0 uses the current batch's factors (THOR); β in (0, 1) keeps a running average
        ``β·old + (1−β)·new`` seeded by the first batch.
      factor_examples: None uses the whole batch for the factors and traces; k uses its first k
        examples (a sub-batch: Conv2D im2col and factor cost shrink in proportion).
      trace_filter: ``"mean"`` (default) compares the mean of the traces observed since the last
        refresh (the last ``scheduler.TRACE_WINDOW`` = 8 at most) with the mean that produced the
        block in use, less 2 standard errors of sampling noise, and freezes only after
        ``scheduler.FREEZE_AFTER`` = 5 consecutive Δ < ω2; ``"none"`` is THOR's rule as published
        (the current batch's traces, immediate freeze). See :mod:`thor_tf.trace_rule`. Replaces
        ``trace_smoothing`` (which now raises ValueError).
      loss_reduction: how the loss that the gradients come from reduces over the batch, undone so
        that G is the mean of per-example outer products: ``"auto"`` (default) reads the compiled
        loss in ``ThorModel.fit`` and assumes ``"mean"`` (``compute_loss``, ``reduce_mean``,
        ``tf.nn.compute_average_loss``) when the user's own ``train_step`` or loop applies the
        gradients; ``"mean"`` or ``"sum"`` say it.
      max_block_age: steps (default 50) or None: a block in use for that many steps or more is
        refreshed at the next cadence point whatever its trace says; None leaves the decision to
        the trace rule alone (the seed's). The trace sees only the sum of a factor's eigenvalues;
        behind a LayerNorm ``tr A`` is nearly fixed while A turns (Transformers, see
        docs/trace_rule.md). 50 was chosen by a 3-seed benchmark on the CNN, ResNet-20 and ViT
        (docs/results.md). With a cadence interval >= max_block_age every block refreshes at
        every cadence point. A frozen block stays frozen.
    """

    def __init__(self, learning_rate=None, name="thor", **options):
        # The options are declared once, on ThorConfig (validated there); the Keras optimizer
        # arguments (loss_scale_factor, ...) pass through.
        config, learning_rate, keras_kwargs = split_options(dict(options,
                                                                 learning_rate=learning_rate))
        if isinstance(learning_rate, FitWarmupCosine) and learning_rate.built:
            # Another optimizer's already: a copy, with state of its own.
            learning_rate = learning_rate.with_peak(learning_rate.peak,
                                                    learning_rate.reference_steps)
        super().__init__(learning_rate=learning_rate, name=name, **keras_kwargs)
        if isinstance(learning_rate, FitWarmupCosine):
            # Its run length and origin: variables of this optimizer (saved with it), created
            # here, in a fixed place among them (checkpoints load by index).
            learning_rate.build(self)
        #: The validated options, shared with the engine (:class:`thor_tf.config.ThorConfig`).
        self.config = config
        if config.weight_decay_exclude:
            self.exclude_from_weight_decay(var_names=list(config.weight_decay_exclude))
        self.engine = None
        self._gradients_reduced = False
        self._step_ok = None
        self._per_apply = None  # see once_per_apply
        self._marked = frozenset()  # see marked

    #: The :class:`thor_tf.rules.UpdateRule` in use.
    update_rule = property(lambda self: self.config.rule)
    #: False in a step that is skipped (non-finite loss or gradient): the rule masks every change.
    step_ok = property(lambda self: self._step_ok)

    def once_per_apply(self, key, make):
        """``make()`` once per ``apply`` being traced and ``key``, the same tensors after: for
        values every variable's ``update_step`` needs alike (Adam's bias corrections). Keras calls
        ``update_step`` per variable; recomputing them there cost ResNet-50's traced step ~12 ops
        per variable (docs/overhead.md, "Tracing"). Outside ``apply_masked``: ``make()``."""
        if self._per_apply is None:
            return make()
        if key not in self._per_apply:
            self._per_apply[key] = make()
        return self._per_apply[key]

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, engine):
        """Bind the model's engine (its registered blocks); must happen before ``build``."""
        if self.built and self.engine is not engine:
            raise ValueError("this ThorOptimizer is already built for another model")
        self.engine = engine

    # -- the split ---------------------------------------------------------------------------------
    @property
    def split_pending(self):
        """True while ``split_dim="auto"`` waits for its plan (``ThorModel.calibrate_split``, at
        the start of ``fit``): the state's shapes depend on it, so it is not built before."""
        return not self.built and self.config.split_dim == AUTO

    def resolve_split(self, plan):
        """Take ``plan`` (an int or a :class:`~thor_tf.split.plan.SplitPlan`) for
        ``split_dim="auto"``: the one place the optimizer's split changes, before it is built."""
        if self.built:
            raise ValueError(f"this optimizer is built with split_dim={self.config.split_dim}")
        self.config = dataclasses.replace(self.config, split_dim=plan)

    def build(self, var_list):
        if self.built:
            return
        if self.split_pending:
            # Built before the calibration (a custom loop's first apply, a restore): the rule's
            # default split, said once.
            default = self.config.rule.default_split
            warnings.warn(
                f"split_dim='auto' is calibrated at the start of fit (or by "
                f"model.calibrate_split(batches) before the first step); this optimizer was built "
                f"before either and uses the rule's default split_dim={default}.", stacklevel=2)
            self.resolve_split(default)
        super().build(var_list)
        #: The update rule's per-variable slots, ``{name: [one per trainable variable]}``.
        self.slots = self.config.rule.build_slots(self, var_list) or {}
        if self.engine is None:
            raise ValueError(
                "ThorOptimizer has no model attached: compile a model returned by thor_tf.wrap() "
                "with it (model.compile(optimizer=thor_tf.ThorOptimizer(...))).")
        self.engine.build_state(self, var_list)

    def slot(self, name, variable):
        """The update rule's slot ``name`` of ``variable`` (:attr:`slots`)."""
        return self.slots[name][_keras_compat.variable_index(self, variable)]

    def current_damping(self):
        """λ at the current step (float32 scalar tensor)."""
        damping = self.damping
        if isinstance(damping, keras.optimizers.schedules.LearningRateSchedule):
            damping = damping(self.iterations)
        elif callable(damping):
            damping = damping(self.iterations)
        return tf.cast(damping, tf.float32)

    # -- the update chain ----------------------------------------------------------------------------
    def marked(self, variable):
        """Whether the update rule's ``precondition`` marked ``variable`` in the step being
        applied (:meth:`thor_tf.rules.UpdateRule.precondition`; the eigenbasis rule: its
        gradient is already a step). Keyed as Keras keys variables: ``update_step`` gets the
        backend variable."""
        return _keras_compat.variable_key(self, variable) in self._marked

    def apply_masked(self, grads, variables, ok, marked=()):
        """``apply`` of already unscaled gradients, every change masked by the boolean ``ok``;
        ``marked``: the variables the update rule marked (:meth:`marked`).

        The engine divides the gradients by the loss scale before preconditioning (the KL clip
        must see true gradients), so Keras' own unscaling by ``loss_scale_factor`` is switched off
        here. A skipped step (``ok`` False) changes no weight and no momentum, and does not count
        in ``iterations`` (the convention of Keras' ``LossScaleOptimizer``): learning-rate and
        damping schedules and the cadence do not move over skipped batches.

        The gradients are already the global batch's (the engine all-reduces them before
        preconditioning, so that every replica preconditions the same gradient), so Keras'
        all-reduce of the gradients it is given is switched off: summing R identical
        preconditioned gradients would multiply the step by R.
        """
        self._step_ok = ok
        self._marked = frozenset(_keras_compat.variable_key(self, v) for v in marked)
        self._per_apply = {}
        if isinstance(self._learning_rate, FitWarmupCosine):
            self._learning_rate.note_step_outside_fit()
        loss_scale_factor, self.loss_scale_factor = self.loss_scale_factor, None
        self._gradients_reduced = True
        try:
            # Explicit class: autograph (a user's tf.function) cannot convert a zero-argument
            # super() (KeyError '__class__').
            super(ThorOptimizer, self).apply(grads, variables)
        finally:
            self._step_ok = None
            self._per_apply = None
            self._marked = frozenset()
            self._gradients_reduced = False
            self.loss_scale_factor = loss_scale_factor
        self.iterations.assign_sub(tf.cast(tf.logical_not(ok), self.iterations.dtype))

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Apply gradients the user's code computed (``apply_gradients`` comes here too): THOR's
        step with the curvature the layer hooks observed in this step (see
        :meth:`thor_tf.engine.ThorEngine.apply_gradients`). ``ThorModel.fit``'s own train step
        goes through the engine directly."""
        if self.engine is None:
            raise ValueError(
                "ThorOptimizer has no model attached: compile a model returned by thor_tf.wrap() "
                "with it (model.compile(optimizer=thor_tf.ThorOptimizer(...))), or pass it to "
                "the compile of a wrapped model (e.g. a GAN's d_optimizer).")
        if trainable_variables is None:
            if not self.built:
                raise ValueError("`trainable_variables` must be given to the first apply().")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with tf.init_scope():
                self.build(trainable_variables)
        self.engine.apply_gradients(list(grads), trainable_variables)
        return self.iterations

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras' TF backend all-reduces the gradients passed to ``apply`` (private hook, see
        # thor_tf/_keras_compat.py); THOR's are reduced before preconditioning.
        if self._gradients_reduced:
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def update_step(self, gradient, variable, learning_rate):
        self.config.rule.update_step(self, gradient, variable, learning_rate)

    # -- config ----------------------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update(self.config.get_config())
        for key in REFUSED_KERAS_ARGUMENTS:
            config.pop(key, None)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # What earlier releases saved is read in one place (the learning rate is Keras').
        learning_rate = config.get("learning_rate")
        config = {**saved_options({k: v for k, v in config.items() if k != "learning_rate"},
                                  custom_objects), "learning_rate": learning_rate}
        return super().from_config(config, custom_objects=custom_objects)


#: Why ``optimizer="thor"`` fails on a model that ``thor_tf.wrap`` did not return.
UNWRAPPED_THOR_MESSAGE = (
    'optimizer="thor" needs the model wrapped first: THOR takes each layer\'s inputs and output '
    "gradients from the hooks thor_tf.wrap installs. Call model = thor_tf.wrap(model), then "
    'model.compile(...) (THOR is its default optimizer; "thor" works there too).')


class _ThorByName:
    """What Keras finds for the string ``"thor"`` (``keras.optimizers.get`` looks string
    identifiers up among Keras' own optimizers, then in the custom objects registered globally):
    an error naming ``thor_tf.wrap``, raised when a model that was not wrapped is compiled with
    ``optimizer="thor"``. ``ThorModel.compile`` replaces ``"thor"`` before Keras sees it."""

    @classmethod
    def from_config(cls, config):
        raise ValueError(UNWRAPPED_THOR_MESSAGE)


keras.saving.get_custom_objects()["thor"] = _ThorByName


def _option_view(name):
    if name in RULE_OPTIONS:                    # the rule's (None under a rule without it)
        return property(lambda self: getattr(self.config.rule, name, None))
    if name in ("omega1", "omega2"):            # after the preset
        return property(lambda self: self.config.omegas[name == "omega2"])
    if name in TRACE_OPTIONS:                   # the trace rule's
        return property(lambda self: getattr(self.config.trace_rule, name))
    if name == "weight_decay_exclude":
        return property(lambda self: list(self.config.weight_decay_exclude)
                        if self.config.weight_decay_exclude else None)
    return property(lambda self: getattr(self.config, name))


# THOR's options as read-only views of ``config`` (what users and older code read), one per
# ThorConfig field and per option taken by name (the trace rule's, the update rule's).
# ``weight_decay`` is Keras' own attribute: THOR's is ``thor_weight_decay``.
for _name in THOR_OPTIONS + RULE_OPTIONS + TRACE_OPTIONS + ("cadence",):
    if _name not in ("update_rule",):
        setattr(ThorOptimizer, "thor_weight_decay" if _name == "weight_decay" else _name,
                _option_view(_name))
del _name
