"""The example rule of docs/writing_a_rule.md (tests/example_rule.py, shown there verbatim):
its steps against a float64 K-FAC reference built from per-example inputs and output
gradients, and a model it trains."""

import re
from pathlib import Path

import keras
import numpy as np
import pytest

import thor_tf
from example_rule import KroneckerSGD

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing_a_rule.md"


def test_the_guide_shows_the_rule_as_it_is():
    code = re.search(r"```python\n(\"\"\"An example update rule.*?)```", DOC.read_text(),
                     re.S).group(1)
    assert code == (Path(__file__).parent / "example_rule.py").read_text()
    assert len(code.splitlines()) <= 60


def _reference_steps(x, y, kernel, bias, damping, lr, steps):
    """Weights after ``steps`` K-FAC steps of one softmax Dense layer, float64: per step
    ``A = mean_n ā ā ᵀ`` (``ā = [x, 1]``, one outer product per example), ``G = mean_n g gᵀ``
    (``g = softmax(z) − onehot(y)``: dℓ_n/dz of example n's cross-entropy), ``M = āᵀ g / N``
    (the mean loss's gradient), ``Δ = (A + √λ I)⁻¹ M (G + √λ I)⁻¹``, ``w ← w − lr·Δ``."""
    n = x.shape[0]
    w = np.concatenate([kernel, bias[None]]).astype(np.float64)
    rows = np.concatenate([x.astype(np.float64), np.ones((n, 1))], axis=1)
    for _ in range(steps):
        z = rows @ w
        p = np.exp(z - z.max(axis=1, keepdims=True))
        g = p / p.sum(axis=1, keepdims=True) - np.eye(w.shape[1])[y]
        big_a = sum(np.outer(r, r) for r in rows) / n
        big_g = sum(np.outer(gi, gi) for gi in g) / n
        m = rows.T @ g / n
        d = np.sqrt(damping)
        delta = (np.linalg.inv(big_a + d * np.eye(big_a.shape[0])) @ m
                 @ np.linalg.inv(big_g + d * np.eye(big_g.shape[0])))
        w = w - lr * delta
    return w


@pytest.mark.parametrize("steps", [1, 3])
def test_the_example_rule_takes_the_float64_kfac_steps(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    y = rng.integers(0, 3, 32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="out")])
    kernel, bias = (np.array(v) for v in model.get_weights())
    wrapped = thor_tf.wrap(model, update_rule=KroneckerSGD(), learning_rate=0.2, damping=0.05,
                           preset="thor_nt", frequency=1, verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(steps):
        wrapped.train_on_batch(x, y)
    got = np.concatenate([w[None] if w.ndim == 1 else w for w in wrapped.get_weights()])
    expected = _reference_steps(x, y, kernel, bias, 0.05, 0.2, steps)
    moved = np.abs(expected - np.concatenate([kernel, bias[None]])).max()
    assert moved > 1e-2
    np.testing.assert_allclose(got, expected, atol=2e-5 * max(1.0, moved), rtol=1e-4)
    assert wrapped.thor.layer_stats()[0]["refreshes"] == steps


def test_the_example_rule_trains_a_model_with_a_first_order_variable():
    """A hidden layer, a LayerNormalization (no block: the rule's SGD path) and the head."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(3)])
    wrapped = thor_tf.wrap(model, update_rule=KroneckerSGD(), learning_rate=0.1,
                           verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    before = wrapped.evaluate(x, y, verbose=0)[0]
    history = wrapped.fit(x, y, batch_size=32, epochs=5, verbose=0)
    assert history.history["loss"][-1] < 0.6 * before
    assert history.history["accuracy"][-1] > 0.8


class _ReachesForTheOptimizer(KroneckerSGD):
    """The example rule, but its step reads the optimizer's iterations through the step."""

    def precondition(self, step, active, rows_per_term, grads, variables, use_grads):
        step.optimizer.iterations  # noqa: B018
        return super().precondition(step, active, rows_per_term, grads, variables, use_grads)


class _ReachesForTheEngine(KroneckerSGD):
    def refresh(self, step, layers, refresh, factors, damping):
        step.engine.state  # noqa: B018
        return super().refresh(step, layers, refresh, factors, damping)


@pytest.mark.parametrize("rule,name", [(_ReachesForTheOptimizer, "optimizer"),
                                       (_ReachesForTheEngine, "engine")])
def test_a_rule_sees_only_its_step(rule, name):
    """What a rule gets in ``refresh`` and ``precondition`` is its ``Step``: reaching past it
    (the optimizer, the engine) fails at the first trace, naming the attribute, and the step
    cannot be written to."""
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="out")])
    wrapped = thor_tf.wrap(model, update_rule=rule(), frequency=1, verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(AttributeError, match=name):
        wrapped.train_on_batch(x, np.zeros(8, "int64"))
    step = wrapped.thor.rule_step()
    assert step.layer(wrapped.thor.blocks[0]) is wrapped.thor.state.layers[0]
    with pytest.raises(AttributeError, match="read-only"):
        step.ok = False
