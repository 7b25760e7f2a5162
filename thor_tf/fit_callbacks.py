"""The callbacks ``ThorModel.fit`` adds before the user's: :class:`FitLength` (the default
schedule learns the run's length) and :class:`EpochTracker` (the epoch counter and a watch on
skipped steps and swamped curvature).
"""

from __future__ import annotations

import warnings

import keras

from thor_tf.schedules import EXPLICIT_SCHEDULE

#: G's mean eigenvalue below this fraction of the per-factor damping in every refreshed layer:
#: the damping swamps the curvature and THOR's step is SGD's divided by √λ (docs/internals.md).
SWAMPED_CURVATURE = 1e-3


def _divergence_advice(optimizer):
    """What to change after non-finite steps, for the update rule in use (the KL clip and the
    damped inverses are the inverse rule's only)."""
    rule = getattr(getattr(optimizer, "config", None), "rule", None)
    if rule is not None and getattr(rule, "kl_clip", None) is not None:
        return "Lower the learning rate, or raise `damping` / lower the inverse rule's `kl_clip`."
    return "Lower the learning rate."


class EpochTracker(keras.callbacks.Callback):
    """Internal callback of ``ThorModel.fit``: epoch counter and a watch on skipped steps.

    Keeps the engine's epoch counter (for epoch-based ``frequency`` schedules) in step, warns once
    per epoch when non-finite batches were skipped, stops training when every step of an epoch
    was skipped (a diverged run would otherwise go on silently, changing nothing) and logs NaN
    for it, and warns once when the damping swamps G (a loss too small in scale). A few host
    reads per epoch; the train step itself never leaves the device.
    """

    def __init__(self, engine):
        super().__init__()
        self._engine = engine
        self._skipped_before = 0
        self._steps_before = 0

    def _skipped(self):
        return self._engine.counters()["nonfinite_steps"] if self._engine._state is not None else 0

    def _iterations(self):
        # THOR's own iterations (a GAN's d_optimizer is not the model's optimizer).
        optimizer = self._engine.optimizer or self.model.optimizer
        return int(optimizer.iterations.numpy())

    def _warn_if_damping_swamps_curvature(self):
        """Warn when the loss's scale leaves G negligible against the damping. Looked at once per
        model, at the first epoch end with refreshed factors: a loss too small in scale is so
        from the start, while later a model that fits its data has a small empirical Fisher
        because its gradients are small (the digits CNN near 100 % train accuracy), not a
        problem of scale."""
        engine = self._engine
        if getattr(engine, "_scale_checked", False) or engine._state is None:
            return
        if not engine.config.rule.uses_damping:
            return  # the eigenbasis rule has no damping to swamp G: it does not see the scale
        ratios = engine.curvature_to_damping()
        if not ratios:
            return
        engine._scale_checked = True
        if max(ratios.values()) < SWAMPED_CURVATURE:
            warnings.warn(
                f"thor_tf: G's mean eigenvalue is at most {max(ratios.values()):.1e} of the "
                f"damping √λ in every layer: the loss is so small in scale (class or sample "
                f"weights, a loss weight, a sum divided by a large constant) that THOR's step is "
                f"SGD's divided by √λ. Scale the loss up (e.g. class weights that average 1) or "
                f"lower `damping`.", stacklevel=2)

    def on_epoch_begin(self, epoch, logs=None):
        self._engine.set_epoch(epoch)
        self._skipped_before = self._skipped()
        self._steps_before = self._iterations()

    def on_epoch_end(self, epoch, logs=None):
        self._warn_if_damping_swamps_curvature()
        # Skipped steps do not count in ``iterations``: the epoch ran ``taken + skipped`` batches.
        skipped = self._skipped() - self._skipped_before
        taken = self._iterations() - self._steps_before
        if skipped == 0:
            return
        total = taken + skipped
        loss_scaled = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)
        if taken == 0:
            # No step was taken: the epoch has no finite loss or metric. Log NaN (what Keras logs
            # for a NaN loss), not the empty averages' 0, so that ModelCheckpoint, EarlyStopping
            # and ReduceLROnPlateau (called after this callback) see the truth.
            for key in list(logs or {}):
                if not key.startswith("val_"):
                    logs[key] = float("nan")
            warnings.warn(
                f"thor_tf: every step of epoch {epoch + 1} had a non-finite loss or gradient and was "
                f"skipped; stopping training (the weights are those of the last finite step). "
                f"{_divergence_advice(self.model.optimizer)}", stacklevel=2)
            self.model.stop_training = True
        elif not loss_scaled:
            # Under dynamic loss scaling, overflow steps are how the scale is found (Keras skips
            # them silently too); the counter still has them.
            warnings.warn(
                f"thor_tf: {skipped} of {total} steps in epoch {epoch + 1} had a non-finite loss or "
                f"gradient and were skipped (nothing changed: weights, momentum, factors, "
                f"moving statistics, iterations, loss and metrics).", stacklevel=2)


class FitLength(keras.callbacks.Callback):
    """Internal callback of ``ThorModel.fit``: tells the default schedule the length of this fit.

    At the first epoch (whose number is ``initial_epoch``) it sets the run length and origin of
    ``schedule`` (a :class:`thor_tf.schedules.FitWarmupCosine`) from Keras' ``params``
    (``epochs``, ``steps``) and the optimizer's ``iterations``: two variable writes per ``fit``,
    read by the traced step as tensors. After the first epoch it warns once if the optimizer
    took more steps than the epoch had batches (a ``train_step`` applying it several times per
    batch), which the fit-derived length cannot know.
    """

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer
        self._schedule = optimizer._learning_rate
        self._first = None  # (epoch, iterations at its start) of this fit's first epoch

    def _iterations(self):
        return int(self._optimizer.iterations.numpy())

    def on_train_begin(self, logs=None):
        self._first = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is not None:
            return
        self._first = (epoch, self._iterations())
        self._schedule.set_run(self._first[1], self.params.get("epochs"), epoch,
                               self.params.get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        steps = self.params.get("steps")
        if self._first is None or epoch != self._first[0] or not steps:
            return
        taken = self._iterations() - self._first[1]
        if taken > steps:
            warnings.warn(
                f"thor_tf: the optimizer took {taken} steps in an epoch of {steps} batches (a "
                f"train_step that applies it more than once per batch), but the default learning "
                f"rate's warmup + cosine assumed one step per batch and ends early; pass "
                f"{EXPLICIT_SCHEDULE} with the true number of optimizer steps.", stacklevel=2)
