"""KerasHub tasks wrapped with thor_tf: GPT2CausalLM and BertTextClassifier built from tiny
configs (random weights, ``preprocessor=None``; presets download weights and are never used).

Skipped without keras-hub (``bash .ci/hub`` installs it over tensorflow-cpu) or on Keras < 3.15
(KerasHub 0.32's floor; ``.ci/floor`` runs Keras 3.8). Findings behind these tests:
docs/finetune.md. GPT-2's token embedding is both the lookup and the output head: it has
a lookup and a tied head block (thor_tf/blocks/reversible_embedding.py).
"""

import os
import re
import warnings

import keras
import numpy as np
import pytest

if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 15):
    pytest.skip("KerasHub 0.32 needs Keras >= 3.15", allow_module_level=True)
keras_hub = pytest.importorskip("keras_hub")

import thor_tf  # noqa: E402

V, T = 100, 16  # vocabulary, sequence length
CONFIG = dict(vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
              max_sequence_length=T)
BLOCK_TYPES = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)


def _gpt2(seed=0):
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2CausalLM(
        backbone=keras_hub.models.GPT2Backbone(**CONFIG), preprocessor=None)


def _bert(seed=0):
    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertTextClassifier(
        backbone=keras_hub.models.BertBackbone(**CONFIG), num_classes=3, preprocessor=None)


def _lm_data(n=64, seed=0):
    """``(x, y, sample_weight)`` as GPT2CausalLMPreprocessor makes them: the next token is the
    label, the padding mask (shifted) the sample weight; padded tails of random length."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, size=(n, T + 1)).astype("int32")
    lengths = rng.integers(T // 2, T + 2, size=n)
    mask = np.arange(T + 1)[None, :] < lengths[:, None]
    tokens[~mask] = 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


def _bert_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(1, V, size=(n, T)).astype("int32"),
         "segment_ids": np.zeros((n, T), "int32"),
         "padding_mask": np.ones((n, T), "int32")}
    return x, rng.integers(0, 3, n)


#: The BertTextClassifier's layers with blocks (every Dense, EinsumDense and Embedding).
BERT_BLOCKS = ["token_embedding", "segment_embedding", "pooled_dense", "logits"] + [
    f"transformer_layer_{i}/{name}" for i in range(2) for name in (
        "self_attention_layer/query", "self_attention_layer/key", "self_attention_layer/value",
        "self_attention_layer/attention_output", "feedforward_intermediate_dense",
        "feedforward_output_dense")]


def _refreshes(wrapped):
    return {s["name"]: s["refreshes"] for s in wrapped.thor.layer_stats()}


@pytest.fixture(scope="module")
def trained_lm():
    """A GPT2CausalLM wrapped (cadence every 2 steps), compiled with no arguments, 4 fit steps."""
    task = _gpt2()
    wrapped = thor_tf.wrap(task, frequency=2, verbose=False)
    wrapped.compile()
    before = wrapped.thor.counters()
    x, y, w = _lm_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = wrapped.fit(x, y, sample_weight=w, batch_size=16, epochs=1, verbose=0)
    return {"task": task, "wrapped": wrapped, "history": history.history, "before": before,
            "data": (x, y, w), "iterations": int(wrapped.optimizer.iterations.numpy()),
            "warnings": [str(m.message) for m in caught]}


def _fallbacks(messages):
    """The run-time warnings of blocks that fell back to first order in some steps."""
    return [m for m in messages if "first-order update in such steps" in m]


# -- (a) compile() hands the task a ThorOptimizer; fit trains with THOR ----------------------------
def test_wrapped_causal_lm_compiles_with_thor_and_trains(trained_lm):
    task, wrapped, history = trained_lm["task"], trained_lm["wrapped"], trained_lm["history"]
    thor = wrapped.thor_optimizer
    assert isinstance(thor, thor_tf.ThorOptimizer)
    assert task.optimizer is thor  # the task's own compile received it (not its Adam(2e-5))
    # The task's own defaults: a from-logits cross-entropy and a weighted accuracy.
    assert isinstance(wrapped.loss, keras.losses.SparseCategoricalCrossentropy)
    assert "sparse_categorical_accuracy" in history
    assert np.isfinite(history["loss"]).all()
    assert trained_lm["iterations"] == 4
    counters = wrapped.thor.counters()
    assert trained_lm["before"]["cadence_points"] == 0 and counters["cadence_points"] >= 2
    assert counters["nonfinite_steps"] == 0
    refreshes = _refreshes(wrapped)
    attention = [n for n in refreshes if "self_attention/" in n]
    assert len(attention) == 8 and all(refreshes[n] >= 1 for n in attention)
    assert all(refreshes[n] >= 1 for n in refreshes if "feedforward" in n)


def test_compile_arguments_on_a_wrapped_task():
    task = _gpt2()
    wrapped = thor_tf.wrap(task, damping=0.1, learning_rate=0.01, verbose=False)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, name="my_loss")
    wrapped.compile(loss=loss, sampler="greedy")  # THOR, the user's loss, the task's sampler
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer)
    assert wrapped.thor_optimizer.damping == 0.1
    assert float(wrapped.thor_optimizer.learning_rate.numpy()) == pytest.approx(0.01)
    assert wrapped.loss is loss
    assert isinstance(task.sampler, keras_hub.samplers.GreedySampler)
    wrapped.compile(optimizer="thor")
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer)
    assert isinstance(wrapped.loss, keras.losses.SparseCategoricalCrossentropy)  # task default again
    adam = keras.optimizers.Adam(1e-3)
    wrapped.compile(optimizer=adam)  # first order, as before
    assert wrapped.optimizer is adam and wrapped.thor_optimizer is None
    assert wrapped.thor.other_optimizer == "Adam"


# -- (b) optimizer="thor" ------------------------------------------------------------------------
def test_thor_by_name_on_an_unwrapped_task_says_to_wrap_it():
    task = _gpt2()
    with pytest.raises(ValueError, match=r"thor_tf\.wrap"):
        task.compile(optimizer="thor")
    wrapped = thor_tf.wrap(task, verbose=False)
    wrapped.compile(optimizer="thor")
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer)


# -- (c) predictions unchanged by wrap -------------------------------------------------------------
@pytest.mark.parametrize("build,data", [(_gpt2, lambda: _lm_data(8)[0]), (_bert, lambda: _bert_data(8)[0])],
                         ids=["gpt2", "bert"])
def test_predictions_bit_identical_after_wrap(build, data):
    task, x = build(), data()
    direct, predicted = np.asarray(task(x)), task.predict(x, verbose=0)
    wrapped = thor_tf.wrap(task, verbose=False)
    wrapped.compile()
    np.testing.assert_array_equal(np.asarray(wrapped(x)), direct)
    np.testing.assert_array_equal(np.asarray(task(x)), direct)
    np.testing.assert_array_equal(wrapped.predict(x, verbose=0), predicted)


# -- (d) save / load ------------------------------------------------------------------------------
def test_save_and_load_round_trip(trained_lm, tmp_path):
    wrapped, (x, _, _) = trained_lm["wrapped"], trained_lm["data"]
    path = str(tmp_path / "gpt2_thor.keras")
    wrapped.save(path)
    with warnings.catch_warnings():
        # Keras warns that the inner task's custom compile is not called on load; ThorModel's
        # compile_from_config compiles through it.
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.models.load_model(path)
    assert isinstance(loaded, thor_tf.ThorModel)
    assert isinstance(loaded.model, keras_hub.models.GPT2CausalLM)
    assert isinstance(loaded.thor_optimizer, thor_tf.ThorOptimizer)
    assert loaded.model.optimizer is loaded.optimizer
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0))
    assert int(loaded.optimizer.iterations.numpy()) == int(wrapped.optimizer.iterations.numpy())
    assert loaded.thor.counters() == wrapped.thor.counters()
    assert len(loaded.optimizer.variables) == len(wrapped.optimizer.variables)
    for a, b in zip(wrapped.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


# -- (e) generate() after training -----------------------------------------------------------------
def test_generate_after_training_with_token_ids(trained_lm):
    task = trained_lm["task"]
    rng = np.random.default_rng(1)
    prompt = np.zeros((2, T), "int32")
    prompt[:, :5] = rng.integers(1, V, size=(2, 5))
    prompt_mask = np.arange(T)[None, :] < 5
    prompt_mask = np.repeat(prompt_mask, 2, axis=0)
    # Without a preprocessor there is no end token: stop_token_ids must be given (None: fill).
    with pytest.raises(ValueError, match="stop_token_ids"):
        task.generate({"token_ids": prompt, "padding_mask": prompt_mask})
    out = task.generate({"token_ids": prompt, "padding_mask": prompt_mask}, stop_token_ids=None)
    assert out["token_ids"].shape == (2, T) and out["padding_mask"].all()
    np.testing.assert_array_equal(out["token_ids"][:, :5], prompt[:, :5])  # the prompt is kept
    assert ((out["token_ids"] >= 0) & (out["token_ids"] < V)).all()
    # The wrapped model's task is the same object: generate is there too.
    assert trained_lm["wrapped"].model is task


# -- BertTextClassifier -----------------------------------------------------------------------------
def test_bert_classifier_trains_with_thor_and_round_trips(tmp_path):
    task = _bert()
    wrapped = thor_tf.wrap(task, frequency=2, verbose=False)
    wrapped.compile()
    assert isinstance(wrapped.thor_optimizer, thor_tf.ThorOptimizer) and task.optimizer is wrapped.optimizer
    x, y = _bert_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all() and "sparse_categorical_accuracy" in history
    # No Dense, EinsumDense or Embedding stays first order, at wrap or at run time.
    assert not [layer.path for layer, _ in wrapped.thor.first_order if isinstance(layer, BLOCK_TYPES)]
    assert not _fallbacks([str(m.message) for m in caught])
    refreshes = _refreshes(wrapped)
    assert {n for n in BERT_BLOCKS if refreshes.get(n, 0) < 1} == set()
    path = str(tmp_path / "bert_thor.keras")
    wrapped.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0))
    assert int(loaded.optimizer.iterations.numpy()) == 4
    # Last: no block without data. The classifier calls its ReversibleEmbedding as a lookup
    # only (never reverse=True), so a head block on it would never refresh.
    idle = sorted(n for n, r in refreshes.items() if r == 0)
    assert not idle, f"blocks that never refreshed in 4 steps at cadence 2: {idle}"


# -- the registration (GPT-2: needs the tied block) --------------------------------------------
def test_no_dense_einsum_or_embedding_stays_first_order_in_gpt2(trained_lm):
    wrapped = trained_lm["wrapped"]
    assert not [layer.path for layer, _ in wrapped.thor.first_order if isinstance(layer, BLOCK_TYPES)]
    assert not _fallbacks(trained_lm["warnings"])  # none falls back at run time either
    assert all(r >= 1 for r in _refreshes(wrapped).values())


def test_token_embedding_has_a_tied_block(trained_lm):
    """GPT-2's token embedding is the lookup and the output head (``reverse=True``): today its
    block sees two calls per step, the second not an embedding lookup, and every step falls back
    to first order for it (a warning, 0 refreshes)."""
    assert trained_lm["task"].backbone.token_embedding.tie_weights
    assert not [m for m in trained_lm["warnings"] if "token_embedding" in m]
    assert _refreshes(trained_lm["wrapped"])["token_embedding"] >= 1


def test_each_block_refreshes_at_least_twice_in_100_steps():
    task = _gpt2()
    wrapped = thor_tf.wrap(task, verbose=False)  # default cadence (10) and max_block_age (50)
    wrapped.compile()
    x, y, w = _lm_data(n=800)
    wrapped.fit(x, y, sample_weight=w, batch_size=8, epochs=1, verbose=0)
    assert int(wrapped.optimizer.iterations.numpy()) == 100
    refreshes = _refreshes(wrapped)
    assert {n: r for n, r in refreshes.items() if r < 2} == {}


# -- a task with a preprocessor --------------------------------------------------------------------
def _tiny_preprocessor():
    pytest.importorskip("tensorflow_text")
    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "Ġ": 4, "Ġa": 5, "Ġb": 6, "ab": 7,
                  "Ġc": 8}
    merges = ["Ġ a", "Ġ b", "a b", "Ġ c"]
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    return keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tokenizer, sequence_length=8)


TEXTS = ["a b c ab", "b a", "c c a", "ab ab b"] * 4


def _lm_with_preprocessor():
    preprocessor = _tiny_preprocessor()
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=9, num_layers=1, num_heads=2,
                                             hidden_dim=16, intermediate_dim=32,
                                             max_sequence_length=8)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def test_the_tasks_preprocessor_runs_in_the_wrapped_fit_evaluate_and_predict():
    """Raw strings in, as the task's own fit takes them: the wrapped model maps them through the
    task's preprocessor (batch 4: 16 texts -> 4 steps -> 4 cadence points at frequency 1), and
    evaluate / predict equal what the task computes on the same preprocessed batch."""
    import tensorflow as tf

    task = _lm_with_preprocessor()
    wrapped = thor_tf.wrap(task, frequency=1, verbose=False)
    wrapped.compile()
    history = wrapped.fit(TEXTS, batch_size=4, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    assert wrapped.thor.counters()["cadence_points"] == 4
    assert sum(_refreshes(wrapped).values()) > 0
    x, y, w = keras.utils.unpack_x_y_sample_weight(task.preprocessor(tf.constant(TEXTS[:4])))
    logits = task(x)
    np.testing.assert_allclose(wrapped.predict(TEXTS[:4], batch_size=4, verbose=0), logits,
                               rtol=1e-5, atol=1e-6)
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits, w)
    loss = wrapped.evaluate(TEXTS[:4], batch_size=4, verbose=0, return_dict=True)["loss"]
    assert loss == pytest.approx(float(expected), rel=1e-5)


# -- (f) the KerasHub recipes of docs/usage.md, run as written --------------------------------------------
def _usage_recipe(name):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "usage.md")
    match = re.search(rf"<!-- recipe: {name} -->\s*```python\n(.*?)```", open(path).read(), re.S)
    assert match, f"docs/usage.md has no recipe {name!r}"
    return match.group(1)


def test_usage_recipe_keras_hub_gpt2():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, size=(64, T + 1)).astype("int32")
    prompt = np.where(np.arange(T) < 4, tokens[:2, :T], 0).astype("int32")
    namespace = {"keras": keras, "thor_tf": thor_tf, "np": np, "tokens": tokens,
                 "mask": np.ones((64, T + 1), bool), "prompt": prompt,
                 "prompt_mask": np.repeat((np.arange(T) < 4)[None], 2, axis=0)}
    exec(compile(_usage_recipe("keras_hub_gpt2"), "docs/usage.md recipe keras_hub_gpt2", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model.thor_optimizer, thor_tf.ThorOptimizer)
    assert sum(_refreshes(model).values()) > 0
    assert namespace["out"]["token_ids"].shape == (2, T)


def test_usage_recipe_keras_hub_bert():
    x, labels = _bert_data()
    namespace = {"keras": keras, "thor_tf": thor_tf, "np": np, "tokens": x["token_ids"],
                 "segments": x["segment_ids"], "mask": x["padding_mask"], "labels": labels}
    exec(compile(_usage_recipe("keras_hub_bert"), "docs/usage.md recipe keras_hub_bert", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model.thor_optimizer, thor_tf.ThorOptimizer)
    refreshes = _refreshes(model)
    assert {n for n in BERT_BLOCKS if refreshes.get(n, 0) < 1} == set()
