"""thor_tf.capture on its own: the generic wrapper records (inputs, z) only while recording,
returns exactly the layer's own output, and unpatch restores the class method."""

import keras
import numpy as np

from thor_tf import capture
from thor_tf.blocks import Conv2DBlock, DenseBlock


def test_patched_dense_records_only_while_recording_and_keeps_its_output():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3, activation="tanh", name="fc")
    x = np.random.default_rng(1).normal(size=(4, 5)).astype("float32")
    expected = layer(x).numpy()  # builds the layer; the class call
    store = capture.CaptureStore()
    capture.patch(DenseBlock("fc", layer), store)
    np.testing.assert_array_equal(layer(x).numpy(), expected)  # not recording: nothing kept
    with store.record() as records:
        assert store.recording and records == {}
        out = layer(x, training=True).numpy()  # Keras passes `training`: accepted and ignored
    np.testing.assert_array_equal(out, expected)
    (record,) = records["fc"]
    z = x.astype(np.float64) @ layer.kernel.numpy() + layer.bias.numpy()
    np.testing.assert_allclose(record.z.numpy(), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(record.inputs), x)
    assert not store.recording
    capture.unpatch(layer)
    assert "call" not in layer.__dict__ and "_thor_patched" not in layer.__dict__


def test_patched_conv_records_the_pre_activation():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Conv2D(2, 3, padding="same", activation="relu", name="conv")
    x = np.random.default_rng(2).normal(size=(2, 5, 5, 1)).astype("float32")
    expected = layer(x).numpy()
    store = capture.CaptureStore()
    capture.patch(Conv2DBlock("conv", layer), store)
    with store.record() as records:
        out = layer(x).numpy()
    np.testing.assert_array_equal(out, expected)
    z = records["conv"][0].z.numpy()
    np.testing.assert_allclose(np.maximum(z, 0), expected, rtol=1e-6, atol=1e-7)
    assert (z < 0).any()  # the record is before the activation
