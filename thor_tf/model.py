"""Keras integration: ``thor_tf.wrap(model)`` returns a ``ThorModel``.

``ThorModel`` is a ``keras.Model`` holding the user's model as its only layer. It computes exactly
what the user's model computes (``call`` delegates), trains with THOR when compiled without an
optimizer (or with a ``ThorOptimizer``), and with any other Keras optimizer trains like plain Keras.
Its train step keeps what ``fit`` does (``compute_loss`` with sample weights, loss tracking, loss
scaling, metrics) and replaces only the gradient/update part with THOR's: one forward pass that
records the registered layers, one backward pass for parameter gradients and every ``dL/dz``, the
curvature work as tensor decisions, and the update. It is traced once for the whole run.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from thor_tf import fisher
from thor_tf.engine import ThorEngine
from thor_tf.optimizer import ThorOptimizer

class _EpochTracker(keras.callbacks.Callback):
    """Internal callback of ``ThorModel.fit``: epoch counter and a watch on skipped steps.

    Keeps the engine's epoch counter (for epoch-based ``frequency`` schedules) in step, warns once
    per epoch when non-finite batches were skipped, and stops training when every step of an
    epoch was skipped (a diverged run would otherwise go on silently, changing nothing). One
    counter read per epoch; the train step itself never leaves the device.
    """

    def __init__(self, engine):
        super().__init__()
        self._engine = engine
        self._skipped_before = 0
        self._steps_before = 0

    def _skipped(self):
        return self._engine.counters()["nonfinite_steps"] if self._engine._state is not None else 0

    def on_epoch_begin(self, epoch, logs=None):
        self._engine.set_epoch(epoch)
        self._skipped_before = self._skipped()
        self._steps_before = int(self.model.optimizer.iterations.numpy())

    def on_epoch_end(self, epoch, logs=None):
        skipped = self._skipped() - self._skipped_before
        steps = int(self.model.optimizer.iterations.numpy()) - self._steps_before
        if skipped == 0:
            return
        if steps > 0 and skipped >= steps:
            warnings.warn(
                f"thor_tf: every step of epoch {epoch + 1} had a non-finite loss or gradient and was "
                f"skipped; stopping training (the weights are those of the last finite step). "
                f"Lower the learning rate or raise `damping` / lower `kl_clip`.", stacklevel=2)
            self.model.stop_training = True
        else:
            warnings.warn(
                f"thor_tf: {skipped} of {steps} steps in epoch {epoch + 1} had a non-finite loss or "
                f"gradient and were skipped (weights, momentum and factors unchanged).", stacklevel=2)


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorModel(keras.Model):
    """A Keras model trained with THOR. Build it with :func:`thor_tf.wrap`.

    Attributes:
      model: the wrapped user model (its Dense/Conv2D layers record themselves during training).
      thor: the :class:`~thor_tf.engine.ThorEngine` (``layer_stats()``, ``factors(name)``, ...).
    """

    def __init__(self, model, thor_options=None, exclude=None, verbose=True, **kwargs):
        super().__init__(**kwargs)
        thor_options = dict(thor_options or {})
        # Validate every option up front: a throwaway optimizer raises ValueError on bad input.
        self._default_optimizer = ThorOptimizer(**thor_options)
        self.model = model
        self._exclude = list(exclude or [])
        engine = ThorEngine(model, exclude=self._exclude)
        object.__setattr__(self, "thor", engine)
        if verbose:
            print(engine.registration_table(self._default_optimizer.split_dim))

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def build(self, input_shape=None):
        # The wrapped model is built already; calling it once marks this wrapper built too.
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    # -- compile -------------------------------------------------------------------------------------
    def compile(self, optimizer=None, loss=None, **kwargs):
        """``compile`` with THOR as the default optimizer (``optimizer=None`` or ``"thor"``)."""
        if optimizer is None or optimizer == "thor":
            optimizer = ThorOptimizer.from_config(self._default_optimizer.get_config())
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self.thor.loss = loss
        if isinstance(self.optimizer, ThorOptimizer):
            self.optimizer.attach(self.thor)
            if self.optimizer.fisher == "sampled":
                self._loss_spec = fisher.loss_spec(loss)

    def compile_from_config(self, config):
        # Keras skips compile on load for models with a custom ``compile``; ours only adds the
        # THOR default and the engine binding, so restoring from the config is safe.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self._build_thor_state()
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)

    # -- training ---------------------------------------------------------------------------------
    def _build_thor_state(self):
        # Create the optimizer's state eagerly: without a distribution strategy Keras would defer
        # it to the first trace, and the engine needs it before the optimizer's own ``apply``.
        if isinstance(self.optimizer, ThorOptimizer) and not self.optimizer.built:
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def fit(self, *args, callbacks=None, **kwargs):
        self._build_thor_state()
        callbacks = list(callbacks or [])
        callbacks.append(_EpochTracker(self.thor))
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def train_step(self, data):
        if not isinstance(self.optimizer, ThorOptimizer):
            return super().train_step(data)
        self._build_thor_state()  # custom loops calling train_step directly
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        sampled = self.optimizer.fisher == "sampled"
        batch_size = tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0]
        with tf.GradientTape(persistent=sampled) as tape:
            with self.thor.store.record() as records:
                y_pred = self(x, training=True)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            self._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss), sample_weight=batch_size)
            sampled_loss = fisher.sampled_loss(self._loss_spec, y_pred) if sampled else None
            loss = self.optimizer.scale_loss(loss)
        self.thor.train_update(tape, loss, self.trainable_variables, records, batch_size,
                               sampled_loss=sampled_loss)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # -- serialization ------------------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
            "thor_options": self._default_optimizer.get_config(),
            "exclude": self._exclude,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        # Round-trip through the optimizer so that serialized schedules come back as objects.
        options = ThorOptimizer.from_config(dict(config.pop("thor_options") or {})).get_config()
        return cls(model, thor_options=_constructor_options(options), verbose=False, **config)


def _constructor_options(config):
    """ThorOptimizer config -> constructor kwargs (schedules deserialized)."""
    options = dict(config)
    options.pop("name", None)
    for key in ("learning_rate", "damping"):
        if isinstance(options.get(key), dict):
            options[key] = keras.saving.deserialize_keras_object(options[key])
    if isinstance(options.get("frequency"), list):
        options["frequency"] = [tuple(p) for p in options["frequency"]]
    return options


def wrap(model, **options):
    """Turn a built Keras model into one that trains with THOR.

    Args:
      model: a built ``keras.Model`` (Sequential, Functional or subclassed).
      **options: ``ThorOptimizer`` arguments (``learning_rate``, ``momentum``, ``damping``,
        ``weight_decay``, ``weight_decay_exclude``, ``clip_norm``, ``frequency``, ``preset``,
        ``omega1``, ``omega2``, ``split_dim``, ``fisher``, ``factor_decay``, and Keras optimizer
        arguments such as ``loss_scale_factor``), plus ``exclude`` (layer names kept first order)
        and ``verbose`` (print the registration table, default True).

    Returns:
      A :class:`ThorModel`; ``compile`` it without an optimizer to train with THOR.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model; got {type(model).__name__}.")
    if isinstance(model, ThorModel):
        raise ValueError("`model` is already wrapped (a ThorModel); wrap the original model once.")
    exclude = options.pop("exclude", None)
    verbose = options.pop("verbose", True)
    if exclude is not None and (isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude)):
        raise ValueError(f"`exclude` must be a list of layer names; got {exclude!r}.")
    wrapped = ThorModel(model, thor_options=options, exclude=exclude, verbose=verbose,
                        name=f"thor_{model.name}")
    return wrapped
