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

import keras
import numpy as np
import tensorflow as tf

from thor_tf import _keras_compat, fisher, graph_options, loss_terms
from thor_tf.compiling import (ThorCompile, _optimizers_in, _overridden_training_methods,
                               find_thor_optimizer)
from thor_tf.config import is_schedule, split_options
from thor_tf.engine import ThorEngine
from thor_tf.fit_callbacks import EpochTracker, FitLength
from thor_tf.schedules import FitWarmupCosine
from thor_tf.split.calibrate import auto_split
from thor_tf.task_data import TaskData, _unpack_validation


@keras.saving.register_keras_serializable(package="thor_tf")
class ThorModel(ThorCompile, TaskData, keras.Model):
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
        callbacks = ([FitLength(o) for o in scheduled] + [EpochTracker(self.thor)]
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
