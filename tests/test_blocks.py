"""Kronecker factors, the single-example Fisher block and the preconditioned update against
float64 NumPy references built from explicit per-example activations and gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import softmax_dense_kfac_step, block_diagonal_part, conv_patches, homogeneous, mean_outer, softmax

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _wrap(model, **options):
    options.setdefault("verbose", False)
    return thor_tf.wrap(model, **options)


def _mlp(in_dim, hidden, classes, use_bias=True, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((in_dim,)),
        keras.layers.Dense(hidden, activation="relu", use_bias=use_bias, name="hidden"),
        keras.layers.Dense(classes, activation="softmax", use_bias=use_bias, name="out"),
    ])


def _mlp_reference(x, y, w1, b1, w2, b2, use_bias):
    """Per-example activations and output gradients of the 2-layer MLP with softmax CE."""
    z1 = x @ w1 + (b1 if use_bias else 0)
    a1 = np.maximum(z1, 0)
    z2 = a1 @ w2 + (b2 if use_bias else 0)
    g2 = softmax(z2) - np.eye(w2.shape[1])[y]       # dℓ_n/dz2, per example
    g1 = (g2 @ w2.T) * (z1 > 0)                     # dℓ_n/dz1, per example
    return a1, g1, g2


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_factors_match_reference(use_bias):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 7)).astype("float32")
    y = rng.integers(0, 4, size=16)
    model = _mlp(7, 5, 4, use_bias)
    w1, w2 = (model.get_layer(n).kernel.numpy().astype(np.float64) for n in ("hidden", "out"))
    b1, b2 = ((model.get_layer(n).bias.numpy().astype(np.float64) if use_bias else None)
              for n in ("hidden", "out"))
    a1, g1, g2 = _mlp_reference(x.astype(np.float64), y, w1, b1, w2, b2, use_bias)

    wrapped = _wrap(model, learning_rate=1e-3)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y)  # step 0 is a cadence point: factors from this batch

    expected = {
        "hidden": (mean_outer(homogeneous(x.astype(np.float64), use_bias)), mean_outer(g1)),
        "out": (mean_outer(homogeneous(a1, use_bias)), mean_outer(g2)),
    }
    for name, (ref_a, ref_g) in expected.items():
        got = wrapped.thor.factors(name)
        assert got["A"].shape == ref_a.shape and got["G"].shape == ref_g.shape
        np.testing.assert_allclose(got["A"], ref_a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["G"], ref_g, rtol=1e-4, atol=1e-6)


CONV_CASES = [
    # kernel, strides, padding, dilation, use_bias
    ((3, 3), (2, 2), "same", (1, 1), True),
    ((3, 3), (2, 2), "valid", (1, 1), False),
    ((3, 2), (1, 1), "same", (2, 2), True),
    ((2, 3), (1, 1), "valid", (2, 2), False),
    ((1, 1), (1, 1), "valid", (1, 1), True),
]


@pytest.mark.parametrize("kernel,strides,padding,dilation,use_bias", CONV_CASES)
def test_conv2d_factors_match_reference(kernel, strides, padding, dilation, use_bias):
    rng = np.random.default_rng(2)
    n, h, w, c, f = 3, 7, 6, 2, 3
    x = rng.normal(size=(n, h, w, c)).astype("float32")
    keras.utils.set_random_seed(3)
    conv = keras.layers.Conv2D(f, kernel, strides=strides, padding=padding, dilation_rate=dilation,
                               use_bias=use_bias, name="conv")
    model = keras.Sequential([keras.Input((h, w, c)), conv, keras.layers.Flatten()])
    k = int(np.prod(model.compute_output_shape((1,) + model.input_shape[1:])[1:]))
    y = rng.normal(size=(n, k)).astype("float32")

    kernel_value = conv.kernel.numpy().astype(np.float64)
    patches = conv_patches(x.astype(np.float64), kernel, strides, padding, dilation)
    ho, wo = patches.shape[1:3]
    rows = patches.reshape(-1, patches.shape[-1])
    z = rows @ kernel_value.reshape(-1, f)
    if use_bias:
        z = z + conv.bias.numpy()
    z = z.reshape(n, ho, wo, f)
    # Sanity: the explicit im2col reproduces Keras' own convolution.
    np.testing.assert_allclose(model.predict(x, verbose=0).reshape(z.shape), z, rtol=1e-4, atol=1e-5)
    # MSE over K outputs: dℓ_n/dz = 2 (z − y) / K for each example and position.
    g = 2.0 * (z.reshape(n, -1) - y) / k
    g_rows = g.reshape(n, ho, wo, f).reshape(-1, f)

    wrapped = _wrap(model, learning_rate=1e-3)
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(x, y)
    got = wrapped.thor.factors("conv")
    np.testing.assert_allclose(got["A"], mean_outer(homogeneous(rows, use_bias)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["G"], mean_outer(g_rows), rtol=1e-4, atol=1e-8)


def test_single_example_kron_equals_exact_fisher_block():
    """N = 1, empirical Fisher: kron(A, G) = vec(∇W) vec(∇W)ᵀ, ∇W = [∇kernel; ∇bias] ([in+1, out]),
    vec row-major (vec(M)[i·out + j] = M[i, j])."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 6)).astype("float32")
    y = np.array([2])
    model = _mlp(6, 5, 3)
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, model(x))
    layer = model.get_layer("hidden")
    dk, db = tape.gradient(loss, [layer.kernel, layer.bias])
    grad_matrix = np.concatenate([dk.numpy(), db.numpy()[None]], axis=0).astype(np.float64)
    exact = np.outer(grad_matrix.reshape(-1), grad_matrix.reshape(-1))

    wrapped = _wrap(model, learning_rate=1e-3)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y)
    got = wrapped.thor.factors("hidden")
    np.testing.assert_allclose(np.kron(got["A"], got["G"]), exact, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("split_dim", [64, 8])
def test_preconditioned_update_matches_reference(split_dim):
    """One step with lr 1, no momentum: w0 − w1 = (A + √λI)⁻¹ ∇W (G + √λI)⁻¹ (Keras orientation,
    the transpose of (G + √λI)⁻¹ ∇W (A + √λI)⁻¹), with inverses of the block-diagonal parts when
    split_dim cuts the factors (A: 21 → 8+8+5, G: 10 → 8+2)."""
    rng = np.random.default_rng(5)
    n, d, k, lam = 32, 20, 10, 0.1
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, k, size=n)
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(k, activation="softmax", name="out")])
    layer = model.get_layer("out")
    w0 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0).astype(np.float64)

    xa = homogeneous(x.astype(np.float64), True)
    g = softmax(xa @ w0) - np.eye(k)[y]
    grad = xa.T @ g / n                      # ∇ of the mean loss, [in+1, out]
    damp = np.sqrt(lam)
    a_damped = block_diagonal_part(mean_outer(xa) + damp * np.eye(d + 1), split_dim)
    g_damped = block_diagonal_part(mean_outer(g) + damp * np.eye(k), split_dim)
    expected = np.linalg.inv(a_damped) @ grad @ np.linalg.inv(g_damped)

    wrapped = _wrap(model, learning_rate=1.0, momentum=0.0, damping=lam, split_dim=split_dim,
                    kl_clip=None)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y)
    w1 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0)
    np.testing.assert_allclose(w0 - w1, expected, rtol=2e-3, atol=1e-5)
    # And the stored split inverses are the inverses of the diagonal blocks.
    inv = wrapped.thor.inverses("out")["A_inv"]
    size = min(split_dim, d + 1)
    np.testing.assert_allclose(inv[0], np.linalg.inv(a_damped[:size, :size]), rtol=2e-3, atol=1e-4)


def test_conv_update_scaled_by_positions():
    """Conv2D: damping λ/P per block (√(λ/P) per factor) and the update scaled by 1/P."""
    rng = np.random.default_rng(7)
    n, h, c, f, lam = 4, 5, 2, 3, 0.05
    x = rng.normal(size=(n, h, h, c)).astype("float32")
    keras.utils.set_random_seed(8)
    conv = keras.layers.Conv2D(f, 3, padding="valid", name="conv")
    model = keras.Sequential([keras.Input((h, h, c)), conv, keras.layers.Flatten()])
    k = int(np.prod(model.compute_output_shape((1,) + model.input_shape[1:])[1:]))
    y = rng.normal(size=(n, k)).astype("float32")
    kernel0 = conv.kernel.numpy().astype(np.float64)
    bias0 = conv.bias.numpy().astype(np.float64)

    patches = conv_patches(x.astype(np.float64), (3, 3), (1, 1), "valid", (1, 1))
    ho, wo = patches.shape[1:3]
    positions = ho * wo
    rows = homogeneous(patches.reshape(-1, patches.shape[-1]), True)
    w0 = np.concatenate([kernel0.reshape(-1, f), bias0[None]], 0)
    z = (rows @ w0).reshape(n, -1)
    g_rows = (2.0 * (z - y) / k).reshape(-1, f)            # dℓ_n/dz per example and position
    grad = rows.T @ g_rows / n                              # ∇ of the mean loss
    damp = np.sqrt(lam / positions)
    expected = (np.linalg.inv(mean_outer(rows) + damp * np.eye(rows.shape[1])) @ grad
                @ np.linalg.inv(mean_outer(g_rows) + damp * np.eye(f))) / positions

    wrapped = _wrap(model, learning_rate=1.0, momentum=0.0, damping=lam, kl_clip=None)
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(x, y)
    w1 = np.concatenate([conv.kernel.numpy().reshape(-1, f), conv.bias.numpy()[None]], 0)
    np.testing.assert_allclose(w0 - w1, expected, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("kappa", [1e-4, 10.0])
def test_kl_clip_scales_the_preconditioned_step(kappa):
    """ν = min(1, sqrt(κ / (lr²·⟨Δ, ∇⟩))) over all blocks, then w1 = w0 − lr·ν·Δ."""
    rng = np.random.default_rng(9)
    n, d, k, lam, lr = 32, 12, 5, 0.1, 0.3
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, k, size=n)
    keras.utils.set_random_seed(10)
    model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(k, activation="softmax", name="out")])
    layer = model.get_layer("out")
    w0 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0).astype(np.float64)
    delta, nu = softmax_dense_kfac_step(x, y, w0, lam, lr, kappa)
    wrapped = _wrap(model, learning_rate=lr, momentum=0.0, damping=lam, kl_clip=kappa)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y)
    w1 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0)
    np.testing.assert_allclose(w0 - w1, lr * nu * delta, rtol=2e-3, atol=1e-6)
    assert wrapped.thor.counters()["kl_scale"] == pytest.approx(nu, rel=1e-3)
    assert (nu < 1.0) == (kappa == 1e-4)


def test_factor_examples_uses_the_first_examples_of_the_batch():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(24, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=24)

    def build():
        keras.utils.set_random_seed(12)
        return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, name="conv"),
                                 keras.layers.Flatten(),
                                 keras.layers.Dense(3, activation="softmax", name="out")])

    sub = _wrap(build(), factor_examples=8, learning_rate=1e-3)
    sub.compile(loss="sparse_categorical_crossentropy")
    sub.train_on_batch(x, y)
    first = _wrap(build(), learning_rate=1e-3)
    first.compile(loss="sparse_categorical_crossentropy")
    first.train_on_batch(x[:8], y[:8])
    for name in ("conv", "out"):
        for key in ("A", "G"):
            np.testing.assert_allclose(sub.thor.factors(name)[key], first.thor.factors(name)[key],
                                       rtol=1e-5, atol=1e-7)
