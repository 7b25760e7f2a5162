"""Layers with the same factor graph (equal block signature and input shapes) share one traced
factor computation (``Refresher._group_local_factors``): each member's factors must still be its
own, against float64 references from explicit patches and per-example output gradients, and only
refreshing members are computed."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import conv_patches, homogeneous, mean_outer
from thor_tf import cadence_point, capture, refresh

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _two_branch_model(n_filters=3, h=6, w=5, c=2):
    """Two inputs, each through its own 3x3 Conv2D of the same shape: one factor group."""
    keras.utils.set_random_seed(4)
    x1, x2 = keras.Input((h, w, c)), keras.Input((h, w, c))
    conv_a = keras.layers.Conv2D(n_filters, 3, padding="same", name="conv_a")
    conv_b = keras.layers.Conv2D(n_filters, 3, padding="same", name="conv_b")
    out = keras.layers.Concatenate()([keras.layers.Flatten()(conv_a(x1)),
                                      keras.layers.Flatten()(conv_b(x2))])
    return keras.Model([x1, x2], out)


def _spy_groups(monkeypatch):
    sizes = []
    original = refresh.Refresher._group_local_factors

    def spy(self, members, flags):
        sizes.append(len(members))
        return original(self, members, flags)

    monkeypatch.setattr(refresh.Refresher, "_group_local_factors", spy)
    return sizes


def test_grouped_conv_factors_match_reference(monkeypatch):
    sizes = _spy_groups(monkeypatch)
    rng = np.random.default_rng(5)
    n, h, w, c, f = 4, 6, 5, 2, 3
    xs = [rng.normal(size=(n, h, w, c)).astype("float32") for _ in range(2)]
    model = _two_branch_model(f, h, w, c)
    k = 2 * h * w * f
    y = rng.normal(size=(n, k)).astype("float32")

    zs, rows = [], []
    for x, name in zip(xs, ("conv_a", "conv_b")):
        conv = model.get_layer(name)
        patches = conv_patches(x.astype(np.float64), (3, 3), (1, 1), "same", (1, 1))
        r = patches.reshape(-1, patches.shape[-1])
        rows.append(r)
        zs.append((r @ conv.kernel.numpy().astype(np.float64).reshape(-1, f)
                   + conv.bias.numpy()).reshape(n, h * w * f))
    # MSE over the K concatenated outputs: dℓ_n/dz = 2 (z − y) / K, split back per branch.
    g = 2.0 * (np.concatenate(zs, axis=1) - y) / k
    g_rows = [g[:, :h * w * f].reshape(-1, f), g[:, h * w * f:].reshape(-1, f)]

    wrapped = thor_tf.wrap(model, learning_rate=1e-3, verbose=False)
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(xs, y)  # step 0: both layers refresh
    assert sizes == [2], "the two convolutions should form one factor group"
    for name, r, gr in zip(("conv_a", "conv_b"), rows, g_rows):
        got = wrapped.thor.factors(name)
        np.testing.assert_allclose(got["A"], mean_outer(homogeneous(r, True)), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["G"], mean_outer(gr), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("flags", [(False, True), (True, False), (False, False)])
def test_group_computes_only_refreshing_members(flags):
    rng = np.random.default_rng(6)
    model = _two_branch_model()
    wrapped = thor_tf.wrap(model, learning_rate=1e-3, verbose=False)
    wrapped.compile(loss="mse")
    xs = [rng.normal(size=(4, 6, 5, 2)).astype("float32") for _ in range(2)]
    wrapped.train_on_batch(xs, rng.normal(size=(4, 180)).astype("float32"))  # builds the state
    eng = wrapped.thor
    members, expected = [], []
    for name, x in zip(("conv_a", "conv_b"), xs):
        i = eng._block_index[name]
        block = eng.blocks[i]
        record = capture.Record(tf.constant(x), None)
        grad = tf.constant(rng.normal(size=(4, 6, 5, 3)).astype("float32"))
        members.append(cadence_point.CadenceLayer(i, block, [record], [grad], tf.constant(30.0), None))
        split = eng.config.split_dim
        expected.append((block.factor_a([record], split).numpy(),
                          block.factor_g([grad], split).numpy()))
    got = eng.refresher._group_local_factors(members, tf.constant(flags))
    for flag, (fa, fg), (ea, eg) in zip(flags, got, expected):
        if flag:
            np.testing.assert_allclose(fa.numpy(), ea, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(fg.numpy(), eg, rtol=1e-6, atol=1e-9)
        else:
            assert not np.any(fa.numpy()) and not np.any(fg.numpy())


def test_different_shapes_are_not_grouped(monkeypatch):
    sizes = _spy_groups(monkeypatch)
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6, 6, 2)),
                              keras.layers.Conv2D(3, 3, padding="same", name="c1"),
                              keras.layers.Conv2D(3, 3, padding="same", name="c2"),  # Cin 3 here
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    wrapped = thor_tf.wrap(model, learning_rate=1e-3, verbose=False)
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(np.ones((2, 6, 6, 2), "float32"), np.ones((2, 2), "float32"))
    assert sizes == []
