"""THOR's learning-rate and damping schedules as Keras ``LearningRateSchedule``s.

:class:`WarmupCosine` (linear warmup, then cosine) is the schedule of a run of known length;
:class:`FitWarmupCosine`, THOR's default rate, is the same over the length ``ThorModel.fit``
sets (two optimizer variables), constant at its peak where no length is known. Both take an
optional ``reference_steps`` R: a run of T > R steps scales the schedule by ``sqrt(R/T)``
(:func:`horizon_scale`); ``wrap`` gives a schedule without a peak the rule's rate and R.

:class:`ThorPolynomialDecay` and :class:`ThorDampingDecay` follow MindSpore's ``get_thor_lr`` /
``get_thor_damping`` (model_zoo ResNet-50 + THOR), which precompute one value per step with a
**0-based** step ``i`` and::

    epoch = (i + 1) / steps_per_epoch

Here the same formula is evaluated on the fly from the optimizer's ``iterations`` counter, so
``schedule(step)`` equals MindSpore's ``lr_each_step[step]``. Every schedule here computes in
float64 (``step`` may be a large int64), returns a float32 scalar tensor and works inside
``tf.function`` with a tensor or ``tf.Variable`` step.

Past ``end_epoch`` the polynomial decay is clamped at 0 (MindSpore's arrays
simply end there).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import keras
import tensorflow as tf

__all__ = [
    "MINDSPORE_RESNET50_PRESETS",
    "horizon_scale",
    "WarmupCosine",
    "FitWarmupCosine",
    "ThorDampingDecay",
    "ThorPolynomialDecay",
    "mindspore_resnet50",
]


def _check_number(name: str, value, *, positive: bool = True, allow_zero: bool = False):
    """Return ``value`` as a float after validating it (``name`` is for the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # accept NumPy scalars and 0-d arrays
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a real number; got {value!r}") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value!r}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}; got {value!r}")
    return value

def _checked_shape(peak, warmup_fraction, floor):
    """``(peak, warmup_fraction, floor)`` of a warmup + cosine, checked: peak > 0 or None (the
    rule's), warmup_fraction in [0, 1), 0 <= floor <= peak."""
    peak = None if peak is None else _check_number("peak", peak)
    fraction = _check_number("warmup_fraction", warmup_fraction, allow_zero=True)
    if fraction >= 1:
        raise ValueError(f"warmup_fraction must be in [0, 1); got {warmup_fraction!r}")
    checked_floor = _check_number("floor", floor, allow_zero=True)
    if peak is not None and checked_floor > peak:
        raise ValueError(f"floor must be <= peak ({peak}); got {floor!r}")
    return peak, fraction, checked_floor


def _check_positive_int(name: str, value, *, allow_none: bool = False):
    """``value`` as an int > 0 (or None where allowed), else a ValueError naming ``name``."""
    if allow_none and value is None:
        return None
    try:
        ok = not isinstance(value, bool) and int(value) == value and value > 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        allowed = "None or a positive integer" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
    return int(value)


def horizon_scale(total_steps, reference_steps):
    """The factor a run of ``total_steps`` scales its schedule by (Python float):
    ``sqrt(reference_steps / total_steps)`` for a run longer than ``reference_steps``, else 1
    (also for ``reference_steps`` None or an unknown length, ``total_steps`` 0)."""
    if reference_steps is None or not total_steps or total_steps <= reference_steps:
        return 1.0
    return math.sqrt(reference_steps / total_steps)


def _check_steps_per_epoch(value) -> int:
    return _check_positive_int("steps_per_epoch", value)


def _epoch(step, steps_per_epoch: int):
    """MindSpore's epoch for a 0-based step, as float64: ``(step + 1) / steps_per_epoch``."""
    step = tf.cast(tf.convert_to_tensor(step), tf.float64)
    return (step + 1.0) / tf.constant(float(steps_per_epoch), tf.float64)


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """THOR's polynomial learning-rate decay with an optional late double halving.

    ``lr(step) = lr0 * max(0, 1 - epoch / end_epoch) ** decay`` with
    ``epoch = (step + 1) / steps_per_epoch``; if ``decay_epochs`` is set, the
    value is halved once ``epoch >= decay_epochs`` and halved again once
    ``epoch >= decay_epochs + 1`` (MindSpore uses ``decay_epochs=39`` for
    ResNet-50).

    Args:
        initial_learning_rate: ``lr0 > 0``.
        end_epoch: epoch at which the rate reaches 0 (``> 0``).
        decay: polynomial power (``> 0``).
        steps_per_epoch: optimizer steps per epoch (positive int).
        decay_epochs: optional epoch (``>= 0``) of the first halving.
    """

    def __init__(
        self,
        initial_learning_rate: float,
        end_epoch: float,
        decay: float,
        steps_per_epoch: int,
        decay_epochs: Optional[float] = None,
    ):
        super().__init__()
        self.initial_learning_rate = _check_number("initial_learning_rate", initial_learning_rate)
        self.end_epoch = _check_number("end_epoch", end_epoch)
        self.decay = _check_number("decay", decay)
        self.steps_per_epoch = _check_steps_per_epoch(steps_per_epoch)
        self.decay_epochs = (
            None
            if decay_epochs is None
            else _check_number("decay_epochs", decay_epochs, allow_zero=True)
        )

    def __call__(self, step):
        with tf.name_scope("ThorPolynomialDecay"):
            epoch = _epoch(step, self.steps_per_epoch)
            base = tf.maximum(1.0 - epoch / self.end_epoch, tf.constant(0.0, tf.float64))
            lr = self.initial_learning_rate * tf.pow(base, self.decay)
            if self.decay_epochs is not None:
                half = tf.constant(0.5, tf.float64)
                one = tf.constant(1.0, tf.float64)
                lr = lr * tf.where(epoch >= self.decay_epochs, half, one)
                lr = lr * tf.where(epoch >= self.decay_epochs + 1.0, half, one)
            return tf.cast(lr, tf.float32)

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "end_epoch": self.end_epoch,
            "decay": self.decay,
            "steps_per_epoch": self.steps_per_epoch,
            "decay_epochs": self.decay_epochs,
        }


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorDampingDecay(keras.optimizers.schedules.LearningRateSchedule):
    """THOR's exponential damping decay: ``damping = λ0 * decay_rate ** (epoch / 10)``.

    ``epoch = (step + 1) / steps_per_epoch`` as in :class:`ThorPolynomialDecay`.
    It is a ``LearningRateSchedule`` only so that it gets Keras serialization
    and the ``schedule(iterations)`` calling convention for free.

    Args:
        initial_damping: ``λ0 > 0``.
        decay_rate: factor per 10 epochs (``> 0``; ``< 1`` decays).
        steps_per_epoch: optimizer steps per epoch (positive int).
    """

    def __init__(self, initial_damping: float, decay_rate: float, steps_per_epoch: int):
        super().__init__()
        self.initial_damping = _check_number("initial_damping", initial_damping)
        self.decay_rate = _check_number("decay_rate", decay_rate)
        self.steps_per_epoch = _check_steps_per_epoch(steps_per_epoch)

    def __call__(self, step):
        with tf.name_scope("ThorDampingDecay"):
            epoch = _epoch(step, self.steps_per_epoch)
            rate = tf.constant(self.decay_rate, tf.float64)
            return tf.cast(self.initial_damping * tf.pow(rate, epoch / 10.0), tf.float32)

    def get_config(self):
        return {
            "initial_damping": self.initial_damping,
            "decay_rate": self.decay_rate,
            "steps_per_epoch": self.steps_per_epoch,
        }


def _warmup_cosine(step, total, warmup, peak, floor, start=None):
    """:class:`WarmupCosine`'s formula on float64 tensors ``step`` (0-based), ``total`` (T) and
    ``warmup`` (W); ``peak`` and ``floor`` are Python floats; ``start`` (float64 tensor, S >= W)
    the step the cosine starts from, the rate held at ``peak`` from W to S (None: S = W).
    Returns float64."""
    start = warmup if start is None else start
    ramp = peak * tf.minimum((step + 1.0) / tf.maximum(warmup, 1.0), 1.0)
    progress = tf.clip_by_value((step - start) / tf.maximum(total - start, 1.0), 0.0, 1.0)
    cosine = floor + (peak - floor) * 0.5 * (1.0 + tf.cos(math.pi * progress))
    return tf.where(step < warmup, ramp, cosine)


def _check_decay_fraction(value):
    """``decay_fraction`` as a float in (0, 1], or None (the cosine spans the run after warmup)."""
    if value is None:
        return None
    fraction = _check_number("decay_fraction", value)
    if not 0 < fraction <= 1:
        raise ValueError(f"decay_fraction must be None or in (0, 1]; got {value!r}")
    return fraction


@keras.saving.register_keras_serializable(package="thor_tf")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then cosine decay: the schedule sized by the run's length alone.

    With a 0-based ``step``, ``W = round(warmup_fraction * total_steps)`` and ``T = total_steps``::

        lr(step) = peak * (step + 1) / W                                   step < W
        lr(step) = floor + (peak - floor) * (1 + cos(pi * (step - W) / (T - W))) / 2   otherwise

    reaching ``floor`` at ``step = T`` and staying there after it. The same shape as the standard
    first-order recipe (Keras' ``CosineDecay(warmup_steps=...)``). With ``decay_fraction`` f the
    cosine spans only the run's last ``D = round(f * T)`` steps, the rate held at ``peak`` before
    them (warmup, stable, decay: the shape of modded-nanogpt's and MiniCPM's "WSD" runs, here
    with a cosine cooldown)::

        S = max(W, T - D)
        lr(step) = peak                                                  W <= step < S
        lr(step) = floor + (peak - floor) * (1 + cos(pi * (step - S) / (T - S))) / 2   step >= S

    (``D >= T - W``: S = W, the formula above.) ``thor_tf.wrap(model,
    learning_rate=thor_tf.schedules.WarmupCosine(total_steps))`` is THOR's default for a run of
    known length (``total_steps`` = epochs x steps per epoch).

    Args:
        total_steps: optimizer steps of the run (positive int).
        peak: the rate after warmup. None (default): the update rule's rate, filled in when the
            schedule is given to ``thor_tf.wrap`` / ``ThorOptimizer`` (the eigenbasis rule's
            0.03 with its ``reference_steps`` 256, ``step="adam"``'s 0.01, the inverse rule's
            0.05); elsewhere a peak must be given.
        warmup_fraction: share of the run spent warming up, in ``[0, 1)`` (default 0.05).
        floor: the final rate, ``0 <= floor <= peak`` (default 0).
        decay_fraction: the share of the run the cosine spans, ending at ``total_steps``, in
            ``(0, 1]``; the rate stays at ``peak`` from the warmup's end until then. None
            (default): the cosine spans every step after warmup.
        reference_steps: the run length ``peak`` was tuned at (None, the default for a peak you
            give: the schedule as written). A longer run scales the whole schedule (peak and
            floor) by ``s = sqrt(reference_steps / total_steps)``; a shorter one keeps it. A
            schedule without a peak that ``wrap`` fills in with the rule's rate also takes the
            rule's ``reference_steps`` (the eigenbasis rule: 3e-2 up to 256 steps, so 1.28e-2
            over 1,407 steps): longer runs want lower peaks (docs/suite.md, "The peak and the
            run's length").
    """

    def __init__(self, total_steps: int, peak: Optional[float] = None,
                 warmup_fraction: float = 0.05, floor: float = 0.0,
                 reference_steps: Optional[int] = None,
                 decay_fraction: Optional[float] = None):
        super().__init__()
        self.total_steps = _check_positive_int("total_steps", total_steps)
        self.peak, self.warmup_fraction, self.floor = _checked_shape(peak, warmup_fraction, floor)
        self.warmup_steps = int(round(self.warmup_fraction * self.total_steps))
        self.reference_steps = _check_positive_int("reference_steps", reference_steps,
                                                   allow_none=True)
        self.decay_fraction = _check_decay_fraction(decay_fraction)

    @property
    def decay_start(self):
        """S: the step the cosine starts from (the warmup's end W without ``decay_fraction``)."""
        if self.decay_fraction is None:
            return self.warmup_steps
        decay_steps = int(round(self.decay_fraction * self.total_steps))
        return max(self.warmup_steps, self.total_steps - decay_steps)

    @property
    def scale(self):
        """``s``: the factor the run's length puts on the schedule (1 unless it is longer than
        ``reference_steps``)."""
        return horizon_scale(self.total_steps, self.reference_steps)

    @property
    def effective_peak(self):
        """The rate after warmup, ``s·peak`` (None without a peak)."""
        return None if self.peak is None else self.scale * self.peak

    def with_peak(self, peak, reference_steps=None):
        """A copy with ``peak`` and ``reference_steps`` (what ``wrap`` does with a schedule whose
        peak is None: the rule's)."""
        return WarmupCosine(self.total_steps, peak, self.warmup_fraction, self.floor,
                            reference_steps, self.decay_fraction)

    def __call__(self, step):
        _require_peak(self)
        with tf.name_scope("WarmupCosine"):
            step = tf.cast(tf.convert_to_tensor(step), tf.float64)
            total = tf.constant(float(self.total_steps), tf.float64)
            warmup = tf.constant(float(self.warmup_steps), tf.float64)
            start = tf.constant(float(self.decay_start), tf.float64)
            lr = _warmup_cosine(step, total, warmup, self.peak, self.floor, start)
            if self.scale != 1.0:
                lr = tf.constant(self.scale, tf.float64) * lr
            return tf.cast(lr, tf.float32)

    def get_config(self):
        return {"total_steps": self.total_steps, "peak": self.peak,
                "warmup_fraction": self.warmup_fraction, "floor": self.floor,
                "reference_steps": self.reference_steps, "decay_fraction": self.decay_fraction}


#: What the default schedule's notices name instead (WarmupCosine needs the run's length).
EXPLICIT_SCHEDULE = ("learning_rate=thor_tf.schedules.WarmupCosine(total_steps) to thor_tf.wrap / "
                     "ThorOptimizer")


@keras.saving.register_keras_serializable(package="thor_tf")
class FitWarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """THOR's default learning rate: :class:`WarmupCosine` over the length that ``fit`` knows.

    ``thor_tf.wrap(model)`` / ``ThorOptimizer()`` without a ``learning_rate`` get this schedule.
    ``ThorModel.fit`` sets its run length T (optimizer steps) and origin O (the ``iterations``
    value at the run's step 0) before its first step, and then::

        lr(step) = WarmupCosine(T, peak, warmup_fraction, floor,
                                reference_steps)(step - O)                     T > 0
        lr(step) = peak                                                         T = 0

    the same float64 formula as :class:`WarmupCosine`, so the rates and the trained weights are
    those of the explicit schedule bit for bit. T and O are int64 variables of the optimizer
    (created with it; ``model.save`` / ``keras.models.load_model`` and ``tf.train.Checkpoint``
    save and restore them, so a run resumed from a checkpoint taken during ``fit`` continues its
    schedule) and the choice between T > 0 and T = 0 is a tensor: the train step is traced once,
    whatever the length of each ``fit``.

    What ``fit(epochs=E, initial_epoch=k)`` with S steps per epoch (Keras' ``steps``: the batches
    of the data, or ``steps_per_epoch``) sets at its first epoch:

    * ``k = 0``: a new run. T = E·S, O = ``iterations`` now: a second ``fit`` on a model that
      trained already starts a new warmup + cosine over its own steps.
    * ``k > 0``: the rest of a run of E epochs whose first k are done (Keras' meaning of
      ``initial_epoch``: resuming a run). T = E·S, O = ``iterations`` − k·S: ``fit(epochs=3)``
      then ``fit(epochs=6, initial_epoch=3)`` gives in its second call the rates
      ``WarmupCosine(6·S)`` gives at steps 3·S … 6·S − 1.
    * S unknown (a dataset of unknown length and no ``steps_per_epoch``): T = 0, and one line says
      so (once per optimizer).

    T = 0 also where no ``fit`` of the wrapped model set a length: a custom loop, a GAN's
    optimizer that the GAN's own ``fit`` drives. The rate is then constant at ``peak`` (no run
    length, so no warmup length either: what the default rate was before it learned ``fit``'s
    length), and one line says so when the optimizer's step is first traced (or first run
    eagerly), once per optimizer, naming what to pass instead. After a ``fit`` the schedule stays
    as that fit set it (at ``floor`` once its steps are done), as an explicit ``WarmupCosine``
    would; a custom loop after it continues it. Skipped (non-finite) steps do not count in
    ``iterations`` and do not move the schedule.

    ``fit`` assumes one optimizer step per batch (true of its own step and of a ``train_step``
    that applies the optimizer once); a ``train_step`` that applies it more often (a critic
    trained k times per batch) is warned about after the first epoch: pass a ``WarmupCosine`` of
    the true length there.

    Args:
        peak: the rate after warmup; None (default): the update rule's, filled in by
            ``thor_tf.wrap`` / ``ThorOptimizer`` (eigenbasis 0.03, eigenbasis_adam 0.01, inverse 0.05).
        warmup_fraction: share of the run spent warming up, in ``[0, 1)`` (default 0.05).
        floor: the final rate, ``0 <= floor <= peak`` (default 0).
        reference_steps: as :class:`WarmupCosine`'s: a run of T > ``reference_steps`` steps
            scales the schedule by ``sqrt(reference_steps / T)`` (None, the default for a peak
            you give: no scaling; ``wrap`` gives the default schedule the rule's, the eigenbasis
            rule's 256). The factor is computed from T in the graph: no retrace per length.
    """

    def __init__(self, peak: Optional[float] = None, warmup_fraction: float = 0.05,
                 floor: float = 0.0, reference_steps: Optional[int] = None):
        super().__init__()
        self.peak, self.warmup_fraction, self.floor = _checked_shape(peak, warmup_fraction, floor)
        self.reference_steps = _check_positive_int("reference_steps", reference_steps,
                                                   allow_none=True)
        self._length = None  # (T, O) variables, created on an optimizer by ``build``
        #: True while a ``ThorModel.fit`` that sets the length runs (Python; set by that fit).
        self.inside_fit = False
        self._told = set()

    def with_peak(self, peak, reference_steps=None):
        """A copy with ``peak``, ``reference_steps`` and no variables (what ``wrap`` does with
        ``peak=None``: the rule's)."""
        return FitWarmupCosine(peak, self.warmup_fraction, self.floor, reference_steps)

    # -- state -----------------------------------------------------------------------------------
    @property
    def built(self):
        return self._length is not None

    def build(self, optimizer):
        """Create T and O as variables of ``optimizer`` (saved and restored with it)."""
        if self.built:
            raise ValueError("this FitWarmupCosine already belongs to an optimizer")
        self._length = tuple(
            optimizer.add_variable((), initializer="zeros", dtype="int64",
                                   aggregation="only_first_replica", name=name)
            for name in ("fit_schedule_total_steps", "fit_schedule_origin"))

    @property
    def total_steps(self):
        """T: the run's length in optimizer steps (0: none known; the rate is ``peak``)."""
        return int(self._length[0].numpy()) if self.built else 0

    @property
    def origin(self):
        """O: the optimizer's ``iterations`` at the run's step 0."""
        return int(self._length[1].numpy()) if self.built else 0

    def set_run(self, iterations, epochs, initial_epoch, steps_per_epoch):
        """Set T and O for ``fit(epochs, initial_epoch)`` with ``steps_per_epoch`` (None:
        unknown, T = 0) at the optimizer's ``iterations`` (see the class docstring)."""
        if not self.built:
            raise ValueError("FitWarmupCosine has no variables: give it to a ThorOptimizer")
        total, origin = 0, int(iterations)
        if steps_per_epoch:
            total = int(epochs) * int(steps_per_epoch)
            origin = int(iterations) - int(initial_epoch) * int(steps_per_epoch)
        self._length[0].assign(total)
        self._length[1].assign(origin)
        if not steps_per_epoch:
            self._tell("unknown_steps", (
                f"thor_tf: fit does not know its steps per epoch (data of unknown length), so "
                f"the default learning rate is constant at {self.peak:g} in it; pass "
                f"steps_per_epoch=... to fit, or {EXPLICIT_SCHEDULE}."))

    # -- notices ---------------------------------------------------------------------------------
    def _tell(self, kind, line):
        if kind not in self._told:
            self._told.add(kind)
            print(line)

    def note_step_outside_fit(self):
        """Called (in Python: at trace time, or each eager step) by the optimizer's update: outside
        a ``fit`` that sets the length, say once what the rate is and what to pass instead."""
        if self.inside_fit or "outside_fit" in self._told:
            return
        total = origin = 0
        try:
            with tf.init_scope():  # the values now, read once (not a per-step host read)
                total, origin = self.total_steps, self.origin
        except Exception:  # noqa: BLE001 - a variable that cannot be read here: say the default
            pass
        if total:
            line = (f"thor_tf: outside ThorModel.fit the default learning rate continues the "
                    f"warmup + cosine a fit set ({total} steps from step {origin}, then "
                    f"{self.floor:g}); for another run pass {EXPLICIT_SCHEDULE}.")
        else:
            line = (f"thor_tf: outside ThorModel.fit no run length is known, so the default "
                    f"learning rate is constant at {self.peak:g} (no warmup, no decay); for "
                    f"warmup + cosine pass {EXPLICIT_SCHEDULE}.")
        self._tell("outside_fit", line)

    # -- the rate --------------------------------------------------------------------------------
    def __call__(self, step):
        _require_peak(self)
        with tf.name_scope("FitWarmupCosine"):
            step = tf.cast(tf.convert_to_tensor(step), tf.int64)
            if self.built:
                total = tf.cast(tf.convert_to_tensor(self._length[0]), tf.float64)
                origin = tf.cast(tf.convert_to_tensor(self._length[1]), tf.int64)
            else:
                total, origin = tf.constant(0.0, tf.float64), tf.constant(0, tf.int64)
            warmup = tf.round(self.warmup_fraction * total)  # Python's round(): half to even
            run_step = tf.cast(step - origin, tf.float64)
            scheduled = _warmup_cosine(run_step, total, warmup, self.peak, self.floor)
            if self.reference_steps is not None:
                # horizon_scale in the graph: sqrt(R / T) past R steps (IEEE division and sqrt:
                # the same float64 as WarmupCosine's Python factor), else exactly 1.
                reference = tf.constant(float(self.reference_steps), tf.float64)
                scale = tf.where(total > reference,
                                 tf.sqrt(reference / tf.maximum(total, 1.0)),
                                 tf.constant(1.0, tf.float64))
                scheduled = tf.where(total > reference, scale * scheduled, scheduled)
            lr = tf.where(total > 0.0, scheduled, tf.constant(self.peak, tf.float64))
            return tf.cast(lr, tf.float32)

    def get_config(self):
        return {"peak": self.peak, "warmup_fraction": self.warmup_fraction, "floor": self.floor,
                "reference_steps": self.reference_steps}


#: MindSpore model_zoo ResNet-50/ImageNet THOR settings (``config_thor_gpu`` /
#: ``config_thor_Ascend`` in ``src/config.py``; ``train.py`` passes
#: ``decay_epochs=39`` to ``get_thor_lr``). Batch size 32 per device, 8 devices.
MINDSPORE_RESNET50_PRESETS = {
    "gpu": dict(lr_init=0.05672, lr_decay=4.9687, lr_end_epoch=50,
                damping_init=0.02345, damping_decay=0.5467, decay_epochs=39),
    "ascend": dict(lr_init=0.05803, lr_decay=4.04839, lr_end_epoch=53,
                   damping_init=0.02714, damping_decay=0.50036, decay_epochs=39),
}


def mindspore_resnet50(
    preset: str, steps_per_epoch: int
) -> Tuple[ThorPolynomialDecay, ThorDampingDecay]:
    """The ``(lr_schedule, damping_schedule)`` pair of MindSpore's THOR ResNet-50.

    Args:
        preset: ``"gpu"`` or ``"ascend"`` (see :data:`MINDSPORE_RESNET50_PRESETS`).
        steps_per_epoch: optimizer steps per epoch (MindSpore: 5004 on ImageNet
            with 8 x 32 images per step).
    """
    if preset not in MINDSPORE_RESNET50_PRESETS:
        raise ValueError(
            f"preset must be one of {', '.join(repr(p) for p in MINDSPORE_RESNET50_PRESETS)}; "
            f"got {preset!r}"
        )
    p = MINDSPORE_RESNET50_PRESETS[preset]
    lr = ThorPolynomialDecay(
        p["lr_init"], p["lr_end_epoch"], p["lr_decay"], steps_per_epoch, p["decay_epochs"]
    )
    damping = ThorDampingDecay(p["damping_init"], p["damping_decay"], steps_per_epoch)
    return lr, damping


def _require_peak(schedule):
    """Raise when a warmup-cosine schedule is called without its peak (set by ``wrap`` or
    ``ThorOptimizer`` to the update rule's rate when the user gives none)."""
    if schedule.peak is None:
        raise ValueError(
            f"{type(schedule).__name__} has no peak: give it to thor_tf.wrap / ThorOptimizer "
            "(which set the update rule's rate) or pass peak=... for another optimizer.")
