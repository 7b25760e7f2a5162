"""thor_tf.rules.inverse_ops on its own: the block-diagonal preconditioner and the KL clip against an
explicit float64 Kronecker product over the vec of every block's gradient matrix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from thor_tf.rules import inverse_ops as precondition
from thor_tf.blocks import DenseBlock
from thor_tf.capture import Record


def _spd(rng, n):
    x = rng.normal(size=(n, 2 * n))
    return x @ x.T / (2 * n) + 0.1 * np.eye(n)


def _blocks():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="a"),
                              keras.layers.Dense(3, use_bias=False, name="b")])
    return model, [DenseBlock("a", model.get_layer("a")), DenseBlock("b", model.get_layer("b"))]


@pytest.mark.parametrize("kappa", [None, 1e-3])
def test_preconditioned_gradients_equal_the_explicit_kronecker_product(kappa):
    rng = np.random.default_rng(4)
    model, blocks = _blocks()
    variables = model.trainable_variables  # a.kernel, a.bias, b.kernel
    grads = [rng.normal(size=v.shape).astype("float32") for v in variables]
    # Rows per example P: 1 for block a ([N, 5] inputs), 2 for block b ([N, 2, 4] inputs).
    records = {"a": [Record(tf.zeros([6, 5]), tf.zeros([6, 4]))],
               "b": [Record(tf.zeros([6, 2, 4]), tf.zeros([6, 2, 3]))]}
    dense_inverses = {"a": (_spd(rng, 6), _spd(rng, 4)), "b": (_spd(rng, 4), _spd(rng, 3))}
    inverses = {name: (tf.constant(a[None], tf.float32), tf.constant(g[None], tf.float32))
                for name, (a, g) in dense_inverses.items()}
    lr = 0.3
    rows_per_term = {name: blocks[k].positions(records[name]) for k, name in enumerate("ab")}
    out, nu = precondition.precondition_gradients(
        blocks, rows_per_term, inverses, [tf.constant(g) for g in grads], variables,
        kl_clip=kappa, learning_rate=lr)

    # Reference: vec (row-major) of each block's [a_dim, g_dim] matrix, explicit kron, 1/P.
    matrices = {"a": np.concatenate([grads[0], grads[1][None]], 0).astype(np.float64),
                "b": grads[2].astype(np.float64)}
    positions = {"a": 1.0, "b": 2.0}
    updates = {}
    for name, m in matrices.items():
        a_inv, g_inv = dense_inverses[name]
        vec = np.kron(a_inv, g_inv) @ m.reshape(-1) / positions[name]
        updates[name] = vec.reshape(m.shape)
    expected_nu = 1.0
    if kappa is not None:
        quad = lr ** 2 * sum(np.sum(updates[k] * matrices[k]) for k in updates)
        expected_nu = min(1.0, np.sqrt(kappa / quad))
        assert float(nu) == pytest.approx(expected_nu, rel=1e-4)
        assert expected_nu < 1.0  # the clip binds in this case
    else:
        assert nu is None
    np.testing.assert_allclose(out[0], expected_nu * updates["a"][:5], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[1], expected_nu * updates["a"][5], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[2], expected_nu * updates["b"], rtol=1e-4, atol=1e-6)


def test_variables_without_a_block_or_gradient_pass_through():
    model, blocks = _blocks()
    variables = model.trainable_variables
    grads = [None, None, tf.ones(variables[2].shape)]
    inverses = {"b": (tf.eye(4)[None], tf.eye(3)[None])}
    out, nu = precondition.precondition_gradients(blocks[1:], {"b": tf.constant(1.0)}, inverses,
                                                  grads, variables)
    assert out[0] is None and out[1] is None and nu is None
    np.testing.assert_allclose(out[2], np.ones((4, 3)))
    same, nu = precondition.precondition_gradients(blocks[:1], {}, {}, [None] * 3, variables)
    assert same == [None] * 3 and nu is None
