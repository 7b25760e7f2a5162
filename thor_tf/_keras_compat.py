"""The few Keras internals thor_tf needs, in one place.

Everything else in thor_tf uses public Keras API. What is here has no public equivalent (checked
against Keras 3.15.1 / TensorFlow 2.21, and the floor tested by ``.ci/floor``); when Keras changes,
this is the one module to adapt.

* :func:`flatten_layers` - ``Layer._flatten_layers``: every sub-layer of a model, including the
  layers of subclassed models and nested models (``model.layers`` lists only the top level).
* :func:`loss_tracker` - ``Trainer._loss_tracker``: the ``Mean`` metric behind the ``loss`` entry
  of the progress bar and ``History`` (our train step updates it, as Keras' own does).
* :func:`compute_loss` - ``Trainer._compute_loss``: calls the public ``compute_loss`` with the
  ``training`` argument only where the (possibly user-overridden) signature accepts it.
* :func:`unscale_loss_for_distribution` - ``keras.src.losses.loss``: Keras divides the loss by
  the number of replicas under a ``tf.distribute`` strategy; the tracked loss undoes that.

* :func:`first_local_batch` - the TF trainer's epoch iterator (``(..., iterator)`` items) and
  ``Trainer._symbolic_build``: ``ThorModel._maybe_symbolic_build`` builds from one local
  replica's batch, where Keras all-reduces the first distributed batch only to learn its shapes
  (that eager collective fails under ``MultiWorkerMirroredStrategy``: keras-team/keras#20585).

* :func:`multi_worker_logs` - the TF trainer's ``reduce_per_replica``: across workers it
  reduces each log with ``strategy.reduce("MEAN", v, axis=0)``, which fails on the scalar logs
  every train step returns; logs of shape ``[1]`` reduce to their mean over replicas.

* :func:`unbuilt_compiled_metrics` - ``Trainer._compile_metrics``: Keras builds the metrics given
  to ``compile`` at the first ``fit``/``evaluate``; a custom loop under a strategy cannot create
  their variables inside the replica function, so the train step says so instead of failing with
  TF's "You must feed a value for placeholder tensor".

* :func:`in_xla_context` - TensorFlow's ``control_flow_util.GraphOrParentsInXlaContext``:
  whether the ops being built will be compiled by XLA (``jit_compile=True``), which needs static
  shapes (``inverse.invert_selected`` then inverts a fixed batch of blocks instead of gathering
  the refreshing ones).

* :func:`symbolic_forward` - ``keras.src.backend.compute_output_spec`` and
  ``Functional._inputs_struct``: one forward pass of a Functional model on placeholders (a
  scratch graph: no numbers computed, no variable changed), for discovery to see which calls the
  layers' own ``call`` code makes (a layer called inside another layer's ``call`` has no node in
  the model's graph).

* :func:`tape_could_record` - TensorFlow's ``record.could_possibly_record``: whether a
  ``GradientTape`` is active in this thread (the layer hooks record only then, so inference
  observes nothing). Present from TF 2.16 (the floor) to 2.21.

* :func:`variable_key`, :func:`variable_index`, :func:`uses_weight_decay` - the base
  ``Optimizer``'s ``_var_key``, ``_get_variable_index`` and ``_use_weight_decay``: the key Keras
  gives a variable (``ThorOptimizer.marked`` keys the variables a rule marked with it:
  ``update_step`` sees the backend variable), the position of its slots in the lists built by ``build``, and whether
  ``exclude_from_weight_decay`` spares it. The update rules' optimizer chain
  (:mod:`thor_tf.rules`) calls them.

Overridden rather than called: ``ThorOptimizer._all_reduce_sum_gradients`` (the TF backend
optimizer's hook that all-reduces the gradients given to ``apply``), turned into the identity for
THOR's gradients, which the engine all-reduces before preconditioning.
"""

from __future__ import annotations

import tensorflow as tf


def flatten_layers(layer, include_self=False, recursive=True):
    """All sub-layers of ``layer`` depth first (nested and subclassed models included)."""
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def loss_tracker(model):
    """The model's ``loss`` metric (a ``keras.metrics.Mean``), or None before compile."""
    return getattr(model, "_loss_tracker", None)


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras' own train step computes it (``training=True``)."""
    if hasattr(model, "_compute_loss"):
        return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=True)
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


def unscale_loss_for_distribution(loss):
    """``loss`` times the number of replicas in sync (Keras divides by it under a strategy)."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        loss = loss * tf.cast(replicas, loss.dtype)
    return loss


def first_local_batch(epoch_iterator, strategy):
    """The first batch of a Keras TF epoch iterator, as one local replica's values.

    Keras' items are ``(step, iterator)`` (3.8) or ``(begin, end, iterator)`` (later); the batch
    may hold ``DistributedValues`` (one value per local replica, all of one shape).
    """
    for item in epoch_iterator:
        batch = next(item[-1])
        return tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, batch)
    return None


def symbolic_forward(model, fn):
    """``fn(inputs)`` traced once on placeholders of the Functional ``model``'s inputs (a scratch
    graph: nothing is computed or assigned). Returns False when the model has no symbolic inputs
    (a subclassed model), else True."""
    inputs = getattr(model, "_inputs_struct", None)
    if inputs is None:
        return False
    from keras.src import backend as keras_backend

    keras_backend.compute_output_spec(fn, inputs)
    return True


def symbolic_build(model, data_batch):
    """``Trainer._symbolic_build``: build metrics, loss and optimizer from a batch's specs."""
    model._symbolic_build(data_batch=data_batch)


def in_multi_worker_mode(strategy):
    """Whether Keras reduces logs with collectives (``MultiWorkerMirroredStrategy`` across
    processes; Keras' own test, ``_collective_all_reduce_multi_worker``)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def multi_worker_logs(logs, strategy):
    """Scalar logs as ``[1]`` under multiple workers (see above), else ``logs`` unchanged.

    ``reduce("MEAN", v, axis=0)`` of ``[1]`` per replica is the mean over replicas, a scalar:
    what Keras' ``reduce_per_replica`` gives on one worker.
    """
    if not in_multi_worker_mode(strategy):
        return logs
    return tf.nest.map_structure(
        lambda v: tf.reshape(v, [1]) if isinstance(v, tf.Tensor) and v.shape.rank == 0 else v, logs)


def unbuilt_loss_trackers(model, inner=None):
    """Whether Keras' compiled loss is not built yet and will create variables when it is: a
    ``Mean`` tracker per loss when there are several (a nested ``loss``, or a model with several
    outputs, which gets the one loss per output). A model whose outputs are unknown (subclassed)
    counts as one that may. A single loss on a single output creates none."""
    loss = getattr(model, "_compile_loss", None)
    if loss is None or getattr(loss, "built", True):
        return False
    if tf.nest.is_nested(getattr(loss, "_user_loss", None)):
        return True
    outputs = getattr(inner if inner is not None else model, "outputs", None)
    return outputs is None or len(outputs) != 1


def unbuilt_compiled_metrics(model):
    """Whether ``compile`` was given metrics that Keras has not built yet."""
    metrics = getattr(model, "_compile_metrics", None)
    return metrics is not None and not getattr(metrics, "built", True)


def in_xla_context():
    """True when the graph being built is compiled by XLA (``jit_compile=True``): shapes must be
    static there. Unknown (the helper moved): True, the choice that works everywhere."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a future TensorFlow
        return True
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def tape_could_record():
    """True while a gradient tape in this thread could record operations (see above). Unknown
    (the helper moved): True, so that training is always observed."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - a future TensorFlow
        return True
    return bool(record.could_possibly_record())


def variable_key(optimizer, variable):
    """The key Keras' optimizer uses for ``variable`` (``Optimizer._var_key``): the same for a
    Keras variable and the backend variable ``update_step`` receives."""
    return optimizer._var_key(variable)


def variable_index(optimizer, variable):
    """Position of ``variable`` in the optimizer's variable list, hence of its slots
    (``Optimizer._get_variable_index``)."""
    return optimizer._get_variable_index(variable)


def uses_weight_decay(optimizer, variable):
    """Whether weight decay applies to ``variable`` (``Optimizer._use_weight_decay``: False for
    the names and variables given to ``exclude_from_weight_decay``)."""
    return optimizer._use_weight_decay(variable)
