"""``optimizer="thor"`` and models with a ``compile`` of their own, without KerasHub.

Keras resolves an optimizer string with ``keras.optimizers.get``: Keras' own names, then the
custom objects registered globally. thor_tf registers ``"thor"`` there as an error naming
``thor_tf.wrap`` (THOR needs the hooks ``wrap`` installs); ``ThorModel.compile`` replaces the
string before Keras sees it. A model whose own ``compile`` has an ``optimizer`` argument (the
KerasHub task pattern, tests/test_keras_hub.py) gets a ``ThorOptimizer`` from ``wrap``'s options
while its own defaults still apply; one without (a GAN's) keeps its own arguments.
"""

import keras
import numpy as np
import pytest

import thor_tf


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3)])


class DefaultsModel(keras.Model):
    """Compile fills in defaults, like a KerasHub task: "auto" means Adam and a cross-entropy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)
        self.compiled_with = None

    def call(self, x):
        return self.out(self.hidden(x))

    def compile(self, optimizer="auto", loss="auto", *, metrics="auto", **kwargs):
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam(1e-3)
        if loss == "auto":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if metrics == "auto":
            metrics = [keras.metrics.SparseCategoricalAccuracy(name="acc")]
        self.compiled_with = optimizer
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)


class OptimizerPairModel(keras.Model):
    """A compile without an ``optimizer`` argument (a GAN's d_optimizer / g_optimizer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(x)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn


def _built(model):
    model(np.zeros((2, 6), "float32"))
    return model


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def test_thor_by_name_on_an_unwrapped_model_says_to_wrap_it():
    model = _dense()
    with pytest.raises(ValueError, match=r"thor_tf\.wrap"):
        model.compile(optimizer="thor", loss="mse")
    with pytest.raises(ValueError, match=r"thor_tf\.wrap"):
        keras.optimizers.get("thor")
    # Keras' own names are untouched.
    assert isinstance(keras.optimizers.get("adam"), keras.optimizers.Adam)
    assert isinstance(keras.optimizers.get("sgd"), keras.optimizers.SGD)


def test_thor_by_name_on_a_wrapped_model_is_thor():
    wrapped = thor_tf.wrap(_dense(), damping=0.2, verbose=False)
    wrapped.compile(optimizer="thor", loss="sparse_categorical_crossentropy")
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer)
    assert wrapped.thor_optimizer.damping == 0.2  # wrap's options


def test_own_compile_with_optimizer_argument_gets_thor_and_keeps_its_defaults():
    model = _built(DefaultsModel())
    wrapped = thor_tf.wrap(model, learning_rate=0.02, frequency=1, verbose=False)
    wrapped.compile()
    thor = wrapped.thor_optimizer
    assert isinstance(thor, thor_tf.ThorOptimizer)
    assert model.compiled_with is thor                       # the model's compile received it
    assert float(thor.learning_rate.numpy()) == pytest.approx(0.02)
    assert isinstance(wrapped.loss, keras.losses.SparseCategoricalCrossentropy)  # its default
    x, y = _data()
    history = wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "acc" in history.history and np.isfinite(history.history["loss"][0])
    stats = wrapped.thor.layer_stats()
    assert len(stats) == 2 and all(s["refreshes"] > 0 for s in stats)


def test_own_compile_given_thor_by_name_or_another_optimizer():
    model = _built(DefaultsModel())
    wrapped = thor_tf.wrap(model, verbose=False)
    wrapped.compile(optimizer="thor", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer)
    wrapped.compile(optimizer="adam")  # first order, as before
    assert wrapped.thor_optimizer is None and isinstance(wrapped.optimizer, keras.optimizers.Adam)
    assert wrapped.thor.other_optimizer == "Adam"
    x, y = _data()
    before = [v.numpy().copy() for v in model.trainable_variables]
    wrapped.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_compile_without_optimizer_argument_keeps_its_own_arguments():
    model = _built(OptimizerPairModel())
    wrapped = thor_tf.wrap(model, verbose=False)
    with pytest.raises(ValueError, match="no `optimizer` argument"):
        wrapped.compile(optimizer="thor")
    d_opt = thor_tf.ThorOptimizer()
    wrapped.compile(d_optimizer=d_opt, g_optimizer=keras.optimizers.Adam(),
                    loss_fn=keras.losses.MeanSquaredError())
    assert model.d_optimizer is d_opt and d_opt.engine is wrapped.thor
    assert wrapped._delegated == {"compile"}  # its own step would run


def test_save_and_load_a_wrapped_model_with_its_own_compile(tmp_path):
    keras.saving.get_custom_objects()["DefaultsModel"] = DefaultsModel
    try:
        model = _built(DefaultsModel())
        wrapped = thor_tf.wrap(model, frequency=1, verbose=False)
        wrapped.compile()
        x, y = _data()
        wrapped.fit(x, y, batch_size=32, epochs=1, verbose=0)
        path = str(tmp_path / "m.keras")
        wrapped.save(path)
        loaded = keras.models.load_model(path)
    finally:
        keras.saving.get_custom_objects().pop("DefaultsModel", None)
    assert isinstance(loaded.thor_optimizer, thor_tf.ThorOptimizer)
    assert int(loaded.optimizer.iterations.numpy()) == int(wrapped.optimizer.iterations.numpy()) == 2
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0))
