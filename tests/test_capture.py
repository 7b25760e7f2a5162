"""thor_tf.capture on its own: the hooks observe a, z and dL/dz (against float64 NumPy references
from first principles), only while a tape records, leave every output bit-identical, and come off
cleanly."""

import keras
import numpy as np
import tensorflow as tf

from thor_tf import capture
from thor_tf.blocks import Conv2DBlock, DenseBlock, EmbeddingBlock


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    layer = keras.layers.Dense(3, activation="tanh", name="fc")
    x = np.random.default_rng(1).normal(size=(4, 5)).astype("float32")
    layer(x)  # build
    return layer, x


def test_dense_hooks_observe_input_preactivation_and_its_gradient():
    layer, x = _dense()
    expected = layer(x).numpy()
    store = capture.CaptureStore()
    capture.install(DenseBlock("fc", layer), store)
    target = np.random.default_rng(2).normal(size=(4, 3)).astype("float32")
    with tf.GradientTape() as tape:
        out = layer(x, training=True)
        loss = tf.reduce_mean(tf.square(out - target))
    kernel_grad = tape.gradient(loss, layer.kernel)
    np.testing.assert_array_equal(out.numpy(), expected)  # observing changed nothing
    (record,) = store.take(["fc"])["fc"]
    # First principles, float64: z = xW + b, dL/dz = 2 (tanh z - t) (1 - tanh² z) / (N·K).
    x64, w, b = x.astype(np.float64), layer.kernel.numpy().astype(np.float64), layer.bias.numpy()
    z = x64 @ w + b
    dz = 2 * (np.tanh(z) - target) * (1 - np.tanh(z) ** 2) / z.size
    np.testing.assert_array_equal(np.asarray(record.inputs), x)
    np.testing.assert_allclose(record.z.numpy(), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(record.grad.numpy(), dz, rtol=1e-4, atol=1e-7)
    # The hooks leave the parameter gradient as it is: aᵀ·dz.
    np.testing.assert_allclose(kernel_grad.numpy(), x64.T @ dz, rtol=1e-4, atol=1e-7)
    assert store.take(["fc"]) == {}  # taken once
    capture.uninstall(layer)
    assert "call" not in layer.__dict__ and not capture.is_installed(layer)


def test_nothing_is_recorded_without_a_tape_and_inference_is_bit_identical():
    layer, x = _dense()
    expected = layer(x).numpy()
    traced = tf.function(lambda v: layer(v))(x).numpy()
    store = capture.CaptureStore()
    capture.install(DenseBlock("fc", layer), store)
    np.testing.assert_array_equal(layer(x).numpy(), expected)
    np.testing.assert_array_equal(tf.function(lambda v: layer(v))(x).numpy(), traced)
    assert store.take(["fc"]) == {}
    with store.step():  # ThorModel's own step records without asking for a tape
        layer(x)
    assert len(store.take(["fc"])["fc"]) == 1


def test_conv_hook_observes_the_preactivation_before_relu():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Conv2D(2, 3, padding="same", activation="relu", name="conv")
    x = np.random.default_rng(2).normal(size=(2, 5, 5, 1)).astype("float32")
    expected = layer(x).numpy()
    store = capture.CaptureStore()
    capture.install(Conv2DBlock("conv", layer), store)
    with tf.GradientTape():
        out = layer(x).numpy()
    np.testing.assert_array_equal(out, expected)
    z = store.take(["conv"])["conv"][0].z.numpy()
    np.testing.assert_allclose(np.maximum(z, 0), expected, rtol=1e-6, atol=1e-7)
    assert (z < 0).any()  # the record is before the activation


def test_embedding_hook_observes_its_output_and_a_tied_head_call_does_not_match():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Embedding(7, 3, name="emb")
    tokens = np.array([[1, 2, 3], [3, 0, 6]])
    layer(tokens)
    block = EmbeddingBlock("emb", layer)
    store = capture.CaptureStore()
    capture.install(block, store)
    with tf.GradientTape():
        vectors = layer(tokens)
        logits = tf.matmul(vectors, layer.embeddings, transpose_b=True)  # a tied head, elsewhere
    (record,) = store.take(["emb"])["emb"]
    np.testing.assert_array_equal(record.z.numpy(), layer.embeddings.numpy()[tokens])
    assert block.matches(record) and logits.shape == (2, 3, 7)
    vector_call = capture.Record(tf.zeros((2, 3, 3)), tf.zeros((2, 3, 7)))
    assert not block.matches(vector_call)


def test_stale_records_of_a_finished_forward_and_backward_are_dropped():
    layer, x = _dense()
    store = capture.CaptureStore()
    capture.install(DenseBlock("fc", layer), store)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x))
    tape.gradient(loss, layer.kernel)  # nobody takes these records (another optimizer's step)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x[:2]))
        loss += tf.reduce_sum(layer(x[2:]))  # two calls of one step are both kept
    tape.gradient(loss, layer.kernel)
    records = store.take(["fc"])["fc"]
    assert [int(r.inputs.shape[0]) for r in records] == [2, 2]
    assert all(r.grad is not None for r in records)
