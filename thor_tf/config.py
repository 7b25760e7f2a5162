"""``ThorConfig``: THOR's options, validated once and shared by the optimizer and the engine.

``thor_tf.wrap(model, **options)`` validates the options here (a ``ValueError`` naming the option
and the allowed values), the ``ThorOptimizer`` made at ``compile`` holds the same config, and the
engine reads its settings from it (``optimizer.config``) instead of from optimizer attributes.

Learning rate and Keras' own optimizer arguments (``loss_scale_factor``, ``name``, ...) are not
THOR's options: :func:`split_options` separates them and checks their names against Keras'
``Optimizer`` signature.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any, Optional, Tuple

import keras

from thor_tf import rules
from thor_tf.trace_rule import (DEFAULT_FREQUENCY, DEFAULT_MAX_BLOCK_AGE,  # noqa: F401
                                DEFAULT_TRACE_FILTER, TRACE_FILTERS, TraceRule, resolve_omegas)
from thor_tf.split.plan import resolve_split_dim, split_config

FISHER_TYPES = ("empirical", "sampled")
#: Options that belong to one update rule and live only there (``thor_tf.rules.Inverse(
#: momentum=..., damping_split=..., kl_clip=..., inverse_assignment=...)``); ``wrap`` and
#: ``ThorOptimizer`` still take them by name and hand them to the rule (:func:`split_options`,
#: :func:`thor_tf.rules.with_options`): ``wrap(model, update_rule="inverse", kl_clip=None)``. Set
#: on a rule that does not take them, they raise ``ValueError`` naming the rule.
RULE_OPTIONS = ("momentum", "kl_clip", "inverse_assignment", "damping_split")
#: What those options were worth in configs saved before they moved to the rule (every saved
#: config holds them, whatever its rule); one that differs on a rule without it had no effect.
_SAVED_RULE_OPTION_DEFAULTS = {"momentum": 0.9, "kl_clip": 0.001, "inverse_assignment": "all",
                               "damping_split": "sqrt"}


#: How the loss reduces over the batch (undone to make G the mean of per-example outer products):
#: "auto" reads the compiled loss in ``ThorModel.fit`` and assumes "mean" in the user's own code.
LOSS_REDUCTIONS = ("auto", "mean", "sum")
#: The trace rule's options (on :class:`thor_tf.trace_rule.TraceRule`), also taken by name.
TRACE_OPTIONS = TraceRule.options()
#: Keras optimizer arguments ThorOptimizer refuses (they would act before preconditioning).
REFUSED_KERAS_ARGUMENTS = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")


def is_schedule(value):
    """A ``LearningRateSchedule`` or a callable of the step."""
    return isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or callable(value)


def check_positive_or_schedule(name, value, allow_zero=False):
    if is_schedule(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"`{name}` must be a float {bound} or a LearningRateSchedule / callable of the step; "
            f"got {value!r}.")


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ThorConfig:
    """THOR's options (see ``ThorOptimizer`` for each one's meaning), validated on construction.

    The trace rule's options are one :class:`~thor_tf.trace_rule.TraceRule` (``trace_rule``;
    ``wrap`` also takes them by name: :data:`TRACE_OPTIONS`); ``split_dim`` is resolved to
    an int, a :class:`~thor_tf.split.plan.SplitPlan` or ``"auto"`` (a calibration JSON path is
    read once, here; ``"auto"`` becomes a plan at the start of ``fit``). The update rule's own
    options are on ``update_rule`` only (:data:`RULE_OPTIONS`).
    """

    damping: Any = 0.03
    weight_decay: float = 0.0
    weight_decay_exclude: Optional[Tuple[str, ...]] = None
    clip_norm: Optional[float] = None
    trace_rule: Any = None  # None: TraceRule(); a TraceRule or its config
    split_dim: Any = None  # None: the update rule's default_split
    fisher: str = "empirical"
    factor_decay: float = 0.0
    factor_examples: Optional[int] = None
    loss_reduction: str = "auto"
    update_rule: Any = None  # None: rules.DEFAULT_RULE

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("update_rule", rules.resolve(
            rules.DEFAULT_RULE if self.update_rule is None else self.update_rule))

        check_positive_or_schedule("damping", self.damping)
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"`weight_decay` must be a float >= 0; got {self.weight_decay!r}.")
        if self.clip_norm is not None and (not _is_real(self.clip_norm) or self.clip_norm <= 0):
            raise ValueError(f"`clip_norm` must be None or a float > 0; got {self.clip_norm!r}.")
        if self.fisher not in FISHER_TYPES:
            raise ValueError(f"`fisher` must be one of {list(FISHER_TYPES)}; got {self.fisher!r}.")
        if not _is_real(self.factor_decay) or not 0 <= self.factor_decay < 1:
            raise ValueError(f"`factor_decay` must be a float in [0, 1); got {self.factor_decay!r}.")
        k = self.factor_examples
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ValueError(f"`factor_examples` must be None or an int >= 1; got {k!r}.")
        if not isinstance(self.loss_reduction, str) or self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"`loss_reduction` must be one of {list(LOSS_REDUCTIONS)}; "
                             f"got {self.loss_reduction!r}.")
        exclude = self.weight_decay_exclude
        if exclude is not None and (isinstance(exclude, str)
                                    or not all(isinstance(p, str) for p in exclude)):
            raise ValueError(
                f"`weight_decay_exclude` must be None or a list of variable-name patterns; "
                f"got {exclude!r}.")
        set_("weight_decay_exclude", tuple(exclude) if exclude else None)
        set_("weight_decay", float(self.weight_decay))
        set_("clip_norm", None if self.clip_norm is None else float(self.clip_norm))
        set_("factor_decay", float(self.factor_decay))
        set_("factor_examples", None if k is None else int(k))
        set_("split_dim", resolve_split_dim(
            self.update_rule.default_split if self.split_dim is None else self.split_dim))
        trace = self.trace_rule
        if trace is None:
            trace = TraceRule()
        elif isinstance(trace, dict):
            trace = TraceRule.from_config(trace)
        elif not isinstance(trace, TraceRule):
            raise ValueError(f"`trace_rule` must be a thor_tf.TraceRule (or its config); got "
                             f"{trace!r}.")
        set_("trace_rule", trace)

    @property
    def omegas(self):
        """``(ω1, ω2)`` of the trace rule (its preset's, overridden by explicit values)."""
        return self.trace_rule.omegas

    @property
    def cadence(self):
        """The trace rule's :class:`~thor_tf.trace_rule.CadenceSchedule` (``frequency``)."""
        return self.trace_rule.cadence

    @property
    def rule(self):
        """The :class:`~thor_tf.rules.UpdateRule` instance (``update_rule`` resolved)."""
        return self.update_rule

    def options(self):
        """The options as constructor keywords (live objects: schedules, callables); the rule's
        own options are on ``update_rule``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def get_config(self):
        """JSON-able options (schedules serialized; a callable ``frequency`` becomes the default,
        as callables do not serialize)."""
        out = self.options()
        if is_schedule(self.damping) and not _is_real(self.damping):
            out["damping"] = keras.saving.serialize_keras_object(self.damping)
        out["trace_rule"] = self.trace_rule.get_config()
        out["weight_decay_exclude"] = list(self.weight_decay_exclude) if self.weight_decay_exclude else None
        out["update_rule"] = rules.serialize(self.update_rule)
        out["split_dim"] = split_config(self.split_dim)
        return out

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(**saved_options(config, custom_objects))


THOR_OPTIONS = tuple(f.name for f in dataclasses.fields(ThorConfig))


def saved_options(config, custom_objects=None):
    """Constructor keywords from a saved config of THOR's options (``ThorConfig``,
    ``ThorOptimizer`` or ``ThorModel``'s ``thor_options``; the one place that reads what earlier
    releases saved):

    * schedules (``learning_rate``, ``damping``) deserialized;
    * the trace rule's options, top-level in configs saved before they had a home of their own
      (:data:`TRACE_OPTIONS`), or its config: one :class:`~thor_tf.trace_rule.TraceRule`;
    * ``update_rule``: absent (saved before update rules existed) is the inverse rule, THOR's
      only one then; a bare name that meant other settings then is read as those
      (:func:`thor_tf.rules.from_saved`);
    * ``trace_smoothing`` (replaced by ``trace_filter``) is not carried;
    * :data:`RULE_OPTIONS` (top-level in configs saved before the options moved to the rules,
      all four whatever the rule) are handed to the rule when it takes them, and dropped when it
      does not (they did nothing there; one that was not at its default says so in a warning).
    """
    import warnings

    config = dict(config)
    config.pop("trace_smoothing", None)
    for key in ("learning_rate", "damping"):
        if isinstance(config.get(key), dict):
            config[key] = keras.saving.deserialize_keras_object(config[key],
                                                                custom_objects=custom_objects)
    flat = {name: config.pop(name) for name in TRACE_OPTIONS if name in config}
    trace = config.get("trace_rule")
    trace = TraceRule.from_config(trace) if isinstance(trace, dict) else trace or TraceRule()
    if flat:
        if isinstance(flat.get("frequency"), list):
            flat["frequency"] = [tuple(p) for p in flat["frequency"]]
        trace = trace.with_options(flat, explicit=False)
    config["trace_rule"] = trace
    config["update_rule"] = rules.from_saved(config.get("update_rule", "inverse"))
    rule = rules.resolve(config["update_rule"] or rules.DEFAULT_RULE)
    taken = {}
    for name in [name for name in RULE_OPTIONS if name in config]:
        value = config.pop(name)
        if rules.takes_option(rule, name):
            taken[name] = value
        elif value is not None and value != _SAVED_RULE_OPTION_DEFAULTS[name]:
            warnings.warn(f"thor_tf: the saved option {name}={value!r} is not used by the "
                          f"{rule.name!r} update rule (it never was); it is dropped.",
                          stacklevel=3)
    if taken:
        config["update_rule"] = rules.with_options(rule, taken)
    return config


def keras_optimizer_arguments():
    """Names ``keras.optimizers.Optimizer`` accepts (learning_rate, name, loss_scale_factor, ...)."""
    # The backend's Optimizer takes (*args, **kwargs) and passes them on: the named arguments are
    # those of the first class in its MRO that names them (Keras' BaseOptimizer).
    for cls in keras.optimizers.Optimizer.__mro__:
        names = tuple(p for p in inspect.signature(cls.__init__).parameters
                      if p not in ("self", "args", "kwargs"))
        if names:
            return names
    return ()


def split_options(options):
    """``(ThorConfig, learning_rate, keras_kwargs)`` from ``wrap``/``ThorOptimizer`` options.

    Raises ``ValueError`` for a bad value, a refused Keras argument or an unknown name.
    """
    options = dict(options)
    for refused in REFUSED_KERAS_ARGUMENTS:
        if options.get(refused) is None:
            options.pop(refused, None)
            continue
        if refused == "gradient_accumulation_steps":
            raise ValueError(
                "`gradient_accumulation_steps` is not supported by ThorOptimizer (factors are "
                "per batch); use a larger batch size.")
        raise ValueError(
            f"`{refused}` is not supported by ThorOptimizer (it would clip before "
            f"preconditioning); use `clip_norm`, which clips the update in THOR's order.")
    if "trace_smoothing" in options:
        raise ValueError(
            f"`trace_smoothing` was replaced by `trace_filter` (one of {list(TRACE_FILTERS)}; "
            f"\"none\" is the rule as published); got trace_smoothing="
            f"{options['trace_smoothing']!r}.")
    learning_rate = options.pop("learning_rate", None)
    thor = {k: options.pop(k) for k in THOR_OPTIONS if k in options}
    by_name = {k: options.pop(k) for k in RULE_OPTIONS if k in options}
    trace_by_name = {k: options.pop(k) for k in TRACE_OPTIONS if k in options}
    allowed = keras_optimizer_arguments()
    unknown = sorted(k for k in options if k not in allowed)
    if unknown:
        keras_arguments = [a for a in allowed if a not in REFUSED_KERAS_ARGUMENTS]
        raise ValueError(
            f"unknown option(s) {unknown}: THOR's options are {list(THOR_OPTIONS)}, the trace "
            f"rule's {list(TRACE_OPTIONS)} and the update rule's {list(RULE_OPTIONS)} by name, "
            f"plus `learning_rate` and Keras optimizer arguments {keras_arguments}.")
    if by_name:
        thor["update_rule"] = rules.with_options(
            rules.resolve(thor.get("update_rule") or rules.DEFAULT_RULE), by_name)
    if trace_by_name:
        given = thor.get("trace_rule")
        trace = (TraceRule.from_config(given) if isinstance(given, dict) else given) or TraceRule()
        if not isinstance(trace, TraceRule):
            raise ValueError(f"`trace_rule` must be a thor_tf.TraceRule (or its config); got "
                             f"{given!r}.")
        thor["trace_rule"] = trace.with_options(trace_by_name, explicit=given is not None)
    config = ThorConfig(**thor)
    return config, resolve_learning_rate(learning_rate, config.rule), options


def resolve_learning_rate(learning_rate, rule):
    """``learning_rate`` with None → ``thor_tf.schedules.FitWarmupCosine`` (warmup + cosine over
    the length ``fit`` knows; constant outside fit) at the rule's ``default_learning_rate``, and a
    ``WarmupCosine`` / ``FitWarmupCosine`` without a peak given that rate as its peak and the
    rule's ``reference_steps`` (a copy: a longer run takes a lower peak)."""
    from thor_tf.schedules import FitWarmupCosine, WarmupCosine

    if learning_rate is None:
        learning_rate = FitWarmupCosine()
    if isinstance(learning_rate, (WarmupCosine, FitWarmupCosine)) and learning_rate.peak is None:
        learning_rate = learning_rate.with_peak(rule.default_learning_rate,
                                                getattr(rule, "reference_steps", None))
    check_positive_or_schedule("learning_rate", learning_rate)
    return learning_rate
