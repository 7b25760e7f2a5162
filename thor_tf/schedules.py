"""THOR's learning-rate and damping schedules as Keras ``LearningRateSchedule``s.

Both follow MindSpore's ``get_thor_lr`` / ``get_thor_damping`` (model_zoo
ResNet-50 + THOR), which precompute one value per step with a **0-based** step
``i`` and::

    epoch = (i + 1) / steps_per_epoch

Here the same formula is evaluated on the fly from the optimizer's
``iterations`` counter, so ``schedule(step)`` equals MindSpore's
``lr_each_step[step]``. Arithmetic is done in float64 (``step`` may be a large
int64) and the result is returned as a float32 scalar tensor. Both schedules
work inside ``tf.function`` with a tensor or ``tf.Variable`` step.

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
    "WarmupCosine",
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


def _check_steps_per_epoch(value) -> int:
    try:
        ok = not isinstance(value, bool) and int(value) == value and value > 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"steps_per_epoch must be a positive integer; got {value!r}")
    return int(value)


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


@keras.saving.register_keras_serializable(package="thor_tf")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then cosine decay: the schedule sized by the run's length alone.

    With a 0-based ``step``, ``W = round(warmup_fraction * total_steps)`` and ``T = total_steps``::

        lr(step) = peak * (step + 1) / W                                   step < W
        lr(step) = floor + (peak - floor) * (1 + cos(pi * (step - W) / (T - W))) / 2   otherwise

    reaching ``floor`` at ``step = T`` and staying there after it. The same shape as the standard
    first-order recipe (Keras' ``CosineDecay(warmup_steps=...)``); ``thor_tf.wrap(model,
    learning_rate=thor_tf.schedules.WarmupCosine(total_steps))`` is THOR's default for a run of
    known length (``total_steps`` = epochs x steps per epoch).

    Args:
        total_steps: optimizer steps of the run (positive int).
        peak: the rate after warmup. None (default): the update rule's rate, filled in when the
            schedule is given to ``thor_tf.wrap`` / ``ThorOptimizer`` (the eigenbasis rule's
            0.01, the inverse rule's 0.05); elsewhere a peak must be given.
        warmup_fraction: share of the run spent warming up, in ``[0, 1)`` (default 0.05).
        floor: the final rate, ``0 <= floor <= peak`` (default 0).
    """

    def __init__(self, total_steps: int, peak: Optional[float] = None,
                 warmup_fraction: float = 0.05, floor: float = 0.0):
        super().__init__()
        try:
            ok = not isinstance(total_steps, bool) and int(total_steps) == total_steps \
                and total_steps > 0
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ValueError(f"total_steps must be a positive integer; got {total_steps!r}")
        self.total_steps = int(total_steps)
        self.peak = None if peak is None else _check_number("peak", peak)
        self.warmup_fraction = _check_number("warmup_fraction", warmup_fraction, allow_zero=True)
        if self.warmup_fraction >= 1:
            raise ValueError(f"warmup_fraction must be in [0, 1); got {warmup_fraction!r}")
        self.floor = _check_number("floor", floor, allow_zero=True)
        if self.peak is not None and self.floor > self.peak:
            raise ValueError(f"floor must be <= peak ({self.peak}); got {floor!r}")
        self.warmup_steps = int(round(self.warmup_fraction * self.total_steps))

    def with_peak(self, peak):
        """A copy with ``peak`` (what ``wrap`` does with a schedule whose peak is None)."""
        return WarmupCosine(self.total_steps, peak, self.warmup_fraction, self.floor)

    def __call__(self, step):
        if self.peak is None:
            raise ValueError(
                "WarmupCosine has no peak: give it to thor_tf.wrap / ThorOptimizer (which set the "
                "update rule's rate) or pass peak=... for another optimizer.")
        with tf.name_scope("WarmupCosine"):
            step = tf.cast(tf.convert_to_tensor(step), tf.float64)
            warm = float(max(self.warmup_steps, 1))
            ramp = self.peak * tf.minimum((step + 1.0) / warm, 1.0)
            span = float(max(self.total_steps - self.warmup_steps, 1))
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            cosine = self.floor + (self.peak - self.floor) * 0.5 * (
                1.0 + tf.cos(math.pi * progress))
            lr = tf.where(step < self.warmup_steps, ramp, cosine)
            return tf.cast(lr, tf.float32)

    def get_config(self):
        return {"total_steps": self.total_steps, "peak": self.peak,
                "warmup_fraction": self.warmup_fraction, "floor": self.floor}


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
