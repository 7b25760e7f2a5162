"""thor_tf.profiling.profile_step: its structure and numbers, and that a layer's refresh is the
work of the update rule the model trains with, on the batch's factors (float64 NumPy reference)."""

import keras
import numpy as np
import pytest

import thor_tf
from thor_tf.profiling import profile_step
from thor_tf.rules.eigenbasis import EigenbasisSplitCost
from thor_tf.rules.inverse import InverseSplitCost

SPLIT = 4


def _wrapped(rule):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh", name="h"),
                              keras.layers.Dense(3, name="out")])
    wrapped = thor_tf.wrap(model, update_rule=rule, split_dim=SPLIT, verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return wrapped


def _np_block_diag(mat, d):
    out = np.zeros_like(mat)
    for s in range(0, mat.shape[0], d):
        out[s:s + d, s:s + d] = mat[s:s + d, s:s + d]
    return out


@pytest.mark.parametrize("rule, cls", [("eigenbasis", EigenbasisSplitCost),
                                       ("inverse", InverseSplitCost)])
def test_profile_times_the_rule_in_use_on_the_batch_factors(rule, cls, monkeypatch):
    wrapped = _wrapped(rule)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 6)).astype("float32")
    y = rng.integers(0, 3, 16)
    calls = []
    original = cls.side_work

    def spy(self, factor, previous, split, other_dim, side):
        calls.append((type(self), np.array(factor), split, other_dim, side))
        return original(self, factor, previous, split, other_dim, side)

    monkeypatch.setattr(cls, "side_work", spy)
    profile = profile_step(wrapped, x, y, repeats=1)

    assert profile["rule"] == rule
    assert set(profile) == {"rule", "forward_backward", "precondition", "layers", "refresh_total"}
    assert list(profile["layers"]) == ["h", "out"]
    seconds = [profile["forward_backward"], profile["precondition"]] + [
        t for layer in profile["layers"].values() for t in layer.values()]
    assert all(np.isfinite(t) and 0 < t < 60 for t in seconds)
    for layer in profile["layers"].values():
        assert set(layer) == {"traces", "factors", "refresh"}
    total = sum(v["factors"] + v["refresh"] for v in profile["layers"].values())
    assert profile["refresh_total"] == pytest.approx(total, rel=1e-12)

    # Two sides per layer, each at its split, with the rule the model trains with.
    assert [(c[0], c[2], c[3], c[4]) for c in calls] == [
        (cls, SPLIT, 5, "A"), (cls, SPLIT, 7, "G"), (cls, SPLIT, 3, "A"), (cls, SPLIT, 6, "G")]
    # The first layer's A side is the batch's A = mean [x, 1][x, 1]ᵀ (7×7 with the bias), its
    # diagonal 4×4 blocks only (the split), against float64.
    rows = np.hstack([x.astype(np.float64), np.ones((16, 1))])
    np.testing.assert_allclose(calls[0][1], _np_block_diag(rows.T @ rows / 16, SPLIT),
                               rtol=1e-5, atol=1e-6)
    # The output layer's G side: mean over examples of g gᵀ with g = softmax − onehot, the
    # per-example gradient of the cross-entropy at the logits (one 3×3 block), in float64.
    w1, b1, w2, b2 = (np.asarray(v, np.float64) for v in wrapped.get_weights())
    logits = np.tanh(rows[:, :6] @ w1 + b1) @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    g = p / p.sum(axis=1, keepdims=True) - np.eye(3)[y]
    np.testing.assert_allclose(calls[3][1], g.T @ g / 16, rtol=1e-4, atol=1e-6)
