"""Structural checks of the cadence bookkeeping's and the EinsumDense block's few-op forms (issue
47): the same values as the general forms, with fewer ops traced and run.

* ``trace_rule.per_block_rows``: every block, in order, is the vector itself (no gather); any other
  selection gathers its rows.
* A wrapped model's traced step (every block active, the usual case): the trace rule's decisions
  are written without ``TensorScatterAdd`` (their scatters were the only ones) and its reads of
  the per-block vectors without gathers of the whole selection.
* A model where one block has no records in a step (its layer is not called) takes the scatter
  path: its counters stay as they were while the other block's move.
* ``EinsumDense`` blocks with identity permutations (MultiHeadAttention's projections) convert
  kernel and bias to the block's matrix and back without a ``Transpose``, to the same values.
"""


import numpy as np
import keras
import tensorflow as tf

import thor_tf
from thor_tf.trace_rule import per_block_rows


def _op_types(concrete):
    """Op types of a concrete function's graph and of every function in its library."""
    graph = concrete.graph.as_graph_def()
    types = [node.op for node in graph.node]
    for function in graph.library.function:
        types += [node.op for node in function.node_def]
    return types


def test_per_block_rows_whole_vector_and_gather():
    v = tf.Variable([[1.0], [2.0], [3.0]])

    @tf.function
    def whole():
        return per_block_rows(v, [0, 1, 2])

    @tf.function
    def some():
        return per_block_rows(v, [2, 0])

    np.testing.assert_array_equal(whole().numpy(), [[1.0], [2.0], [3.0]])
    np.testing.assert_array_equal(some().numpy(), [[3.0], [1.0]])
    assert "GatherV2" not in _op_types(whole.get_concrete_function())
    assert "GatherV2" in _op_types(some.get_concrete_function())


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    x = keras.layers.Dense(8, activation="tanh", name="d2")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def test_every_block_active_writes_decisions_without_scatter():
    model = thor_tf.wrap(_mlp(), learning_rate=1e-3, verbose=False)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)).astype("float32"), rng.integers(0, 3, 32)
    model.train_on_batch(x, y)
    concretes = [c for f in _functions(model.train_function)
                 for c in f._list_all_concrete_functions()]
    types = [t for c in concretes for t in _op_types(c)]
    assert "TensorScatterAdd" not in types
    refreshes = model.thor.state.refreshes.numpy()
    assert refreshes.tolist() == [1, 1, 1]  # step 0 refreshes every block


def _functions(fn):
    """The ``tf.function`` objects reachable from ``fn``'s closures (Keras' train function)."""
    from experiments.timing import functions_in

    return functions_in(fn)


class _Switch(keras.Model):
    """Two heads on one trunk; the second head is called only when ``use_b`` is set (a layer
    with a block and no records in the steps that do not call it)."""

    def __init__(self):
        super().__init__(name="switch")
        self.trunk = keras.layers.Dense(8, activation="tanh", name="trunk")
        self.head_a = keras.layers.Dense(3, name="head_a")
        self.head_b = keras.layers.Dense(3, name="head_b")
        self.use_b = False

    def call(self, x):
        h = self.trunk(x)
        return self.head_b(h) if self.use_b else self.head_a(h)


def test_block_without_records_keeps_its_counters():
    net = _Switch()
    net.use_b = True
    net(np.zeros((1, 6), "float32"))  # build both heads
    net.use_b = False
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)).astype("float32"), rng.integers(0, 3, 32)
    model = thor_tf.wrap(net, verbose=False)
    opt = thor_tf.ThorOptimizer(learning_rate=1e-3, frequency=1)
    model.compile(optimizer=opt)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = net.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x))
        grads = tape.gradient(loss, variables)
        opt.apply([tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)],
                  variables)

    for _ in range(3):
        step(x, y)
    state = model.thor.state
    names = [b.name for b in model.thor.blocks]
    refreshes = dict(zip(names, state.refreshes.numpy().tolist()))
    assert int(state.cadence_points.numpy()) == 3
    # head_a (the model's output in these steps) is first order here; trunk and head_b have
    # blocks, and only trunk has records: the bookkeeping takes its scatter path.
    assert "trunk" in names and "head_b" in names
    assert refreshes["head_b"] == 0  # no records in any step: its entries untouched
    assert refreshes["trunk"] >= 1
    assert sum(dict(zip(names, state.reuses.numpy().tolist())).values()) + refreshes["trunk"] == 3
    assert dict(zip(names, state.reuses.numpy().tolist()))["head_b"] == 0


def test_einsum_identity_permutations_have_no_transpose():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 8))
    out = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(inputs, inputs)
    model = thor_tf.wrap(keras.Model(inputs, out), verbose=False)
    blocks = [b for b in model.thor.candidates if b.kind == "einsum_dense"]
    assert len(blocks) == 4
    for block in blocks:
        kernel = tf.random.normal(block.kernel.shape, seed=1)
        bias = tf.random.normal(block.bias.shape, seed=2) if block.bias is not None else None

        @tf.function
        def roundtrip(kernel, bias):
            return block.from_matrix(block.to_matrix(kernel, bias))

        back_kernel, back_bias = roundtrip(kernel, bias)
        np.testing.assert_array_equal(back_kernel.numpy(), kernel.numpy())
        if bias is not None:
            np.testing.assert_array_equal(back_bias.numpy(), bias.numpy())
        types = _op_types(roundtrip.get_concrete_function(kernel, bias))
        assert "Transpose" not in types, block.name
