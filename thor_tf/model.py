"""Keras integration: ``thor_tf.wrap(model)`` returns a ``ThorModel``.

``ThorModel`` is a ``keras.Model`` holding the user's model as its only layer. It computes exactly
what the user's model computes (``call`` delegates; the layer hooks of :mod:`thor_tf.capture`
observe and never replace), trains with THOR when compiled without an optimizer (or with a
``ThorOptimizer``), and with any other Keras optimizer trains like plain Keras.

Two ways a step runs:

* the user's model does not override ``train_step``, ``compile`` or ``compute_loss``, or its
  ``compile`` only fills in Keras' arguments (KerasHub tasks): ThorModel's own train step keeps
  what ``fit`` does (``compute_loss`` with sample weights, loss tracking, loss scaling, metrics;
  the model's own ``compile`` chose the loss and metrics) and replaces only the gradient/update
  part with THOR's (one forward pass the hooks observe, one backward pass for the parameter
  gradients and every ``dL/dz``, the curvature work as tensor decisions, the update), and undoes
  a non-finite batch everywhere (moving statistics, metrics). It is traced once for the whole run.
* it does: the user's own ``train_step`` / ``compile`` runs unchanged (ThorModel compiles the
  user's model too), and a ``ThorOptimizer`` it applies gradients with takes THOR's step from
  what the hooks observed (:meth:`thor_tf.engine.ThorEngine.apply_gradients`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import keras
import numpy as np
import tensorflow as tf
from thor_tf import _keras_compat, fisher, graph_options, loss_terms
from thor_tf.engine import ThorEngine
from thor_tf.config import is_schedule, split_options
from thor_tf.optimizer import ThorOptimizer
from thor_tf.schedules import EXPLICIT_SCHEDULE, FitWarmupCosine
from thor_tf.split.calibrate import auto_split

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

class _EpochTracker(keras.callbacks.Callback):
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


class _FitLength(keras.callbacks.Callback):
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


def find_thor_optimizer(optimizer):
    """The ``ThorOptimizer`` in ``optimizer`` (itself, or inside a ``LossScaleOptimizer``), or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, ThorOptimizer) else None


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorModel(keras.Model):
    """A Keras model trained with THOR. Build it with :func:`thor_tf.wrap`.

    Attributes:
      model: the wrapped user model (its Dense/Conv2D layers record themselves during training).
      thor: the :class:`~thor_tf.engine.ThorEngine` (``layer_stats()``, ``factors(name)``, ...).
    """

    def __init__(self, model, thor_options=None, exclude=None, verbose=True,
                 graph_optimization="auto", **kwargs):
        super().__init__(**kwargs)
        self._graph_optimization = graph_options.check_graph_optimization(graph_optimization)
        # Every option is validated here, once (ValueError naming the option and allowed values).
        config, self._learning_rate, self._keras_options = split_options(dict(thor_options or {}))
        self.model = model
        self._exclude = list(exclude or [])
        # A model with its own train_step / compile / compute_loss trains with its own code:
        # ThorModel hands fit's steps to it, and THOR preconditions what it applies.
        self._delegated = frozenset(_overridden_training_methods(model))
        if getattr(model, "output_names", None):
            self.output_names = list(model.output_names)  # losses/metrics by output name
        # The options live on the engine (``self.thor.options``): the split in force is read
        # from there or from the built optimizer, never copied.
        engine = ThorEngine(model, exclude=self._exclude, options=config)
        engine.verbose = bool(verbose)
        object.__setattr__(self, "thor", engine)
        self.built = True  # the wrapped model is built (ThorEngine checks it)
        if verbose:
            print(engine.registration_table())

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def make_train_function(self, force=False):
        # The train step's graph is optimized by the passes ``graph_optimization`` chose
        # (thor_tf/graph_options.py: on a CPU, grappler's remapper only).
        super().make_train_function(force=force)
        self.train_function = graph_options.apply(self.train_function, self._graph_optimization)
        return self.train_function

    def build(self, input_shape=None):
        # The wrapped model is built already; calling it once marks this wrapper built too.
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    @property
    def thor_optimizer(self):
        """The ``ThorOptimizer`` this model trains with (also inside a ``LossScaleOptimizer``,
        which Keras' ``compile`` wraps around it under the ``mixed_float16`` policy), or None."""
        return find_thor_optimizer(getattr(self, "optimizer", None))

    # -- compile -------------------------------------------------------------------------------------
    def compile(self, optimizer=None, loss=None, **kwargs):
        """``compile`` with THOR as the default optimizer (``optimizer=None`` or ``"thor"``).

        Blocks are chosen here for the layers that are trainable now: freeze or unfreeze layers,
        then compile again (as Keras requires); the registration table is printed again when the
        set of blocks changes.

        A model with a ``compile`` of its own is compiled through it. If that ``compile`` has an
        ``optimizer`` argument (KerasHub tasks, whose ``optimizer="auto"`` means Adam), None and
        ``"thor"`` become a ``ThorOptimizer`` built from ``wrap``'s options and the model's own
        defaults (loss, metrics, a CausalLM's sampler) still apply; when, besides, the model has
        no ``train_step``, ``test_step`` or ``compute_loss`` of its own, its ``compile`` only chose
        Keras' arguments, and this model is compiled with the arguments it chose and trains with
        ``fit``'s own THOR step. Any other optimizer trains first order. A ``compile`` without an
        ``optimizer`` argument (a GAN's ``d_optimizer``, ``g_optimizer``, ``loss_fn``) is given
        exactly the arguments passed, and a ``ThorOptimizer`` among them trains with the hooks of
        this model. A model with its own ``train_step`` is compiled too, with the same optimizer,
        so its code finds what it uses.
        """
        self._delegated = frozenset(_overridden_training_methods(self.model))
        if "compile" in self._delegated:
            takes_optimizer = _compile_takes_optimizer(self.model)
            if optimizer == "thor" and not takes_optimizer:
                raise ValueError(
                    f"{type(self.model).__name__}.compile() has no `optimizer` argument, so "
                    f"optimizer=\"thor\" has nowhere to go: pass thor_tf.ThorOptimizer() as the "
                    f"optimizer argument it has (e.g. a GAN's d_optimizer=...).")
            if takes_optimizer and (optimizer is None or optimizer == "thor"):
                optimizer = self._new_thor_optimizer()
            if optimizer is not None:
                kwargs["optimizer"] = optimizer
            if loss is not None:
                kwargs["loss"] = loss
            before = getattr(self.model, "_compile_config", None)
            self.model.compile(**kwargs)
            chosen = None
            if takes_optimizer and self._delegated == {"compile"}:
                chosen = _chosen_compile_arguments(self.model, before)
            if chosen is None:
                self._compile_delegated(kwargs)
                return
            # Its compile only filled in Keras' arguments: train on them with fit's own step.
            self._delegated = frozenset()
            if "auto_scale_loss" in kwargs:  # not in Keras' record of the call
                chosen["auto_scale_loss"] = kwargs["auto_scale_loss"]
            optimizer, loss, kwargs = chosen.pop("optimizer"), chosen.pop("loss", None), chosen
        if optimizer is None or optimizer == "thor":
            optimizer = self._new_thor_optimizer()
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        if self._delegated:
            self.model.compile(optimizer=self.optimizer, loss=loss, **kwargs)
        self.thor.loss = loss
        if self.thor_optimizer is None:
            self.thor.reset_state()
            self.thor.other_optimizer = type(self.optimizer).__name__
            return
        self._attach(self.optimizer)
        if self.thor_optimizer.fisher == "sampled":
            self._loss_spec = fisher.loss_spec(loss)
        # The state exists from here on: a custom loop (``strategy.run(model.train_step, ...)``
        # in a tf.function, the multi-worker recipe) cannot create variables in a replica.
        self._build_thor_state()

    def _new_thor_optimizer(self):
        """A ``ThorOptimizer`` with the options given to ``wrap``."""
        return ThorOptimizer(learning_rate=self._learning_rate, **self.thor.options.options(),
                             **self._keras_options)

    def _compile_delegated(self, kwargs):
        """After the model's own ``compile`` ran with ``kwargs``: this model trains with the
        model's own step, and a ``ThorOptimizer`` among its optimizers with this model's hooks."""
        found = [o for o in _optimizers_in(kwargs, self.model) if find_thor_optimizer(o)]
        if len({id(find_thor_optimizer(o)) for o in found}) > 1:
            raise ValueError(
                "one ThorOptimizer per wrapped model: for THOR on two sub-models (a GAN's "
                "generator and discriminator) wrap each sub-model with thor_tf.wrap and pass "
                "each its own optimizer (README 'Your own training code').")
        super().compile(optimizer=getattr(self.model, "optimizer", None))
        if not found:
            self.thor.reset_state()
            self.thor.other_optimizer = f"{type(self.model).__name__}'s own optimizers"
        for outer in found:
            # Its blocks (and table) come when it is built, for the variables it applies.
            self._attach(outer, select=False)

    def _attach(self, optimizer, select=True):
        """Bind the ``ThorOptimizer`` in ``optimizer`` (possibly in a ``LossScaleOptimizer``) to
        this model's hooks; ``select``: choose its blocks now, for all trainable variables."""
        thor = find_thor_optimizer(optimizer)
        if not thor.built:
            self.thor.reset_state()
            if select and self.thor.select_blocks(self.trainable_variables) and self.thor.verbose:
                print(self.thor.registration_table(thor.split_dim))
        self.thor.other_optimizer = None
        self.thor.loss_scaler = optimizer if optimizer is not thor else None
        thor.attach(self.thor)

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
        # Under split_dim="auto" the state's shapes wait for the calibration at fit's start.
        thor = self.thor_optimizer
        if thor is not None and not thor.split_pending and not self.optimizer.built:
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras (TF backend, under a strategy) averages the first distributed batch over the
        # replicas just to learn its shapes; under MultiWorkerMirroredStrategy that eager
        # collective fails ("Attempt to convert a value (PerReplica...) to a Tensor",
        # keras-team/keras#20585), which is what breaks ``fit`` there for every optimizer. One
        # local replica's batch has the same shapes.
        strategy = getattr(self, "_distribute_strategy", None)
        if strategy is None and self._unbuilt_step_state():
            # Without a strategy Keras defers building the compiled metrics and loss trackers to
            # the first trace of the train function. A tf.function whose first trace creates
            # variables is traced a second time (TF lifts the initializers, then traces a
            # variable-free version): THOR's whole train step twice, 1.5-2 s of Python on the
            # digits CNN (docs/overhead.md, "Tracing"). Build them here, from the first batch's
            # specs, as Keras does under a strategy: one trace.
            if iterator is not None:
                data_batch = _keras_compat.first_local_batch(iterator, tf.distribute.get_strategy())
            if data_batch is not None:
                _keras_compat.symbolic_build(self, data_batch)
            return None
        if strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        data_batch = _keras_compat.first_local_batch(iterator, strategy)
        with strategy.scope():
            _keras_compat.symbolic_build(self, data_batch)

    def _symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds an unbuilt optimizer here too (evaluate or predict before fit): under
        # split_dim="auto" its state waits for fit's calibration, so Keras is shown it built.
        thor = self.thor_optimizer
        waiting = self.optimizer if thor is not None and thor.split_pending else None
        if waiting is not None:
            waiting.built = True
        try:
            return super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        finally:
            if waiting is not None:
                waiting.built = False

    def _unbuilt_step_state(self):
        """Whether THOR's own train step would create variables in its first trace (compiled
        metrics or the loss's trackers not built yet). Only THOR's own step: a model training
        with its own code or another optimizer is left to Keras."""
        if self._delegated or self.thor_optimizer is None:
            return False
        # A single loss creates no variables: then the symbolic build (a forward pass traced in
        # a scratch graph, ~2k ops on ResNet-50) would cost without saving a trace.
        return (_keras_compat.unbuilt_compiled_metrics(self)
                or _keras_compat.unbuilt_loss_trackers(self, inner=self.model))

    def fit(self, x=None, y=None, batch_size=None, *args, callbacks=None, sample_weight=None,
            validation_data=None, **kwargs):
        self._build_thor_state()
        if self._preprocessing_task() is not None:
            # A KerasHub task preprocesses in its own fit: so does the wrapped one.
            if kwargs.get("validation_split"):
                raise ValueError("`validation_split` with a task's preprocessor: pass "
                                 "`validation_data` (raw, as for the training data).")
            x, y, sample_weight = self._preprocessed(x, y, sample_weight, batch_size), None, None
            batch_size = None
            if validation_data is not None:
                validation_data = self._preprocessed(
                    *_unpack_validation(validation_data), batch_size=kwargs.get(
                        "validation_batch_size"))
        thor = self.thor_optimizer
        if thor is not None and thor.split_pending:
            self.calibrate_split(_probe_batches(x, y, batch_size))
        # First, so that the logs it corrects (and the rate it sets) are what the user's
        # callbacks see.
        scheduled = self._fit_scheduled_optimizers()
        callbacks = ([_FitLength(o) for o in scheduled] + [_EpochTracker(self.thor)]
                     + list(callbacks or []))
        for optimizer in scheduled:
            optimizer._learning_rate.inside_fit = True
        try:
            return super().fit(x, y, batch_size, *args, callbacks=callbacks,
                               sample_weight=sample_weight, validation_data=validation_data,
                               **kwargs)
        finally:
            for optimizer in scheduled:
                optimizer._learning_rate.inside_fit = False

    def calibrate_split(self, batches, **options):
        """Calibrate the split for the rule in use on two ``(x, y)`` batches and build THOR's
        state with it (:func:`thor_tf.split.calibrate.auto_split`; ``options`` go there):
        what ``split_dim="auto"`` does at the start of ``fit``. For a custom loop, call it before
        the first step. Prints the plan and the registration table; returns the calibration's
        report. ``batches`` None (data ``fit`` cannot sample): the default split, said so."""
        thor = self.thor_optimizer
        if thor is None:
            raise ValueError("calibrate_split needs the model compiled with a ThorOptimizer.")
        if thor.built:
            raise ValueError(
                f"THOR's state is built with split_dim={thor.config.split_dim}: the split can be "
                f"calibrated only before the first step (wrap with split_dim='auto').")
        if batches is None:
            plan, report = thor.config.rule.default_split, None
            print(f"thor_tf: split_dim='auto' needs the training data as arrays or a "
                  f"tf.data.Dataset to calibrate on; using the rule's default split_dim={plan}.")
        else:
            options.setdefault("verbose", self.thor.verbose)
            plan, report = auto_split(self, batches, **options)
        thor.resolve_split(plan)
        # The model's options too: its saved config holds the plan the state was built with.
        self.thor.options = dataclasses.replace(self.thor.options, split_dim=plan)
        self._build_thor_state()
        if self.thor.verbose:
            print(self.thor.registration_table())
        return report

    def _fit_scheduled_optimizers(self):
        """The ThorOptimizers this model's ``fit`` steps (its own, or one its user's
        ``train_step`` applies: attached to this model's hooks) whose rate is the default
        :class:`~thor_tf.schedules.FitWarmupCosine`: ``fit`` sets their run's length."""
        found = []
        for candidate in [getattr(self, "optimizer", None)] + _optimizers_in({}, self.model):
            thor = find_thor_optimizer(candidate)
            if (thor is not None and thor.engine is self.thor
                    and isinstance(thor._learning_rate, FitWarmupCosine)
                    and all(thor is not f for f in found)):
                found.append(thor)
        return found

    def evaluate(self, x=None, y=None, batch_size=None, *args, sample_weight=None, **kwargs):
        if self._preprocessing_task() is not None:
            x, y, sample_weight = self._preprocessed(x, y, sample_weight, batch_size), None, None
            batch_size = None
        return super().evaluate(x, y, batch_size, *args, sample_weight=sample_weight, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        task = self._preprocessing_task()
        if task is not None:
            x, batch_size = self._preprocessed(x, None, None, batch_size, inputs_only=True), None
        return super().predict(x, batch_size, *args, **kwargs)

    def _preprocessing_task(self):
        """The wrapped model when it is a KerasHub task with a preprocessor (keras_hub's
        ``PipelineModel`` preprocesses in its fit/evaluate/predict), else None."""
        model = self.model
        if (getattr(model, "preprocessor", None) is not None
                and callable(getattr(model, "preprocess_samples", None))):
            return model
        return None

    def _preprocessed(self, x, y, sample_weight, batch_size, inputs_only=False):
        """Raw data as the task's own fit feeds it: batched (``batch_size``, 32 by default) and
        mapped through ``task.preprocess_samples`` (the preprocessor), as a ``tf.data`` pipeline;
        a ``tf.data.Dataset`` is mapped as it is. ``inputs_only``: predict's (x only)."""
        task = self._preprocessing_task()
        if isinstance(x, tf.data.Dataset):
            data = x
        else:
            data = tf.data.Dataset.from_tensor_slices(
                keras.utils.pack_x_y_sample_weight(x, y, sample_weight)).batch(batch_size or 32)
        if inputs_only:
            def preprocess(*sample):
                out = task.preprocess_samples(*sample)
                return keras.utils.unpack_x_y_sample_weight(out)[0] if isinstance(out, tuple) else out
        else:
            preprocess = task.preprocess_samples
        return data.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE)

    def _forward_state_variables(self):
        """Non-trainable variables the forward pass may change (moving statistics, RNG states).

        Weights of layers with ``trainable=False`` are left out: Keras does not update a frozen
        layer's state (BatchNormalization runs in inference mode), and copying a large frozen base
        at every step would cost as much as the step.
        """
        frozen = set()
        for layer in _keras_compat.flatten_layers(self.model, include_self=True):
            if not layer.trainable:
                frozen.update(id(v) for v in layer.weights)
        return [v for v in self.model.non_trainable_variables if id(v) not in frozen]

    def _track_unless_skipped(self, ok, loss, x, y, y_pred, sample_weight, batch_size):
        """Update the loss tracker and the compiled metrics, leaving a skipped batch out.

        A skipped batch stays out of the epoch's loss and metric averages (as under Keras'
        LossScaleOptimizer the step never happened): History and TerminateOnNaN see the steps
        THOR took. On one replica the updates sit in a ``tf.cond``; under a strategy (where a
        metric update may synchronize, which TF forbids inside a per-replica cond on older Keras)
        the batch enters with weight 0 and finite stand-ins for its values.
        """
        tracker = _keras_compat.loss_tracker(self)
        if tf.distribute.get_strategy().num_replicas_in_sync == 1:
            def track():
                if tracker is not None:
                    tracker.update_state(_keras_compat.unscale_loss_for_distribution(loss),
                                         sample_weight=batch_size)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
                return tf.constant(0)

            tf.cond(ok, track, lambda: tf.constant(0))
            return
        keep = tf.cast(ok, tf.float32)

        def finite(t):
            return tf.where(ok, t, tf.zeros_like(t)) if t is not None else None

        if tracker is not None:
            tracker.update_state(finite(_keras_compat.unscale_loss_for_distribution(loss)),
                                 sample_weight=tf.cast(batch_size, tf.float32) * keep)
        weights = keep * tf.ones([batch_size]) if sample_weight is None else tf.nest.map_structure(
            lambda w: tf.cast(finite(w), tf.float32) * keep, sample_weight)
        self.compute_metrics(x, tf.nest.map_structure(finite, y),
                             tf.nest.map_structure(finite, y_pred), sample_weight=weights)

    def train_step(self, data):
        if self._delegated:
            # The user's own training code, unchanged: the layer hooks observe its forward and
            # backward, and a ThorOptimizer it applies gradients with preconditions them.
            return self.model.train_step(data)
        thor = self.thor_optimizer
        if thor is None:
            return super().train_step(data)
        self._build_thor_state()  # custom loops calling train_step directly
        # MirroredStrategy cannot create variables inside its replica threads (TF fails with
        # "You must feed a value for placeholder tensor"); MultiWorkerMirroredStrategy can.
        if (_keras_compat.unbuilt_compiled_metrics(self)
                and isinstance(tf.distribute.get_strategy(), tf.distribute.MirroredStrategy)
                and not tf.distribute.in_cross_replica_context()):
            raise ValueError(
                "`metrics` given to compile() are built by Keras at the first fit()/evaluate(); a "
                "custom loop under MirroredStrategy cannot create them inside the replica "
                "function. Compile without `metrics` and track them yourself (as TF's custom-loop "
                "tutorial does), or call model.evaluate() on one batch before the loop.")
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        sampled = thor.fisher == "sampled"
        batch_size = tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0]
        loss_scaler = self.optimizer if self.optimizer is not thor else None
        # The forward pass updates moving statistics before the step can know whether the batch
        # is finite: keep their values to put back on a skipped step.
        forward_state = self._forward_state_variables()
        saved_state = [tf.identity(v) for v in forward_state]
        with tf.GradientTape(persistent=sampled) as tape:
            with self.thor.store.step():
                y_pred = self(x, training=True)
            loss_terms.clear()
            loss = _keras_compat.compute_loss(self, x, y, y_pred, sample_weight)
            # What one data point of the loss is (per-token terms of an LM, masks), as Keras
            # reduced it just now.
            terms = loss_terms.take()
            sampled_loss = fisher.sampled_loss(
                self._loss_spec, y_pred, mask=None if terms is None else terms.mask
            ) if sampled else None
            scaled_loss = self.optimizer.scale_loss(loss)
        loss_scale = _loss_scale(self.optimizer, thor)
        ok = self.thor.train_update(tape, scaled_loss, self.trainable_variables, batch_size,
                                    loss_scale=loss_scale, sampled_loss=sampled_loss, terms=terms)
        _restore_unless(ok, forward_state, saved_state)
        if loss_scaler is not None:
            _update_dynamic_loss_scale(loss_scaler, thor, ok)

        self._track_unless_skipped(ok, loss, x, y, y_pred, sample_weight, batch_size)
        return _keras_compat.multi_worker_logs(self.get_metrics_result(), self.distribute_strategy)

    def test_step(self, data):
        if "test_step" in self._delegated:
            return self.model.test_step(data)
        # Keras' own, with logs that Keras can reduce across workers (see _keras_compat). With
        # the model's own train_step the metrics are the model's (``metrics``): so is the step
        # that updates and reports them (this model's own would update its unreported trackers).
        step = self.model.test_step if self._delegated else super().test_step
        return _keras_compat.multi_worker_logs(step(data), self.distribute_strategy)

    @property
    def metrics(self):
        # Keras skips the metrics of nested models; a model whose own train_step reports its own
        # trackers needs them reset at each epoch like Keras resets them for it.
        if getattr(self, "_delegated", None):
            return self.model.metrics
        return super().metrics

    def _get_metrics_result_or_logs(self, logs):
        # Keras logs an epoch with ``metrics``' results instead of the last step's logs when their
        # names match. A model's own train_step may return values it does not track in them
        # (``return {"loss": loss}``): Keras would log the loss tracker that only its own step
        # updates (0.0), or fail on compiled metrics never built. Log what its step returned.
        if self._delegated:
            return logs
        return super()._get_metrics_result_or_logs(logs)

    # -- serialization ------------------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
            "thor_options": self._options_config(),
            "exclude": self._exclude,
            "graph_optimization": self._graph_optimization,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        options = _constructor_options(dict(config.pop("thor_options") or {}), custom_objects)
        return cls(model, thor_options=options, verbose=False, **config)

    def _options_config(self):
        """The options ``wrap`` was given, JSON-able (schedules serialized)."""
        learning_rate = self._learning_rate
        if is_schedule(learning_rate) and not isinstance(learning_rate, (int, float)):
            learning_rate = keras.saving.serialize_keras_object(learning_rate)
        return {"learning_rate": learning_rate, **self.thor.options.get_config(),
                **self._keras_options}


def _probe_batches(x, y, batch_size):
    """Two ``(x, y)`` batches of ``fit``'s data for the split calibration: the first two of a
    ``tf.data.Dataset`` (its own batches), or the first ``2·batch_size`` rows of arrays cut in
    two (``batch_size`` None: Keras' 32); None for other data (generators, PyDatasets)."""
    if isinstance(x, tf.data.Dataset):
        batches = []
        for element in x.take(2):
            element = tuple(element) if isinstance(element, (tuple, list)) else (element,)
            batches.append((element[0], element[1] if len(element) > 1 else None))
        return batches if len(batches) == 2 else (batches * 2 if batches else None)
    leaves = tf.nest.flatten(x)
    if not leaves or not all(isinstance(v, (np.ndarray, tf.Tensor)) for v in leaves):
        return None
    rows = int(leaves[0].shape[0])
    size = min(int(batch_size or 32), max(1, rows // 2))
    cut = lambda data, k: None if data is None else tf.nest.map_structure(
        lambda v: v[k * size:(k + 1) * size], data)
    return [(cut(x, 0), cut(y, 0)), (cut(x, 1), cut(y, 1))]


def _loss_scale(optimizer, thor):
    """What the train step's loss was multiplied by: ``loss_scale_factor`` of THOR, or the dynamic
    scale of the ``LossScaleOptimizer`` around it (which turns the inner factor off). None: 1."""
    if optimizer is not thor:
        return tf.cast(optimizer.dynamic_scale, tf.float32)
    if thor.loss_scale_factor is not None:
        return tf.constant(float(thor.loss_scale_factor), tf.float32)
    return None


def _unpack_validation(validation_data):
    """``(x, y, sample_weight)`` of fit's ``validation_data`` (a dataset: ``(ds, None, None)``)."""
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None, None
    return keras.utils.unpack_x_y_sample_weight(tuple(validation_data))


def _restore_unless(ok, variables, saved):
    """Put ``saved`` values back into ``variables`` where the step was skipped (``ok`` False)."""
    if not variables:
        return
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
        # Writes inside a per-replica tf.cond may not synchronize: masked writes instead.
        for v, value in zip(variables, saved):
            v.assign(tf.where(ok, tf.convert_to_tensor(v), value))
        return

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)
        return tf.constant(0)

    tf.cond(ok, lambda: tf.constant(0), restore)


def _update_dynamic_loss_scale(loss_scaler, thor, ok):
    """Keras' ``LossScaleOptimizer`` rule, applied for the step THOR took or skipped: a skipped
    (overflowing) step halves the scale, ``dynamic_growth_steps`` finite steps in a row double it.

    The scale variables are not replicated per replica (aggregation "none"), so under a strategy
    the update is made once in cross-replica context, as Keras does. Keras before 3.9 gives the
    wrapper an ``iterations`` of its own: it follows THOR's.
    """
    own_iterations = loss_scaler.iterations is not thor.iterations

    def update(strategy, ok):
        ok = strategy.experimental_local_results(ok)[0]
        counter, scale = loss_scaler.step_counter, loss_scaler.dynamic_scale
        grow = tf.logical_and(ok, tf.equal(counter, loss_scaler.dynamic_growth_steps - 1))
        factor = tf.where(grow, 2.0, tf.where(ok, 1.0, 0.5))
        counter.assign(tf.where(tf.logical_and(ok, tf.logical_not(grow)), counter + 1,
                                tf.zeros_like(counter)))
        scale.assign(scale * tf.cast(factor, scale.dtype))
        if own_iterations:
            loss_scaler.iterations.assign(thor.iterations)

    tf.distribute.get_replica_context().merge_call(update, args=(ok,))


def _constructor_options(config, custom_objects=None):
    """Saved ``thor_options`` -> ``wrap`` keywords (schedules deserialized). Also reads the older
    form, a whole ``ThorOptimizer.get_config()`` (its ``name`` is the optimizer's, not an option;
    ``trace_smoothing`` was replaced by ``trace_filter`` and is not carried)."""
    from thor_tf.config import saved_options

    options = dict(config)
    options.pop("name", None)
    return saved_options(options, custom_objects)


#: Training methods whose override in the user's model means: run the user's code.
_DELEGATED_METHODS = ("train_step", "test_step", "compile", "compute_loss")


def _overridden_training_methods(model):
    """The names in :data:`_DELEGATED_METHODS` that ``model``'s class overrides (Keras'
    Sequential and Functional override none)."""
    return {name for name in _DELEGATED_METHODS
            if getattr(type(model), name) is not getattr(keras.Model, name)}


def _compile_takes_optimizer(model):
    """Whether ``model``'s own ``compile`` has an ``optimizer`` parameter (KerasHub tasks do; a
    GAN's ``compile(d_optimizer, g_optimizer, loss_fn)`` does not)."""
    try:
        parameters = inspect.signature(type(model).compile).parameters
    except (TypeError, ValueError):
        return False
    return "optimizer" in parameters


def _chosen_compile_arguments(model, before):
    """The arguments ``model``'s own ``compile`` (just run) gave Keras' ``compile``, its defaults
    filled in (KerasHub: ``loss="auto"`` -> a ``SparseCategoricalCrossentropy``), with the
    optimizer it resolved; None if it did not call Keras' ``compile`` (``before``: the record of
    the previous call). Read from the record Keras keeps for ``get_compile_config``."""
    record = getattr(model, "_compile_config", None)
    optimizer = getattr(model, "optimizer", None)
    if record is None or record is before or not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    arguments = dict(getattr(record, "config", None) or {})
    if "loss" not in arguments:
        return None
    arguments["optimizer"] = optimizer
    return arguments


def _optimizers_in(kwargs, model):
    """Optimizers given to a user's ``compile`` (arguments, or attributes it set on ``model``)."""
    found = [v for v in kwargs.values() if isinstance(v, keras.optimizers.Optimizer)]
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
    return found


def wrap(model, **options):
    """Turn a built Keras model into one that trains with THOR.

    Args:
      model: a built ``keras.Model`` (Sequential, Functional or subclassed).
      **options: every ``ThorOptimizer`` argument, each with its default and meaning in
        ``docs/options.md`` (checked against these declarations by tests/test_options_doc.py):
        ``update_rule`` (``"eigenbasis"``, the default, ``"eigenbasis_adam"``, ``"inverse"`` or a
        :class:`thor_tf.rules.UpdateRule`), ``learning_rate`` (float or schedule; default
        warmup + cosine over the length ``fit`` knows, peaking at the rule's rate:
        :class:`thor_tf.schedules.FitWarmupCosine`), ``damping`` (float or schedule),
        ``weight_decay``, ``weight_decay_exclude``, ``clip_norm``, ``trace_rule`` (a
        :class:`thor_tf.TraceRule`), ``split_dim`` (int, a :class:`thor_tf.SplitPlan` or its
        dict, ``"auto"`` or a calibration JSON path), ``fisher`` (``"empirical"`` or
        ``"sampled"``), ``factor_decay``, ``factor_examples`` (None or k), ``loss_reduction``
        (``"auto"``, ``"mean"``, ``"sum"``); the trace rule's ``frequency`` (int,
        ``"adaptive"``, list of ``(epoch, interval)`` pairs or callable), ``preset``
        (``"thor"``, ``"thor_stop"``, ``"thor_nt"``), ``omega1``, ``omega2``,
        ``trace_filter`` (``"mean"`` or ``"none"``) and ``max_block_age`` (None or steps), and
        the inverse rule's ``momentum``, ``kl_clip`` (κ or None), ``inverse_assignment``
        (``"all"`` or ``"balanced"``) and ``damping_split`` (``"sqrt"`` or ``"pi"``), each
        handed to its rule; Keras optimizer arguments such as ``loss_scale_factor``; plus ``exclude`` (layer names kept first order), ``verbose``
        (print the registration table, default True) and ``graph_optimization`` (``"auto"``,
        the default: grappler's remapper only for the train step on a machine without GPU,
        TensorFlow's default passes with one; ``"light"``; ``"full"``; see
        :mod:`thor_tf.graph_options`).

    Returns:
      A :class:`ThorModel`; ``compile`` it without an optimizer to train with THOR. Under the
      ``mixed_float16`` policy Keras wraps THOR in a ``LossScaleOptimizer``; THOR finds itself
      inside it (``model.thor_optimizer``). Blocks are chosen at each ``compile`` for the layers
      trainable then.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model; got {type(model).__name__}.")
    if isinstance(model, ThorModel):
        raise ValueError("`model` is already wrapped (a ThorModel); wrap the original model once.")
    exclude = options.pop("exclude", None)
    verbose = options.pop("verbose", True)
    graph_optimization = options.pop("graph_optimization", "auto")
    if exclude is not None and (isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude)):
        raise ValueError(f"`exclude` must be a list of layer names; got {exclude!r}.")
    wrapped = ThorModel(model, thor_options=options, exclude=exclude, verbose=verbose,
                        graph_optimization=graph_optimization, name=f"thor_{model.name}")
    return wrapped
