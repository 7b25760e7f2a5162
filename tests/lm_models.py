"""A tiny causal Transformer LM for the per-token Fisher tests (and their float64 references).

``tiny_lm(...)`` returns ``(model, parts)``: ``model`` maps ``[B, T]`` int tokens to ``[B, T, V]``
logits (Embedding → causal MultiHeadAttention → GELU MLP → Dense head, residual, no LayerNorm so
that a float64 copy is exact); ``parts["head_input"]`` the model from tokens to the head's input
and ``parts["after_embedding"]`` the model from the embedding's output to the logits, sharing the
same layers (the references take ``h`` and ``dΣℓ/dz`` from them).
"""

import keras
import numpy as np


def tiny_lm(vocab=11, length=6, width=8, heads=2, seed=0, dtype="float32", tied=False):
    """``tied``: the token embedding is a ``keras.layers.ReversibleEmbedding`` whose ``reverse``
    call is the output projection (``logits = h @ Eᵀ``), as GPT-2's."""
    keras.utils.set_random_seed(seed)
    if tied:
        tok = keras.layers.ReversibleEmbedding(vocab, width, name="tok", dtype=dtype)
    else:
        tok = keras.layers.Embedding(vocab, width, name="tok", dtype=dtype)
    att = keras.layers.MultiHeadAttention(heads, width // heads, name="att", dtype=dtype)
    fc = keras.layers.Dense(16, activation="gelu", name="fc", dtype=dtype)
    proj = keras.layers.Dense(width, name="proj", dtype=dtype)
    head = (lambda h: tok(h, reverse=True)) if tied else keras.layers.Dense(
        vocab, name="head", dtype=dtype)

    def trunk(e):
        x = e + att(e, e, use_causal_mask=True)
        return x + proj(fc(x))

    tokens = keras.Input((length,), dtype="int32")
    e = tok(tokens)
    h = trunk(e)
    model = keras.Model(tokens, head(h), name="tiny_lm")
    e_in = keras.Input((length, width), dtype=dtype)
    parts = {"head_input": keras.Model(tokens, h),
             "after_embedding": keras.Model(e_in, head(trunk(e_in)))}
    return model, parts


def token_data(n=8, length=6, vocab=11, seed=0):
    """Sequences of a noisy counting language: ``y[t] = x[t] + 1 mod V`` mostly."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, length)).astype("int32")
    y = (x + 1) % vocab
    flip = rng.random(y.shape) < 0.2
    y[flip] = rng.integers(0, vocab, size=int(flip.sum()))
    return x, y.astype("int32")


def padding_weights(n=8, length=6, seed=1):
    """``[n, length]`` 0/1 weights: each sequence valid up to a random length (≥ 2)."""
    rng = np.random.default_rng(seed)
    valid = rng.integers(2, length + 1, size=n)
    return (np.arange(length)[None, :] < valid[:, None]).astype("float32")
