"""Sides kept as their diagonal (split 1: the eigenbasis rule leaves them unrotated) against a
float64 reference from first principles, under the default split plan.

A tanh MLP trained with MSE: per-example input rows and per-example output gradients
(``reference.dense_forward`` / ``dense_backward``) give every layer's gradient matrix and its
factors A and G (explicit mean outer products); every diagonal block is eigendecomposed after
the tie-breaking ramp (``test_eigenbasis.NumpyEigenbasis``), Adam runs in the eigenbasis with
its moments carried into new bases at each refresh, and the step is the Newton–Schulz factor of
Adam's at its Frobenius norm (the default rule). The default plan
``SplitPlan(128, diagonal_above=512)`` leaves the 601- and 521-wide A factors and the 520-wide G
factor unrotated (1×1 blocks: the rule keeps their diagonals only, no decomposition and no
rotation of the moments on that side); a first layer with both sides diagonal is Adam's
elementwise step before the orthogonalization. A small plan puts two layers of one shape (one
stack) with a diagonal A in the same run.
"""

import keras
import numpy as np
import pytest

import thor_tf
from thor_tf.rules import Eigenbasis
from thor_tf.split.plan import SplitPlan

from reference import dense_backward, dense_forward, homogeneous, mean_outer
from test_eigenbasis import EVERY_2, LR, NumpyEigenbasis
from test_newton_schulz import np_newton_schulz


def _mlp(widths, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(w, activation="tanh") for w in widths[1:-1]]
    return keras.Sequential([keras.Input((widths[0],)), *layers, keras.layers.Dense(widths[-1])])


def _folded(layer):
    """``[in + 1, out]`` float64: kernel with the bias as its last row."""
    return np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]]).astype(np.float64)


@pytest.mark.parametrize("step", ["adam", "orthogonal"])
@pytest.mark.parametrize("widths,split_dim,splits", [
    # default plan: layer 1 A 601 → 1, G 520 → 1 (both sides diagonal); layer 2 A 521 → 1,
    # G 5 → one rotated block.
    ((600, 520, 5), None, [(1, 1), (1, 128)]),
    # A 7 → 1 on every layer; layers 1 and 2 ([7, 6] each) are one stack; G split 2 (6 = 2+2+2,
    # 5 = 2+2+1 padded).
    ((6, 6, 6, 5), SplitPlan(2, ((7, 1),)), [(1, 2), (1, 2), (1, 2)]),
], ids=["default_plan", "stacked"])
def test_diagonal_sides_match_float64_first_principles(widths, split_dim, splits, step):
    """Weights of every layer after each of 5 steps (batch 16, refreshes at 0, 2, 4) within 2e-5
    of the float64 rule, with the default rule's ε_r = 1e-2 under either step.

    Tolerance: Adam's step ``g/(|g| + ε_r·rms)`` moves by at most ``δg/(ε_r·rms)`` for a
    gradient round-off ``δg``; float32 sums of 16 examples' products are within ~1e-6 of the
    largest term, so each step is within ~1e-4 of its size (LR times O(1)), 5 steps within
    ~5e-6; Newton–Schulz adds its float32 iteration's own error (tests/test_newton_schulz.py),
    ~1e-6 of the step. Measured: at most 1.1e-6 (Adam) and 3.7e-6 (orthogonal)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, widths[0])).astype("float32")
    y = (x[:, :widths[-1]] + 0.5 * rng.normal(size=(80, widths[-1]))).astype("float32")
    model = _mlp(widths)
    dense = [layer for layer in model.layers if layer.weights]
    weights = [_folded(layer) for layer in dense]
    rule = Eigenbasis(step=step, relative_epsilon=1e-2)
    options = {} if split_dim is None else {"split_dim": split_dim}
    wrapped = thor_tf.wrap(model, learning_rate=LR, update_rule=rule, verbose=False, **options,
                           **EVERY_2)
    wrapped.compile(loss="mse")
    if split_dim is None:  # the default plan, which leaves these sides unrotated
        assert wrapped.thor.config.split_dim == SplitPlan(128, diagonal_above=512)
    refs = [NumpyEigenbasis(w.shape[0], w.shape[1], rel_eps=rule.relative_epsilon)
            for w in weights]
    for t in range(5):
        rows = slice(16 * t, 16 * (t + 1))
        layers = [(w[:-1], w[-1], "tanh") for w in weights[:-1]] + [
            (weights[-1][:-1], weights[-1][-1], "linear")]
        inputs, zs, out = dense_forward(x[rows], layers)
        g_last = 2.0 * (out - y[rows]) / widths[-1]  # dℓ_n/dz, ℓ = mean over outputs of (z − y)²
        gs, _ = dense_backward(g_last, layers, zs)
        for k, (ref, h, g) in enumerate(zip(refs, inputs, gs)):
            a_rows = homogeneous(h, True)
            if t % 2 == 0:
                ref.refresh(mean_outer(a_rows), mean_outer(g), *splits[k])
            update = ref.step(a_rows.T @ g / len(h))  # the mean loss's gradient
            if step == "orthogonal":
                ortho = np_newton_schulz(update)
                update = ortho * np.linalg.norm(update) / np.linalg.norm(ortho)
            weights[k] = weights[k] - LR * update
        wrapped.train_on_batch(x[rows], y[rows])
        for k, layer in enumerate(dense):
            np.testing.assert_allclose(_folded(layer), weights[k], atol=2e-5, rtol=0,
                                       err_msg=f"layer {k}, step {t}")
    stats = wrapped.thor.layer_stats()
    assert [(s["split_a"], s["split_g"]) for s in stats] == [
        (min(a, w.shape[0]), min(g, w.shape[1])) for (a, g), w in zip(splits, weights)]
    assert [s["refreshes"] for s in stats] == [3] * len(dense)
