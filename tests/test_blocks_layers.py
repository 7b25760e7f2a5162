"""Every registered block against float64 references built from explicit per-example quantities
(the block contract), the new blocks' equivalences with Dense / Conv2D, and a small Transformer.

References: explicit rows (patches, one-hot tokens, transposed einsum operands), explicit
forward passes checked against Keras' own predictions, the per-example MSE gradient
``dℓ_n/dz = 2 (z − y) / K``, and the update ``(1/P)(A + dI)⁻¹ ∇W (G + dI)⁻¹`` with ``d = √(λ/P)``.
Nothing here is computed by the code under test.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import (conv1d_patches, conv_patches, einsum_rows, homogeneous, mean_outer,
                       one_hot)
from thor_tf import blocks
from thor_tf.blocks.einsum_dense import analyze_equation
from thor_tf.capture import Record

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _wrap(model, **options):
    options.setdefault("verbose", False)
    return thor_tf.wrap(model, **options)


# -- the block contract, one case per registered layer type -----------------------------------------
# Each case: input x, a model [Input, layer "blk", Flatten], and explicit references:
#   forward(x, layer) -> z in the layer's output shape, float64
#   rows_a(x) -> [N·P, in] input rows (bias coordinate added by the test when `folded`)
#   rows_g(t) -> [N·P, out] rows of an output-shaped tensor
#   matrix(layer) -> [a_dim, out] the block's weights as a matrix (bias last row when folded)


def _weights(layer):
    return [w.numpy().astype(np.float64) for w in layer.weights]


def _case_dense(rng):
    n, t, c, f = 4, 3, 5, 4
    layer = keras.layers.Dense(f, name="blk")
    model = keras.Sequential([keras.Input((t, c)), layer, keras.layers.Flatten()])
    return dict(
        x=rng.normal(size=(n, t, c)).astype("float32"), model=model, positions=t, folded=True,
        forward=lambda x, l: x @ _weights(l)[0] + _weights(l)[1],
        rows_a=lambda x: x.reshape(-1, c),
        rows_g=lambda g: g.reshape(-1, f),
        matrix=lambda l: np.vstack([_weights(l)[0], _weights(l)[1][None]]))


def _case_conv2d(rng):
    n, h, w, c, f = 3, 5, 4, 2, 3
    spec = dict(kernel_size=(3, 2), strides=(2, 1), padding="same", dilation=(1, 1))
    layer = keras.layers.Conv2D(f, spec["kernel_size"], strides=spec["strides"], padding="same",
                                name="blk")
    model = keras.Sequential([keras.Input((h, w, c)), layer, keras.layers.Flatten()])

    def patches(x):
        return conv_patches(x, spec["kernel_size"], spec["strides"], spec["padding"], spec["dilation"])

    def forward(x, l):
        kernel, bias = _weights(l)
        return patches(x) @ kernel.reshape(-1, f) + bias

    return dict(
        x=rng.normal(size=(n, h, w, c)).astype("float32"), model=model, positions=3 * 4,
        folded=True, forward=forward,
        rows_a=lambda x: patches(x).reshape(-1, 3 * 2 * c),
        rows_g=lambda g: g.reshape(-1, f),
        matrix=lambda l: np.vstack([_weights(l)[0].reshape(-1, f), _weights(l)[1][None]]))


def _conv1d_case(rng, padding="causal", stride=1, dilation=2, use_bias=True, k=3):
    n, t, c, f = 3, 8, 2, 3
    layer = keras.layers.Conv1D(f, k, strides=stride, padding=padding, dilation_rate=dilation,
                                use_bias=use_bias, name="blk")
    model = keras.Sequential([keras.Input((t, c)), layer, keras.layers.Flatten()])

    def patches(x):
        return conv1d_patches(x, k, stride, padding, dilation)

    def forward(x, l):
        w = _weights(l)
        return patches(x) @ w[0].reshape(-1, f) + (w[1] if use_bias else 0.0)

    def matrix(l):
        w = _weights(l)
        return np.vstack([w[0].reshape(-1, f)] + ([w[1][None]] if use_bias else []))

    x = rng.normal(size=(n, t, c)).astype("float32")
    return dict(x=x, model=model, positions=patches(x).shape[1], folded=use_bias, forward=forward,
                rows_a=lambda x: patches(x).reshape(-1, k * c), rows_g=lambda g: g.reshape(-1, f),
                matrix=matrix)


def _einsum_case(rng, equation="abc,cde->abde", bias_axes="de", input_shape=(4, 5),
                 output_shape=(4, 2, 3)):
    n = 3
    layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes, name="blk")
    model = keras.Sequential([keras.Input(input_shape), layer, keras.layers.Flatten()])
    inp, rest = equation.split(",")
    ker, out = rest.split("->")
    positions = [a for a in inp if a in out]
    contracted = [a for a in ker if a in inp]
    out_axes = [a for a in ker if a in out]
    kernel_shape = tuple(layer.kernel.shape)
    folded = bias_axes is not None and sorted(bias_axes) == sorted(out_axes)

    def forward(x, l):
        w = _weights(l)
        z = np.einsum(equation, x, w[0])
        return z + w[1] if bias_axes else z

    def matrix(l):
        w = _weights(l)
        m = einsum_rows(w[0][None], "0" + ker, ["0"] + contracted, out_axes)
        if not folded:
            return m
        # The bias over its axes (size 1 elsewhere), as a row in the kernel's output-axis order.
        bias_spec = out[min(out.index(a) for a in bias_axes):]
        return np.vstack([m, einsum_rows(w[1][None], "0" + bias_spec,
                                         ["0"] + [a for a in bias_spec if a not in bias_axes],
                                         out_axes)])

    x = rng.normal(size=(n,) + tuple(input_shape)).astype("float32")
    sizes = dict(zip(inp, x.shape))
    p = int(np.prod([sizes[a] for a in positions[1:]]))
    assert einsum_rows(x, inp, positions, contracted).shape[0] == n * p and kernel_shape
    return dict(x=x, model=model, positions=p, folded=folded, forward=forward, matrix=matrix,
                rows_a=lambda x: einsum_rows(x, inp, positions, contracted),
                rows_g=lambda g: einsum_rows(g, out, positions, out_axes))


def _case_embedding(rng):
    n, t, v, d = 5, 6, 9, 4
    layer = keras.layers.Embedding(v, d, name="blk")
    model = keras.Sequential([keras.Input((t,), dtype="int32"), layer, keras.layers.Flatten()])
    return dict(
        x=rng.integers(0, v - 1, size=(n, t)).astype("int32"),  # token v-1 never occurs
        model=model, positions=t, folded=False,
        forward=lambda x, l: _weights(l)[0][x.astype(int)],
        rows_a=lambda x: one_hot(x.reshape(-1).astype(int), v),
        rows_g=lambda g: g.reshape(-1, d),
        matrix=lambda l: _weights(l)[0])


def _case_reversible_embedding(rng):
    """The lookup use alone (the tied head: tests/test_tied_embedding.py)."""
    case = _case_embedding(rng)
    n, t = case["x"].shape
    layer = keras.layers.ReversibleEmbedding(9, 4, name="blk")
    case["model"] = keras.Sequential([keras.Input((t,), dtype="int32"), layer,
                                      keras.layers.Flatten()])
    return case


CASES = {
    keras.layers.Dense: _case_dense,
    keras.layers.Conv2D: _case_conv2d,
    keras.layers.Conv1D: _conv1d_case,
    keras.layers.EinsumDense: _einsum_case,
    keras.layers.Embedding: _case_embedding,
}
if hasattr(keras.layers, "ReversibleEmbedding"):
    CASES[keras.layers.ReversibleEmbedding] = _case_reversible_embedding


def _check_case(case, lam=0.1, split_dim=64, eager=False):
    """One train_on_batch (step 0 refreshes): factors, cheap traces and the update.

    ``eager`` runs THOR's step eagerly (the same code, no tracing: faster for the many small
    cases); the contract test runs the traced step."""
    x, model = case["x"], case["model"]
    layer = model.get_layer("blk")
    x64 = x.astype(np.float64)
    z = case["forward"](x64, layer)
    # Sanity: the explicit forward pass is Keras' own.
    np.testing.assert_allclose(model(x).numpy(), z.reshape(len(x), -1), rtol=1e-4, atol=1e-5)
    n, k = len(x), int(np.prod(z.shape[1:]))
    y = np.random.default_rng(99).normal(size=(n, k)).astype("float32")
    g = (2.0 * (z.reshape(n, -1) - y) / k).reshape(z.shape)          # dℓ_n/dz, per example
    rows_a = homogeneous(case["rows_a"](x64), case["folded"])
    rows_g = case["rows_g"](g)
    w0 = case["matrix"](layer)
    # The rows reproduce the layer: z rows = ā rows @ [kernel; bias].
    np.testing.assert_allclose(rows_a @ w0, case["rows_g"](z), rtol=1e-6, atol=1e-8)
    p = case["positions"]
    assert rows_a.shape[0] == rows_g.shape[0] == n * p
    grad = rows_a.T @ rows_g / n                                      # ∇ of the mean loss
    ref_a, ref_g = mean_outer(rows_a), mean_outer(rows_g)
    damp = np.sqrt(lam / p)
    expected = (np.linalg.inv(ref_a + damp * np.eye(len(ref_a))) @ grad
                @ np.linalg.inv(ref_g + damp * np.eye(len(ref_g)))) / p

    wrapped = _wrap(model, learning_rate=1.0, momentum=0.0, damping=lam, kl_clip=None,
                    split_dim=split_dim)
    wrapped.compile(loss="mse", run_eagerly=eager)
    wrapped.train_on_batch(x, y)
    got = wrapped.thor.factors("blk")
    if got["A"].ndim == 1:  # diagonal by structure (Embedding): the diagonal is returned
        np.testing.assert_allclose(ref_a, np.diag(np.diag(ref_a)), atol=0)
        got["A"] = np.diag(got["A"])
    np.testing.assert_allclose(got["A"], ref_a, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["G"], ref_g, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(w0 - case["matrix"](layer), expected, rtol=2e-3, atol=1e-6)
    # The cheap traces are the traces of the factors.
    block = wrapped.thor.blocks[0]
    record = Record(tf.constant(x), tf.constant(z, tf.float32))
    assert float(block.trace_a([record])) == pytest.approx(np.trace(ref_a), rel=1e-5)
    assert float(block.trace_g([tf.constant(g, tf.float32)])) == pytest.approx(np.trace(ref_g),
                                                                               rel=1e-4)
    assert float(block.positions([record])) == p
    return wrapped


@pytest.mark.parametrize("layer_class", sorted(blocks.registered_blocks(), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_block_contract_factors_traces_and_update_match_reference(layer_class):
    assert layer_class in CASES, f"no contract case for the registered {layer_class.__name__}"
    keras.utils.set_random_seed(1)
    _check_case(CASES[layer_class](np.random.default_rng(2)))


def test_the_registry_has_the_new_blocks():
    registry = blocks.registered_blocks()
    assert registry[keras.layers.Conv1D] is blocks.Conv1DBlock
    assert registry[keras.layers.EinsumDense] is blocks.EinsumDenseBlock
    assert registry[keras.layers.Embedding] is blocks.EmbeddingBlock


# -- layer-specific references ------------------------------------------------------------------------

@pytest.mark.parametrize("padding,stride,dilation,use_bias", [
    ("same", 2, 1, True), ("valid", 1, 2, False), ("causal", 2, 1, False)])
def test_conv1d_paddings_strides_dilations(padding, stride, dilation, use_bias):
    keras.utils.set_random_seed(3)
    _check_case(_conv1d_case(np.random.default_rng(4), padding, stride, dilation, use_bias),
                eager=True)


@pytest.mark.parametrize("equation,bias_axes,input_shape,output_shape", [
    ("abcd,cde->abe", "e", (3, 2, 4), (3, 5)),          # MultiHeadAttention output projection
    ("abc,dce->aebd", "de", (3, 4), (2, 3, 5)),          # axes transposed in kernel and output
    ("abc,cde->abde", "e", (3, 4), (3, 2, 5)),           # bias over a subset: first order
])
def test_einsum_dense_equations(equation, bias_axes, input_shape, output_shape):
    keras.utils.set_random_seed(5)
    case = _einsum_case(np.random.default_rng(6), equation, bias_axes, input_shape, output_shape)
    layer = case["model"].get_layer("blk")
    kernel0, bias0 = _weights(layer)
    wrapped = _check_case(case, eager=True)
    block = wrapped.thor.blocks[0]
    if case["folded"]:
        assert block.bias is layer.bias
    else:
        # Not the block's bias: plain gradient step (lr 1, no momentum) on the bias variable.
        assert block.bias is None and block.a_dim == block.in_dim
        x64 = case["x"].astype(np.float64)
        z = np.einsum(equation, x64, kernel0) + bias0
        n, k = len(x64), int(np.prod(z.shape[1:]))
        y = np.random.default_rng(99).normal(size=(n, k))
        g = (2.0 * (z.reshape(n, -1) - y) / k).reshape(z.shape)
        np.testing.assert_allclose(bias0 - layer.bias.numpy(), g.sum(axis=(0, 1, 2)) / n,
                                   rtol=1e-4, atol=1e-6)


def test_einsum_dense_matrix_round_trip():
    keras.utils.set_random_seed(7)
    layer = keras.layers.EinsumDense("abc,dce->aebd", (2, 3, 5), bias_axes="de")
    layer.build((None, 3, 4))
    block = blocks.EinsumDenseBlock("e", layer)
    assert (block.in_dim, block.g_dim, block.a_dim) == (4, 10, 5)
    m = tf.random.normal([block.a_dim, block.g_dim])
    kernel, bias = block.from_matrix(m)
    assert tuple(kernel.shape) == tuple(layer.kernel.shape) and tuple(bias.shape) == (2, 1, 5)
    np.testing.assert_array_equal(block.to_matrix(kernel, bias).numpy(), m.numpy())


@pytest.mark.parametrize("equation,reason", [
    ("...b,bc->...c", "ellipsis"),
    ("abc,bcd->abd", "also an input and output axis"),
    ("abc,cd->ad", "summed away"),
    ("ab,ac->bc", "batch axis contracted"),
    ("abb,bc->ac", "repeated axis"),
])
def test_einsum_dense_equations_that_do_not_factor(equation, reason):
    plan, why = analyze_equation(equation)
    assert plan is None and reason in why


def test_einsum_dense_that_does_not_factor_stays_first_order_with_its_reason():
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((3, 4)),
                              keras.layers.EinsumDense("abc,bcd->abd", (3, 2), name="shared"),
                              keras.layers.Flatten(), keras.layers.Dense(2, name="out")])
    with pytest.warns(UserWarning, match="shared \\(EinsumDense: kernel axis 'b'"):
        wrapped = _wrap(model)
    assert [b.name for b in wrapped.thor.blocks] == ["out"]
    assert "shared (EinsumDense: kernel axis 'b' is also an input and output axis)" in \
        wrapped.thor.registration_table(128)


# -- equivalences: where a layer reduces to Dense or Conv2D, the update is the same -----------------

def _train_both(first, second, x_first, x_second, y, steps=3, **options):
    """Same options, same batches: THOR steps on both models (default momentum and KL clip; a
    refresh, a reuse step and a cadence point). Eager: the same code as the traced step, faster
    here."""
    for model in (first, second):
        wrapped = _wrap(model, learning_rate=0.1, frequency=2, **options)
        wrapped.compile(loss="sparse_categorical_crossentropy", run_eagerly=True)
        for step in range(steps):
            wrapped.train_on_batch(x_first if model is first else x_second, y)
    return first, second


def _classifier(inputs, body, k=3):
    x = keras.layers.Flatten()(body)
    return keras.Model(inputs, keras.layers.Dense(k, activation="softmax", name="out")(x))


def test_einsum_dense_ab_bc_ac_equals_dense():
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 3, 16)
    keras.utils.set_random_seed(10)
    i1 = keras.Input((6,))
    einsum = _classifier(i1, keras.layers.EinsumDense("ab,bc->ac", 4, bias_axes="c",
                                                      activation="tanh", name="blk")(i1))
    i2 = keras.Input((6,))
    dense = _classifier(i2, keras.layers.Dense(4, activation="tanh", name="blk")(i2))
    dense.set_weights(einsum.get_weights())
    _train_both(einsum, dense, x, x, y, split_dim=4)
    for a, b in zip(einsum.get_weights(), dense.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("equation,bias_axes,shape,output_shape,dense_in", [
    ("abc,cde->abde", "de", (3, 5), (3, 2, 4), (3, 5)),     # query/key/value projection
    ("abcd,cde->abe", "e", (3, 2, 4), (3, 5), (3, 8)),      # output projection
])
def test_attention_projections_equal_dense_on_the_reshaped_problem(equation, bias_axes, shape,
                                                                   output_shape, dense_in):
    rng = np.random.default_rng(11)
    x, y = rng.normal(size=(16,) + shape).astype("float32"), rng.integers(0, 3, 16)
    keras.utils.set_random_seed(12)
    i1 = keras.Input(shape)
    einsum = _classifier(i1, keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes,
                                                      name="blk")(i1))
    units = int(np.prod(einsum.get_layer("blk").kernel.shape[-2 if bias_axes == "de" else -1:]))
    i2 = keras.Input(dense_in)
    dense = _classifier(i2, keras.layers.Dense(units, name="blk")(i2))
    dense.set_weights([w.reshape(d.shape) for w, d in zip(einsum.get_weights(), dense.get_weights())])
    _train_both(einsum, dense, x, x.reshape((16,) + dense_in), y, split_dim=6)
    for a, b in zip(einsum.get_weights(), dense.get_weights()):
        np.testing.assert_allclose(a.reshape(b.shape), b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("padding,stride,dilation", [("same", 2, 1), ("valid", 1, 2),
                                                     ("causal", 1, 2)])
def test_conv1d_equals_conv2d_with_height_one(padding, stride, dilation):
    t, c, f, k = 9, 2, 3, 3
    rng = np.random.default_rng(13)
    x, y = rng.normal(size=(8, t, c)).astype("float32"), rng.integers(0, 3, 8)
    keras.utils.set_random_seed(14)
    i1 = keras.Input((t, c))
    conv1d = _classifier(i1, keras.layers.Conv1D(f, k, strides=stride, padding=padding,
                                                 dilation_rate=dilation, activation="relu",
                                                 name="blk")(i1))
    i2 = keras.Input((1, t, c))
    h = i2
    if padding == "causal":  # Conv1D's causal padding, then valid
        h = keras.layers.ZeroPadding2D(((0, 0), (dilation * (k - 1), 0)))(h)
    conv2d = _classifier(i2, keras.layers.Conv2D(
        f, (1, k), strides=(1, stride), padding="valid" if padding == "causal" else padding,
        dilation_rate=(1, dilation), activation="relu", name="blk")(h))
    conv2d.set_weights([w.reshape(d.shape) for w, d in zip(conv1d.get_weights(), conv2d.get_weights())])
    _train_both(conv1d, conv2d, x, x[:, None], y, split_dim=4)
    for a, b in zip(conv1d.get_weights(), conv2d.get_weights()):
        np.testing.assert_allclose(a.reshape(b.shape), b, rtol=1e-4, atol=1e-6)


def test_embedding_equals_bias_free_dense_on_one_hot_tokens():
    t, v, d = 5, 9, 4
    rng = np.random.default_rng(15)
    tokens, y = rng.integers(0, v - 2, size=(16, t)), rng.integers(0, 3, 16)  # two tokens unseen
    keras.utils.set_random_seed(16)
    i1 = keras.Input((t,), dtype="int32")
    embedding = _classifier(i1, keras.layers.Embedding(v, d, name="blk")(i1))
    i2 = keras.Input((t, v))
    dense = _classifier(i2, keras.layers.Dense(d, use_bias=False, name="blk")(i2))
    dense.set_weights(embedding.get_weights())
    e0 = embedding.get_layer("blk").embeddings.numpy()
    _train_both(embedding, dense, tokens.astype("int32"), one_hot(tokens, v).astype("float32"), y,
                split_dim=16)   # >= V: the Dense A is one exact (diagonal) block
    for a, b in zip(embedding.get_weights(), dense.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Unseen tokens keep their rows; A is stored as V 1x1 blocks.
    np.testing.assert_array_equal(embedding.get_layer("blk").embeddings.numpy()[v - 2:], e0[v - 2:])


def test_embedding_factor_is_stored_as_one_by_one_blocks():
    v, t = 50, 4
    keras.utils.set_random_seed(17)
    model = keras.Sequential([keras.Input((t,), dtype="int32"),
                              keras.layers.Embedding(v, 6, mask_zero=True, name="emb"),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(3, activation="softmax", name="out")])
    wrapped = _wrap(model, split_dim=4)
    assert re.search(r"emb +embedding +50 +6 +1x50 +4x2", wrapped.thor.registration_table(4))
    wrapped.compile(loss="sparse_categorical_crossentropy", run_eagerly=True)
    tokens = np.random.default_rng(18).integers(0, v, size=(8, t)).astype("int32")
    wrapped.train_on_batch(tokens, np.arange(8) % 3)
    state = wrapped.thor.inverses("emb")
    assert state["A_inv"].shape == (v, 1, 1) and state["G_inv"].shape == (2, 4, 4)
    counts = np.bincount(tokens.reshape(-1), minlength=v) / tokens.size  # mask does not matter
    # Diagonal by structure: factors() returns the diagonal itself, never a V×V matrix.
    a = wrapped.thor.factors("emb")["A"]
    assert a.shape == (v,)
    np.testing.assert_allclose(a, counts, rtol=1e-6)


# -- a small Transformer --------------------------------------------------------------------------

def _transformer(v=12, t=6, d=8, k=3, seed=19):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((t,), dtype="int32")
    h = keras.layers.Embedding(v, d, name="tokens")(inputs)
    attended = keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = keras.layers.LayerNormalization(name="ln")(keras.layers.Add()([h, attended]))
    h = keras.layers.Conv1D(d, 3, padding="causal", activation="relu", name="conv")(h)
    h = keras.layers.Dense(d, activation="relu", name="ff")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(k, activation="softmax", name="out")(h))


def test_transformer_has_a_block_for_every_layer_and_trains_saves_and_loads(tmp_path):
    rng = np.random.default_rng(20)
    x, y = rng.integers(0, 12, size=(32, 6)).astype("int32"), rng.integers(0, 3, 32)
    wrapped = _wrap(_transformer(), split_dim=4, learning_rate=0.05, frequency=2)
    table = wrapped.thor.registration_table(4)
    kinds = {b.name: b.kind for b in wrapped.thor.blocks}
    assert kinds == {"tokens": "embedding", "query": "einsum_dense", "key": "einsum_dense",
                     "value": "einsum_dense", "attention_output": "einsum_dense",
                     "conv": "conv1d", "ff": "dense", "out": "dense"}
    assert "first order: ln (LayerNormalization: normalization, first order by design)" in table
    wrapped.compile(loss="sparse_categorical_crossentropy")
    losses = [float(wrapped.train_on_batch(x, y)) for _ in range(5)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(s["refreshes"] >= 1 for s in wrapped.thor.layer_stats())

    path = os.path.join(tmp_path, "transformer.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, thor_tf.ThorModel)
    np.testing.assert_allclose(loaded(x).numpy(), wrapped(x).numpy(), atol=1e-6)
    for a, b in zip(wrapped.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Continue both (eagerly: the same step without tracing it twice more).
    wrapped.run_eagerly = loaded.run_eagerly = True
    for _ in range(2):  # a cadence step and a reuse step
        wrapped.train_on_batch(x, y)
        loaded.train_on_batch(x, y)
    for a, b in zip(wrapped.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
