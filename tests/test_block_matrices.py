"""thor_tf.block_matrices: the gather of a gradient list into block matrices and the scatter of
block steps back, on a wrapped model's real blocks, against NumPy."""

import keras
import numpy as np
import tensorflow as tf

import thor_tf
from thor_tf import block_matrices


def _wrapped():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="fc1"),
                              keras.layers.Dense(2, use_bias=False, name="fc2"),
                              keras.layers.LayerNormalization(name="norm")])
    return thor_tf.wrap(model, verbose=False)


def test_gather_lays_kernel_and_bias_out_as_rows_and_skips_blocks_without_gradient():
    wrapped = _wrapped()
    variables = wrapped.trainable_variables
    blocks = {b.name: b for b in wrapped.thor.blocks}
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(v.shape).astype(np.float32) for v in variables]
    names = [v.path.split("/", 1)[1] for v in variables]  # without the model's name
    fc1_bias = names.index("fc1/bias")
    grads = [tf.constant(x) for x in values]
    grads[fc1_bias] = None  # a bias without gradient counts as zeros
    out = block_matrices.gather([blocks["fc1"], blocks["fc2"]], grads, variables)
    assert [(b.name, k) for b, k, _ in out] == [("fc1", names.index("fc1/kernel")),
                                                ("fc2", names.index("fc2/kernel"))]
    np.testing.assert_array_equal(
        out[0][2].numpy(), np.vstack([values[names.index("fc1/kernel")], np.zeros((1, 4))]))
    np.testing.assert_array_equal(out[1][2].numpy(), values[names.index("fc2/kernel")])
    # No kernel gradient: the block is not gathered at all.
    grads[names.index("fc2/kernel")] = None
    assert [b.name for b, _, _ in block_matrices.gather(list(blocks.values()), grads,
                                                        variables)] == ["fc1"]
    # use_grads: the block takes that kernel gradient instead of its variable's.
    part = np.full((3, 4), 0.5, np.float32)
    out = block_matrices.gather([blocks["fc1"]], [tf.constant(x) for x in values], variables,
                                {"fc1": tf.constant(part)})
    np.testing.assert_array_equal(out[0][2].numpy(),
                                  np.vstack([part, values[fc1_bias][None]]))


def test_scatter_replaces_block_gradients_sums_two_steps_on_one_variable_and_keeps_the_rest():
    wrapped = _wrapped()
    variables = wrapped.trainable_variables
    blocks = {b.name: b for b in wrapped.thor.blocks}
    names = [v.path.split("/", 1)[1] for v in variables]  # without the model's name
    rng = np.random.default_rng(1)
    grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in variables]
    step1 = rng.standard_normal((4, 4)).astype(np.float32)  # fc1: 3 kernel rows + the bias row
    step2 = rng.standard_normal((4, 2)).astype(np.float32)
    k1, k2 = names.index("fc1/kernel"), names.index("fc2/kernel")
    out, written = block_matrices.scatter(grads, variables, [
        (blocks["fc1"], k1, tf.constant(step1)), (blocks["fc2"], k2, tf.constant(step2)),
        (blocks["fc2"], k2, tf.constant(2 * step2))])  # two uses of fc2's kernel: summed
    assert written == {k1, names.index("fc1/bias"), k2}
    np.testing.assert_array_equal(out[k1].numpy(), step1[:3])
    np.testing.assert_array_equal(out[names.index("fc1/bias")].numpy(), step1[3])
    np.testing.assert_allclose(out[k2].numpy(), 3 * step2, rtol=1e-6)
    for name in ("norm/gamma", "norm/beta"):
        k = names.index(name)
        assert out[k] is grads[k]
