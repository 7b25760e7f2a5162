"""The layer-type registry: built-in entries, lookup through the MRO, bad input, and a layer type
registered by a user, checked by equivalence with Dense on inputs where it reduces to Dense."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from thor_tf import blocks


@keras.saving.register_keras_serializable(package="thor_tf_tests")
class NormalizedDense(keras.layers.Layer):
    """``z = (x / ||x||) @ kernel + bias``: a layer thor_tf does not know."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, x):
        return tf.math.l2_normalize(x, axis=-1) @ self.kernel + self.bias

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class NormalizedDenseBlock(thor_tf.KroneckerBlock):
    """The worked example of docs/internals.md: A's rows are the normalized inputs."""

    kind = "normalized_dense"

    def pre_activation(self, inputs):
        return tf.math.l2_normalize(inputs, axis=-1) @ self.layer.kernel + self.layer.bias

    def activate(self, z):
        return z

    def input_rows(self, inputs):
        x = tf.math.l2_normalize(tf.cast(inputs, tf.float32), axis=-1)
        return tf.reshape(x, [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        rows = self.input_rows(inputs)
        return tf.reduce_sum(tf.square(rows)), tf.cast(tf.shape(rows)[0], tf.float32)


def test_builtin_registry_and_lookup_through_the_mro():
    registry = blocks.registered_blocks()
    assert registry[keras.layers.Dense] is blocks.DenseBlock
    assert registry[keras.layers.Conv2D] is blocks.Conv2DBlock

    class MyDense(keras.layers.Dense):
        pass

    assert blocks.block_class_for(MyDense(3)) is blocks.DenseBlock
    assert blocks.block_class_for(keras.layers.LayerNormalization()) is None


@pytest.mark.parametrize("layer_class,block_class,argument", [
    ("Dense", blocks.DenseBlock, "layer_class"),
    (keras.layers.Dense, object, "block_class"),
    (keras.layers.Dense, int, "block_class"),
])
def test_register_block_rejects_bad_arguments(layer_class, block_class, argument):
    with pytest.raises(ValueError, match=f"`{argument}` must be"):
        thor_tf.register_block(layer_class, block_class)


def test_user_registered_layer_equals_dense_on_normalized_inputs(capsys):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.integers(0, 4, size=64)
    normalized = x / np.linalg.norm(x, axis=1, keepdims=True)

    def models(seed=0):
        keras.utils.set_random_seed(seed)
        custom = keras.Sequential([keras.Input((6,)), NormalizedDense(8, name="nd"),
                                   keras.layers.Activation("tanh"),
                                   keras.layers.Dense(4, activation="softmax", name="out")])
        plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="nd"),
                                  keras.layers.Activation("tanh"),
                                  keras.layers.Dense(4, activation="softmax", name="out")])
        plain.set_weights(custom.get_weights())
        return custom, plain

    custom, _ = models()
    # The warning names the step these layers get (AdamW under the default rule), not one rule's.
    with pytest.warns(UserWarning, match=r"no Kronecker block for nd .*AdamW under the default"):
        unregistered = thor_tf.wrap(custom, verbose=False)
    assert [b.name for b in unregistered.thor.blocks] == ["out"]
    unregistered.thor.detach()

    thor_tf.register_block(NormalizedDense, NormalizedDenseBlock)
    try:
        custom, plain = models()
        wrapped_custom = thor_tf.wrap(custom, frequency=2)
        assert "normalized_dense" in capsys.readouterr().out
        wrapped_plain = thor_tf.wrap(plain, frequency=2, verbose=False)
        for wrapped in (wrapped_custom, wrapped_plain):
            wrapped.compile(loss="sparse_categorical_crossentropy")
        wrapped_custom.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        wrapped_plain.fit(normalized, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(custom.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(wrapped_custom.thor.factors("nd")["A"],
                                   wrapped_plain.thor.factors("nd")["A"], rtol=1e-5, atol=1e-6)
        # The reference for A: mean of explicit outer products of the normalized rows (and the
        # bias coordinate 1) of the batch of the last refresh (4 batches per epoch, no shuffle).
        step = {s["name"]: s for s in wrapped_custom.thor.layer_stats()}["nd"]["last_refresh_step"]
        batch = normalized[16 * (step % 4):16 * (step % 4) + 16].astype(np.float64)
        rows = np.concatenate([batch, np.ones((16, 1))], 1)
        expected = sum(np.outer(r, r) for r in rows) / 16
        np.testing.assert_allclose(wrapped_custom.thor.factors("nd")["A"], expected, rtol=1e-4,
                                   atol=1e-6)
    finally:
        blocks._REGISTRY.pop(NormalizedDense, None)
