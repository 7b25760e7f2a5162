"""The Fisher of a per-token loss (issue 23): a causal Transformer LM's THOR step against float64
first principles.

Keras averages an LM's loss over the B·T tokens; each token is a term (a data point of the Fisher,
DESIGN §8). The references below are built without thor_tf: the head's per-token output gradients
are ``w·(softmax − onehot)`` in NumPy, the embedding's are float64 autodiff of the weighted sum of
token losses through a float64 copy of the network, the factors are explicit sums over the valid
rows, the step is ``(A + √(λ/c) I)⁻¹ M (G + √(λ/c) I)⁻¹ / c`` with ``c = R/D = 1`` (one row per
token) and ``M`` the loss's gradient, at lr 1 and momentum 0 (one step, refresh at step 0). The
same step is checked through ``fit`` (traced and eager), a model's own ``train_step`` calling
``compute_loss``, a custom loop calling a Keras loss object, and on 2 replicas (subprocess).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from thor_tf import fisher, loss_terms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_models import padding_weights, tiny_lm, token_data  # noqa: E402

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")

DAMPING = 0.03
OPTIONS = dict(learning_rate=1.0, momentum=0.0, damping=DAMPING, preset="thor_nt", frequency=1,
               split_dim=512, kl_clip=None, verbose=False)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _kfac_step(a_rows, g_rows, valid, grad_matrix, damping, c=1.0):
    """float64 ``(A, G, Δ)`` from explicit rows (``[R, a]``, ``[R, g]``), the valid-row mask and
    the loss's gradient matrix ``[a, g]``."""
    a_v, g_v = a_rows[valid], g_rows[valid]
    A = a_v.T @ a_v / len(a_v)
    G = g_v.T @ g_v / len(g_v)
    d = np.sqrt(damping / c)
    step = np.linalg.solve(A + d * np.eye(len(A)), grad_matrix) @ np.linalg.inv(G + d * np.eye(len(G)))
    return A, G, step / c


def _references(model, parts, x, y, w):
    """Expected (head kernel, head bias, embeddings) after one THOR step, and the head's and the
    embedding's float64 factors."""
    B, T = x.shape
    w = np.ones((B, T)) if w is None else w.astype(np.float64)
    valid = (w != 0).reshape(-1)
    s = B * T  # Keras' sum_over_batch_size divides by every value (sample weights do not change it)
    head = model.get_layer("head")
    W, b = (v.numpy().astype(np.float64) for v in (head.kernel, head.bias))
    h = parts["head_input"](x).numpy().astype(np.float64).reshape(B * T, -1)
    onehot = np.eye(W.shape[1])[y.reshape(-1)]
    g_head = w.reshape(-1, 1) * (_softmax(h @ W + b) - onehot)  # dΣwℓ/dz per token
    a_head = np.concatenate([h, np.ones((B * T, 1))], 1)
    A_h, G_h, step_h = _kfac_step(a_head, g_head, valid, a_head.T @ g_head / s, DAMPING)

    # Embedding: dΣwℓ/de by float64 autodiff through a float64 copy of the rest of the network.
    model64, parts64 = tiny_lm(dtype="float64")
    for v64, v in zip(model64.weights, model.weights):
        v64.assign(v.numpy().astype(np.float64))
    E = model.get_layer("tok").embeddings.numpy().astype(np.float64)
    e = tf.constant(E[x])
    with tf.GradientTape() as tape:
        tape.watch(e)
        logits = parts64["after_embedding"](e)
        total = tf.reduce_sum(tf.constant(w) * keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
    g_emb = tape.gradient(total, e).numpy().reshape(B * T, -1)
    a_emb = np.eye(E.shape[0])[x.reshape(-1)]
    A_e, G_e, step_e = _kfac_step(a_emb, g_emb, valid, a_emb.T @ g_emb / s, DAMPING)
    return {"kernel": W - step_h[:-1], "bias": b - step_h[-1], "embeddings": E - step_e,
            "A_head": A_h, "G_head": G_h, "A_tok": A_e, "G_tok": G_e}


def _assert_step(model, expected):
    head = model.get_layer("head")
    for got, key in ((head.kernel, "kernel"), (head.bias, "bias"),
                     (model.get_layer("tok").embeddings, "embeddings")):
        want = expected[key]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=key)


def _data(padded):
    x, y = token_data(n=8)
    return x, y, (padding_weights(n=8) if padded else None)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("eager", [False, True])
def test_fit_takes_the_per_token_kfac_step(padded, eager):
    x, y, w = _data(padded)
    model, parts = tiny_lm()
    expected = _references(model, parts, x, y, w)
    wrapped = thor_tf.wrap(model, **OPTIONS)
    wrapped.compile(loss=LOSS, run_eagerly=eager)
    wrapped.fit(x, y, sample_weight=w, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_step(model, expected)
    for name in ("head", "tok"):
        factors = wrapped.thor.factors(name)
        A = factors["A"] if factors["A"].ndim == 2 else np.diag(factors["A"].reshape(-1))
        np.testing.assert_allclose(A, expected[f"A_{name}"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(factors["G"], expected[f"G_{name}"], rtol=1e-4,
                                   atol=1e-5 * np.abs(expected[f"G_{name}"]).max())


class _OwnStep(keras.Model):
    """keras-io's "customizing what happens in fit": the model's own train_step."""

    def train_step(self, data):
        x, y, w = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True), sample_weight=w)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_models_own_train_step_takes_the_same_step():
    x, y, w = _data(padded=True)
    model, parts = tiny_lm()
    expected = _references(model, parts, x, y, w)
    own = _OwnStep(model.input, model.output, name="own_step")
    wrapped = thor_tf.wrap(own, **OPTIONS)
    wrapped.compile(loss=LOSS)
    wrapped.fit(x, y, sample_weight=w, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_step(model, expected)


def test_a_custom_loop_with_a_keras_loss_takes_the_same_step():
    x, y, w = _data(padded=True)
    model, parts = tiny_lm()
    expected = _references(model, parts, x, y, w)
    wrapped = thor_tf.wrap(model, **OPTIONS)
    wrapped.compile()
    optimizer = wrapped.optimizer

    @tf.function
    def step(xb, yb, wb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True), sample_weight=wb)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    step(tf.constant(x), tf.constant(y), tf.constant(w))
    _assert_step(model, expected)


def test_one_term_per_example_when_told_so():
    """``loss_reduction="mean"`` says the loss is a mean over examples (today's per-example
    convention): g = B·dL/dz, G over rows, c = P = T, so G is T² smaller than per token."""
    x, y, _ = _data(padded=False)
    grams = {}
    for option in ("auto", "mean"):
        model, _ = tiny_lm()
        wrapped = thor_tf.wrap(model, loss_reduction=option, **OPTIONS)
        wrapped.compile(loss=LOSS)
        wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)
        grams[option] = wrapped.thor.factors("head")["G"]
    T = x.shape[1]
    np.testing.assert_allclose(grams["mean"] * T ** 2, grams["auto"], rtol=1e-4)


def test_losses_with_different_terms_in_one_step_are_refused():
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(11, 8)(tokens)
    per_token = keras.layers.Dense(11, name="lm")(h)
    per_example = keras.layers.Dense(3, name="cls")(keras.layers.GlobalAveragePooling1D()(h))
    wrapped = thor_tf.wrap(keras.Model(tokens, {"lm": per_token, "cls": per_example}),
                           verbose=False)
    wrapped.compile(loss={"lm": LOSS, "cls": LOSS})
    x, y = token_data(n=8)
    with pytest.raises(ValueError, match="loss_reduction"):
        wrapped.fit(x, {"lm": y, "cls": y[:, 0] % 3}, epochs=1, verbose=0)


@pytest.mark.parametrize("case", ["plain", "weights", "mean_with_sample_weight", "sum", "mask"])
def test_terms_match_what_keras_divides_by(case):
    """``Σ w·ℓ / scale`` equals the loss Keras computed (its divisor), ``count`` the valid terms."""
    rng = np.random.default_rng(0)
    logits = tf.constant(rng.normal(size=(4, 5, 7)).astype("float32"))
    y = tf.constant(rng.integers(0, 7, size=(4, 5)))
    w = padding_weights(n=4, length=5) * (1 + rng.random((4, 5))).astype("float32")
    reduction = {"mean_with_sample_weight": "mean_with_sample_weight", "sum": "sum"}.get(
        case, "sum_over_batch_size")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    sample_weight = None if case in ("plain", "mask") else tf.constant(w)
    per_term = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True).numpy()
    if case == "mask":
        keras_mask = tf.constant(w != 0)
        logits._keras_mask = keras_mask
    with tf.GradientTape():  # the observer records under a tape
        value = float(loss(y, logits, sample_weight=sample_weight))
    terms = loss_terms.take()
    weights = w if sample_weight is not None else (w != 0) if case == "mask" else np.ones_like(w)
    assert float(np.sum(weights * per_term) / float(terms.scale)) == pytest.approx(value, rel=1e-5)
    expected_count = (w != 0).sum() if case != "plain" else w.size
    assert float(terms.count) == expected_count
    assert float(terms.per_example) == 5.0


def test_sampled_fisher_leaves_masked_terms_out():
    rng = np.random.default_rng(0)
    logits = tf.Variable(rng.normal(size=(3, 4, 6)).astype("float32"))
    mask = tf.constant(padding_weights(n=3, length=4) != 0)
    spec = fisher.LossSpec("sparse", from_logits=True)
    with tf.GradientTape() as tape:
        total = fisher.sampled_loss(spec, logits, mask=mask)
    grad = tape.gradient(total, logits).numpy()
    assert np.all(grad[~mask.numpy()] == 0)
    assert np.all(np.abs(grad[mask.numpy()]).sum(-1) > 0)


REPLICAS = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, thor_tf
sys.path.insert(0, sys.argv[1])
from lm_models import tiny_lm, token_data, padding_weights
x, y = token_data(n=8)
w = padding_weights(n=8)
w[:4, 3:] = 0  # the first replica's half has far fewer valid tokens than the second's
opts = dict(learning_rate=1.0, momentum=0.0, damping=0.03, preset="thor_nt", frequency=1,
            split_dim=512, kl_clip=None, verbose=False, update_rule="inverse")
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

def run(strategy):
    with strategy.scope():
        model, _ = tiny_lm()
        wrapped = thor_tf.wrap(model, **opts)
        wrapped.compile(loss=loss)
    wrapped.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [v.numpy() for v in model.trainable_variables], wrapped.thor.factors("head")["G"]

one, g_one = run(tf.distribute.get_strategy())
two, g_two = run(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
print("RESULT" + json.dumps({
    "max_weight_diff": max(float(np.abs(a - b).max()) for a, b in zip(one, two)),
    "max_weight": max(float(np.abs(a).max()) for a in one),
    "g_diff": float(np.abs(g_one - g_two).max()), "g_max": float(np.abs(g_one).max())}))
"""


def test_two_replicas_take_the_one_device_step_with_unequal_valid_tokens():
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", REPLICAS, here], capture_output=True, text=True,
                         timeout=300)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    assert line, out.stderr[-3000:]
    result = json.loads(line[0][len("RESULT"):])
    assert result["g_diff"] <= 1e-5 * result["g_max"], result
    assert result["max_weight_diff"] <= 1e-5 * result["max_weight"], result
