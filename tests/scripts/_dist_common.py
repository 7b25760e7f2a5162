"""Shared by the distributed test scripts (run as subprocesses by tests/test_distribute.py).

Each script prints one line ``RESULT{json}``; logical CPU devices must be configured before
anything else touches TensorFlow, so ``setup(devices)`` comes first.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def setup(devices):
    """Split the CPU into ``devices`` logical devices (before any other TensorFlow use)."""
    import tensorflow as tf

    if devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    return tf


def digits(n=128):
    """The first ``n`` scikit-learn digits as ``[n, 8, 8, 1]`` float32 images and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images[:n] / 16.0).astype("float32")[..., None], d.target[:n].astype("int64")


def tokens(n=128, length=12, vocab=30, seed=0):
    """Integer sequences whose label is the most frequent token mod 10 (a learnable toy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, length))
    y = np.array([np.bincount(row, minlength=vocab).argmax() % 10 for row in x])
    return x.astype("int64"), y.astype("int64")


def conv_model(**options):
    """Conv2D → Dense(tanh) → Dense(softmax), wrapped with THOR (seeded)."""
    import keras
    import thor_tf

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((8, 8, 1)),
                          keras.layers.Conv2D(6, 3, activation="relu", name="conv"),
                          keras.layers.Flatten(),
                          keras.layers.Dense(16, activation="tanh", name="hidden"),
                          keras.layers.Dense(10, activation="softmax", name="out")])
    options = {"learning_rate": 0.1, "frequency": 2, "split_dim": 8, "verbose": False, **options}
    w = thor_tf.wrap(m, **options)
    w.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return w


def token_model(**options):
    """Embedding → Conv1D → pooling → Dense: sparse (IndexedSlices) gradients and new blocks."""
    import keras
    import thor_tf

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((12,), dtype="int64"),
                          keras.layers.Embedding(30, 8, name="embed"),
                          keras.layers.Conv1D(8, 3, activation="relu", name="conv1d"),
                          keras.layers.GlobalAveragePooling1D(),
                          keras.layers.Dense(10, activation="softmax", name="out")])
    # The published trace rule (no noise filter): this model then refreshes more than once.
    options = {"learning_rate": 0.1, "frequency": 2, "split_dim": 8, "verbose": False,
               "trace_filter": "none", **options}
    w = thor_tf.wrap(m, **options)
    w.compile(loss="sparse_categorical_crossentropy")
    return w


def lora_model(**options):
    """Tokens → frozen Embedding → Dense and an attention-like EinsumDense with LoRA (kernels
    frozen, adapters with random B) → pooling → a frozen Dense head: only LoRA blocks train."""
    import keras
    import numpy as np
    import thor_tf

    keras.utils.set_random_seed(0)
    ff = keras.layers.Dense(8, activation="relu", name="ff")
    heads = keras.layers.EinsumDense("abc,cde->abde", (12, 2, 4), bias_axes="e", name="heads")
    m = keras.Sequential([keras.Input((12,), dtype="int64"),
                          keras.layers.Embedding(30, 8, name="embed", trainable=False), ff, heads,
                          keras.layers.Reshape((12, 8)), keras.layers.GlobalAveragePooling1D(),
                          keras.layers.Dense(10, activation="softmax", name="out",
                                             trainable=False)])
    ff.enable_lora(2, lora_alpha=4)
    heads.enable_lora(3)
    rng = np.random.default_rng(1)
    for layer in (ff, heads):
        layer.lora_kernel_b.assign(0.3 * rng.normal(size=layer.lora_kernel_b.shape))
    options = {"learning_rate": 0.1, "frequency": 2, "split_dim": 8, "verbose": False,
               "trace_filter": "none", **options}
    w = thor_tf.wrap(m, **options)
    w.compile(loss="sparse_categorical_crossentropy")
    return w


def replica_values(variable):
    """The per-replica copies of a (Keras) variable as NumPy arrays (one entry off a strategy)."""
    value = getattr(variable, "value", variable)
    values = getattr(value, "values", None)
    return [v.numpy() for v in values] if values is not None else [value.numpy()]


def report(result):
    print("RESULT" + json.dumps(result), flush=True)
