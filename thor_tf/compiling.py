"""How a :class:`~thor_tf.model.ThorModel` is compiled and built (:class:`ThorCompile`, one of
its bases): THOR as the default optimizer, a model's own ``compile`` (KerasHub tasks, a GAN's),
the engine bound to the ``ThorOptimizer`` it trains with, and THOR's state built before the
first trace (under ``split_dim="auto"``: after the split's calibration at the start of ``fit``).
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf

from thor_tf import _keras_compat, fisher
from thor_tf.optimizer import ThorOptimizer


def find_thor_optimizer(optimizer):
    """The ``ThorOptimizer`` in ``optimizer`` (itself, or inside a ``LossScaleOptimizer``), or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, ThorOptimizer) else None


class ThorCompile:
    """``compile`` and the state's building, for :class:`~thor_tf.model.ThorModel` (a mixin: it
    uses the model's ``model``, ``thor`` and ``thor_optimizer``)."""

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

    # -- building the state ------------------------------------------------------------------------
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
