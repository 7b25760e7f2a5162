"""How THOR's step depends on a constant factor c on the loss (a loss weight, class weights):
G is the empirical Fisher, so it grows as c², the gradient as c, the damping not at all; the
step is checked against that float64 formula, and a loss small enough for the damping to swamp
G gets a warning (docs/internals.md "Loss scale", scripts/bench_loss_scale.py at c598086)."""

import warnings

import keras
import numpy as np
import pytest

import thor_tf

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _problem():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 5)).astype("float32"), rng.integers(0, 3, 16)


def _one_step(c, damping=0.03):
    x, y = _problem()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    start = [w.astype(np.float64) for w in model.get_weights()]
    wrapped = thor_tf.wrap(model, learning_rate=1.0, momentum=0.0, damping=damping, kl_clip=None,
                           frequency=1, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", loss_weights=c)
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return start, model.get_weights()


def _reference_delta(c, w, b, damping=0.03):
    """The float64 step ``[Δ_W; Δ_b]`` of the weighted loss from first principles: p = softmax(xW
    + b); per-example dℓ/dz = c (p - onehot); the gradient of the mean loss M = āᵀ (c (p -
    onehot)) / N with ā = [x, 1]; A = āᵀā / N; G = Σ (c (p - onehot))(…)ᵀ / N;
    Δ = (A + √λ I)⁻¹ M (G + √λ I)⁻¹."""
    x, y = _problem()
    a = np.concatenate([x.astype(np.float64), np.ones((16, 1))], axis=1)
    logits = a @ np.concatenate([w, b[None]], axis=0)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = c * (p - np.eye(3)[y])
    m = a.T @ g / 16
    big_a, big_g = a.T @ a / 16, g.T @ g / 16
    d = np.sqrt(damping)
    return np.linalg.solve(big_a + d * np.eye(6), m) @ np.linalg.inv(big_g + d * np.eye(3))


@pytest.mark.parametrize("c", [1.0, 1e-3])
def test_step_under_a_loss_weight_matches_the_float64_formula(c):
    (w, b), (w_new, b_new) = _one_step(c)
    delta = _reference_delta(c, w, b)
    # The step is read off float32 weights (w_new rounded: eps·|w| ≈ 5e-8) and is itself a
    # chain of 16-row sums and two damped solves of condition ≤ ~6: ~1e-5 of its largest entry
    # (measured 6e-7 at c = 1; at c = 1e-3 the weights' rounding dominates: 2.7e-8).
    tol = 1e-5 * np.abs(delta).max() + 2 * np.finfo(np.float32).eps * np.abs(w).max()
    np.testing.assert_allclose(w - w_new, delta[:5], rtol=0, atol=tol)
    np.testing.assert_allclose(b - b_new, delta[5], rtol=0, atol=tol)


def test_the_step_is_not_invariant_to_the_loss_scale():
    (w, b), (w1, _) = _one_step(1.0)
    (_, _), (w3, _) = _one_step(1e-3)
    ratio = np.abs(w - w3).sum() / np.abs(w - w1).sum()
    # Adam's step would not change; SGD's would shrink by 1000. THOR's lies between: G shrinks
    # by 1e6 below the damping, the step becomes ~ c·∇ / √λ. The ratio the float64 formula
    # predicts for these weights and data, to float32 precision:
    predicted = (np.abs(_reference_delta(1e-3, w, b)[:5]).sum()
                 / np.abs(_reference_delta(1.0, w, b)[:5]).sum())
    assert 1e-3 < predicted < 1e-2, predicted  # neither Adam's 1 nor SGD's 1e-3
    np.testing.assert_allclose(ratio, predicted, rtol=1e-4)


def test_a_loss_too_small_for_the_damping_warns_once():
    x, y = _problem()
    for c, expected in ((1e-4, True), (1.0, False)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(3, activation="softmax")])
        wrapped = thor_tf.wrap(model, frequency=1, verbose=False)
        wrapped.compile(loss="sparse_categorical_crossentropy", loss_weights=c)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0)
        swamped = [w for w in caught if "damping √λ in every layer" in str(w.message)]
        assert len(swamped) == (1 if expected else 0), (c, [str(w.message) for w in caught])
