"""Tied embeddings (issue 23): a ``keras.layers.ReversibleEmbedding`` used as the lookup and as the
output projection gets two blocks on its one matrix (thor_tf/blocks/reversible_embedding.py).

References without thor_tf, in float64: the head use's rows ``h`` and ``g_H = w·(softmax −
onehot)`` (NumPy), the lookup use's ``g_L = dΣwℓ/de`` (autodiff through a float64 copy), each use's
factors as explicit sums over the valid rows, and the step ``F_L⁻¹∇_lookup + (F_H⁻¹∇_headᵀ)ᵀ``
with ``∇_lookup = Σ onehot(x) g_Lᵀ / s`` and ``∇_head = Σ g_H hᵀ / s``. With one use removed the
step equals the plain Embedding's (or a bias-free Dense head's) on the same weights.
"""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_models import padding_weights, tiny_lm, token_data  # noqa: E402
from test_lm_fisher import DAMPING, LOSS, OPTIONS, _kfac_step, _softmax  # noqa: E402

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = [pytest.mark.update_rule("inverse"),
              pytest.mark.skipif(not hasattr(keras.layers, "ReversibleEmbedding"),
                                 reason="keras.layers.ReversibleEmbedding needs Keras >= 3.11")]


def _tied_reference(model, parts, x, y, w):
    B, T = x.shape
    valid = (w != 0).reshape(-1)
    s = B * T
    E = model.get_layer("tok").embeddings.numpy().astype(np.float64)
    h = parts["head_input"](x).numpy().astype(np.float64).reshape(B * T, -1)
    g_head = w.reshape(-1, 1) * (_softmax(h @ E.T) - np.eye(E.shape[0])[y.reshape(-1)])
    A_h, G_h, step_h = _kfac_step(h, g_head, valid, h.T @ g_head / s, DAMPING)

    model64, parts64 = tiny_lm(dtype="float64", tied=True)
    for v64, v in zip(model64.weights, model.weights):
        v64.assign(v.numpy().astype(np.float64))
    e = tf.constant(E[x])
    with tf.GradientTape() as tape:
        tape.watch(e)
        total = tf.reduce_sum(tf.constant(w, tf.float64) * keras.losses.sparse_categorical_crossentropy(
            y, parts64["after_embedding"](e), from_logits=True))
    g_lookup = tape.gradient(total, e).numpy().reshape(B * T, -1)
    onehot = np.eye(E.shape[0])[x.reshape(-1)]
    A_l, G_l, step_l = _kfac_step(onehot, g_lookup, valid, onehot.T @ g_lookup / s, DAMPING)
    return {"E": E - step_l - step_h.T, "A_tok": A_l, "G_tok": G_l, "A_tok/reverse": A_h,
            "G_tok/reverse": G_h}


def test_each_use_has_its_exact_factors_and_the_step_sums_their_natural_gradients():
    x, y = token_data(n=8)
    w = padding_weights(n=8)
    model, parts = tiny_lm(tied=True)
    expected = _tied_reference(model, parts, x, y, w)
    wrapped = thor_tf.wrap(model, **OPTIONS)
    assert [b.kind for b in wrapped.thor.blocks if b.layer.name == "tok"] == ["embedding",
                                                                              "tied head"]
    wrapped.compile(loss=LOSS)
    wrapped.fit(x, y, sample_weight=w, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for name in ("tok", "tok/reverse"):
        factors = wrapped.thor.factors(name)
        A = factors["A"] if factors["A"].ndim == 2 else np.diag(factors["A"].reshape(-1))
        np.testing.assert_allclose(A, expected[f"A_{name}"], rtol=1e-5, atol=1e-6, err_msg=name)
        G = expected[f"G_{name}"]
        np.testing.assert_allclose(factors["G"], G, rtol=1e-4, atol=1e-5 * np.abs(G).max(),
                                   err_msg=name)
    got = model.get_layer("tok").embeddings.numpy()
    np.testing.assert_allclose(got, expected["E"], rtol=1e-4,
                               atol=1e-4 * np.abs(expected["E"]).max())
    stats = {s["name"]: s for s in wrapped.thor.layer_stats()}
    assert stats["tok"]["refreshes"] == 1 and stats["tok/reverse"]["refreshes"] == 1


def _two_models(kind):
    """(reversible-embedding model, plain model) with equal weights where one use is absent."""
    vocab, length, width = 11, 6, 8
    tokens = keras.Input((length,), dtype="int32")
    keras.utils.set_random_seed(0)
    rev = keras.layers.ReversibleEmbedding(vocab, width, name="rev")
    if kind == "lookup only":
        rev_model = keras.Model(tokens, keras.layers.Dense(vocab, name="head")(rev(tokens)))
        plain_emb = keras.layers.Embedding(vocab, width, name="rev")
        plain = keras.Model(tokens, keras.layers.Dense(vocab, name="head")(plain_emb(tokens)))
    else:
        inp = keras.layers.Embedding(vocab, width, name="inp")
        rev.build((None, length))
        rev_model = keras.Model(tokens, rev(inp(tokens), reverse=True))
        inp2 = keras.layers.Embedding(vocab, width, name="inp")
        plain = keras.Model(tokens, keras.layers.Dense(vocab, use_bias=False, name="rev")(
            inp2(tokens)))
    for a, b in zip(plain.weights, rev_model.weights):
        a.assign(b.numpy().T if a.shape != b.shape else b.numpy())
    return rev_model, plain


@pytest.mark.parametrize("kind", ["lookup only", "head only"])
def test_with_one_use_removed_the_step_is_that_uses_block(kind):
    x, y = token_data(n=8)
    rev_model, plain = _two_models(kind)
    for model in (rev_model, plain):
        wrapped = thor_tf.wrap(model, **OPTIONS)
        wrapped.compile(loss=LOSS)
        wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.weights, rev_model.weights):
        b = b.numpy().T if a.shape != b.shape else b.numpy()
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-6, err_msg=a.name)


class _TiedInside(keras.layers.Layer):
    """A layer that holds a tied ReversibleEmbedding and uses it both ways inside its own
    ``call``: the model's graph has no node for the embedding (only discovery's symbolic forward
    pass sees the ``reverse=True`` call)."""

    def __init__(self, v, d, **kwargs):
        super().__init__(**kwargs)
        self.tok = keras.layers.ReversibleEmbedding(v, d, name="tok")
        self.mix = keras.layers.Dense(d, activation="tanh", name="mix")

    def build(self, shape):
        self.tok.build(shape)
        self.mix.build(tuple(shape) + (self.tok.output_dim,))

    def call(self, tokens):
        return self.tok(self.mix(self.tok(tokens)), reverse=True)


def test_a_tied_embedding_used_both_ways_inside_a_layer_keeps_its_head_block():
    keras.utils.set_random_seed(3)
    v, t = 9, 5
    inputs = keras.Input((t,), dtype="int32")
    model = keras.Model(inputs, _TiedInside(v, 4, name="inside")(inputs))
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, v, size=(16, t)).astype("int32"), rng.integers(0, v, size=(16, t))
    weights = [w.numpy() for w in model.weights]
    wrapped = thor_tf.wrap(model, frequency=1, verbose=False)
    # discovery's symbolic forward pass changed nothing
    for w, before in zip(model.weights, weights):
        np.testing.assert_array_equal(w.numpy(), before)
    assert {b.name: b.kind for b in wrapped.thor.blocks} == {
        "tok": "embedding", "tok/reverse": "tied head", "mix": "dense"}
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(3):
        wrapped.train_on_batch(x, y)
    assert all(s["refreshes"] >= 1 for s in wrapped.thor.layer_stats())


def test_untied_reversible_embedding_has_a_lookup_and_a_head_block_on_its_two_matrices():
    """``tie_weights=False`` (KerasHub's Llama, Mistral, Phi-3): the lookup on ``E [V, D]`` and the
    head on ``R = reverse_embeddings [D, V]`` are two variables, each with its block; factors and
    the head's step against float64 rows built by hand (per-token terms: g = softmax − onehot)."""
    vocab, length, width, n = 9, 5, 4, 6
    keras.utils.set_random_seed(2)
    tokens = keras.Input((length,), dtype="int32")
    rev = keras.layers.ReversibleEmbedding(vocab, width, tie_weights=False, name="rev")
    mix = keras.layers.Dense(width, activation="tanh", name="mix")
    model = keras.Model(tokens, rev(mix(rev(tokens)), reverse=True))
    rng = np.random.default_rng(8)
    x, y = rng.integers(0, vocab, size=(n, length)), rng.integers(0, vocab, size=(n, length))
    E, W, b = (v.numpy().astype(np.float64) for v in (rev.embeddings, mix.kernel, mix.bias))
    R = rev.reverse_embeddings.numpy().astype(np.float64)

    e = E[x.reshape(-1)]                                        # lookup rows [N·T, D]
    h = np.tanh(e @ W + b)                                      # the head's input rows
    g_head = _softmax(h @ R) - np.eye(vocab)[y.reshape(-1)]     # dℓ_t/dlogits per token term
    g_lookup = ((g_head @ R.T) * (1 - h ** 2)) @ W.T            # dℓ_t/de, chain rule by hand
    valid = np.ones(n * length, bool)
    A_h, G_h, step_h = _kfac_step(h, g_head, valid, h.T @ g_head / (n * length), DAMPING)
    counts = np.bincount(x.reshape(-1), minlength=vocab) / (n * length)

    wrapped = thor_tf.wrap(model, **OPTIONS)
    assert {bl.name: bl.kind for bl in wrapped.thor.blocks} == {
        "rev": "embedding", "rev/reverse": "untied head", "mix": "dense"}
    wrapped.compile(loss=LOSS)
    wrapped.train_on_batch(x.astype("int32"), y)
    head, lookup = wrapped.thor.factors("rev/reverse"), wrapped.thor.factors("rev")
    np.testing.assert_allclose(head["A"], A_h, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(head["G"], G_h, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(lookup["A"], counts, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(lookup["G"], g_lookup.T @ g_lookup / (n * length), rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(R - rev.reverse_embeddings.numpy(), step_h, rtol=2e-3, atol=1e-6)
