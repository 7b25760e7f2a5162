"""Small shared fixtures for the Keras-level tests: scikit-learn's digits and a tiny CNN."""

import keras
from sklearn.datasets import load_digits


def digits(n=None):
    """``(x [N, 8, 8, 1] float32 in [0, 1], y [N] int64)``, the first ``n`` examples if given."""
    d = load_digits()
    x = (d.images / 16.0).astype("float32")[..., None]
    y = d.target.astype("int64")
    return (x[:n], y[:n]) if n else (x, y)


def small_cnn(seed=0):
    """Conv2D(8) → Dense(32) → Dense(10) softmax, layers named conv / fc / out."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", name="fc"),
        keras.layers.Dense(10, activation="softmax", name="out"),
    ])
