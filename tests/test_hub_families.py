"""KerasHub families wrapped with thor_tf: tiny configs (random weights, offline,
``preprocessor=None``), and keras-io's miniature GPT.

Per family: ``wrap(task)`` + ``compile(loss=...)`` trains a couple of steps with THOR;
predictions are unchanged by ``wrap``; every Dense/EinsumDense/Embedding/Conv layer whose kernel
is trainable has a block; every block refreshes at least once in a few steps (``frequency=1``);
the layers that stay first order are exactly the ones named (normalizations, position
embeddings, ...). Skipped without keras-hub or on Keras < 3.15 (KerasHub 0.32's floor).
"""

import re

import keras
import numpy as np
import pytest

if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 15):
    pytest.skip("KerasHub 0.32 needs Keras >= 3.15", allow_module_level=True)
keras_hub = pytest.importorskip("keras_hub")

import thor_tf  # noqa: E402
from thor_tf import _keras_compat  # noqa: E402

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BLOCK_TYPES = tuple(getattr(keras.layers, n) for n in (
    "Dense", "EinsumDense", "Embedding", "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D",
    "SeparableConv2D", "Conv2DTranspose") if hasattr(keras.layers, n))


def _kernel(layer):
    for name in ("lora_kernel_a", "_kernel", "kernel", "embeddings", "depthwise_kernel"):
        v = getattr(layer, name, None)
        if isinstance(v, keras.Variable):
            return v
    return None


def _check_blocks(wrapped, model, allowed_first_order):
    """Every layer of a block type whose kernel is trained has a block; the first-order layers
    are the ones expected (by class name, with their reasons)."""
    block_layers = {id(b.layer) for b in wrapped.thor.blocks}
    trained = {id(v) for v in model.trainable_variables}
    missing = [layer.path for layer in _keras_compat.flatten_layers(model)
               if isinstance(layer, BLOCK_TYPES) and _kernel(layer) is not None
               and id(_kernel(layer)) in trained and id(layer) not in block_layers]
    assert not missing, missing
    first = {type(layer).__name__ for layer, _ in wrapped.thor.first_order}
    assert first <= set(allowed_first_order), first - set(allowed_first_order)
    return first


def _train_and_check(model, x, y, loss, allowed_first_order, steps=3):
    before = model.predict(x, verbose=0)
    wrapped = thor_tf.wrap(model, frequency=1, learning_rate=0.01, verbose=False)
    after = wrapped.predict(x, verbose=0)
    for a, b in zip(np.atleast_1d(before), np.atleast_1d(after)):
        np.testing.assert_array_equal(a, b)  # wrap changes nothing
    first = _check_blocks(wrapped, model, allowed_first_order)
    wrapped.compile(loss=loss)
    assert type(wrapped.optimizer).__name__ == "ThorOptimizer"
    losses = [float(wrapped.train_on_batch(x, y)) for _ in range(steps)]
    assert np.all(np.isfinite(losses))
    stats = wrapped.thor.layer_stats()
    never = [s["name"] for s in stats if s["refreshes"] < 1]
    assert not never, never
    return wrapped, first


# -- keras-io's miniature GPT (text_generation_gpt) ----------------------------------------------
def _mini_gpt(v=40, t=8, d=16, layers=2, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.layers.Input(shape=(t,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size=v, sequence_length=t,
                                                   embedding_dim=d, mask_zero=True)(inputs)
    for _ in range(layers):
        x = keras_hub.layers.TransformerDecoder(num_heads=2, intermediate_dim=d)(x)
    return keras.Model(inputs, keras.layers.Dense(v)(x))


def test_miniature_gpt_every_block_refreshes():
    """TokenAndPositionEmbedding calls its (tied, by default) ReversibleEmbedding inside its own
    ``call``, as a lookup only; the model's head is a Dense. The graph has no node for the
    embedding, so discovery used to add a tied-head block that no call ever reached: 15 blocks,
    one never refreshed. Now a symbolic forward pass shows no ``reverse=True`` call: 14 blocks."""
    model = _mini_gpt()
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 40, size=(16, 9)).astype("int32")
    wrapped, first = _train_and_check(model, tokens[:, :-1], tokens[:, 1:], SCCE,
                                      {"PositionEmbedding", "LayerNormalization"})
    kinds = [b.kind for b in wrapped.thor.blocks]
    assert len(kinds) == 14 and "tied head" not in kinds
    assert kinds.count("einsum_dense") == 8 and kinds.count("dense") == 5
    assert first == {"PositionEmbedding", "LayerNormalization"}
