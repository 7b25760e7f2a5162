"""Keras integration: wrap() contract, one trace, save/load, robustness, end-to-end training."""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from digits_models import digits, small_cnn
from reference import conv_patches, dense_kfac_steps, homogeneous, mean_outer

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")




def _functional_nested(seed=0):
    keras.utils.set_random_seed(seed)
    inner = keras.Sequential([keras.Input((16,)), keras.layers.Dense(12, activation="tanh", name="inner_fc")],
                             name="inner")
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, strides=2, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu", name="fc")(h)
    h = inner(h)
    out = keras.layers.Dense(10, activation="softmax", name="out")(h)
    return keras.Model(inp, out)


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(6, 3, padding="same", activation="relu")
        self.flat = keras.layers.Flatten()
        self.fc = keras.layers.Dense(10, activation="softmax")

    def call(self, x):
        return self.fc(self.flat(self.conv(x)))


def _subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    m = SubclassedNet()
    m(np.zeros((1, 8, 8, 1), "float32"))
    return m


@pytest.mark.parametrize("factory,blocks", [(small_cnn, 3), (_functional_nested, 4), (_subclassed, 2)])
def test_wrap_keeps_predictions_and_registers_layers(factory, blocks, capsys):
    x, y = digits(64)
    model = factory()
    before = model.predict(x, verbose=0)
    wrapped = thor_tf.wrap(model)
    table = capsys.readouterr().out
    assert "Kronecker blocks" in table and "first order" in table
    np.testing.assert_array_equal(wrapped.predict(x, verbose=0), before)
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    assert len(wrapped.thor.blocks) == blocks
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = wrapped.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    stats = wrapped.thor.layer_stats()
    assert len(stats) == blocks
    for row in stats:
        assert {"name", "kind", "a_dim", "g_dim", "split_a", "split_g", "refreshes",
                "last_refresh_step"} <= set(row)
        assert row["refreshes"] >= 1 and row["last_refresh_step"] >= 0


def test_batchnorm_is_listed_first_order(capsys):
    thor_tf.wrap(_functional_nested())
    out = capsys.readouterr().out
    assert "first order: bn (BatchNormalization: normalization, first order by design)" in out


def _count_traces(model):
    """A list that gets an entry per call of ``model.train_step``: Keras calls it only while
    tracing its train function, so its length is the number of traces."""
    traces = []
    original = model.train_step

    def counting(data):
        traces.append(1)
        return original(data)

    model.train_step = counting
    return traces


def test_train_step_traced_once_over_many_steps():
    x, y = digits(64 * 15)
    wrapped = thor_tf.wrap(small_cnn(), frequency=3, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    traces = _count_traces(wrapped)
    wrapped.fit(x, y, epochs=4, batch_size=64, verbose=0)  # 60 steps, decisions change
    assert wrapped.optimizer.iterations.numpy() == 60
    assert len(traces) == 1
    stats = wrapped.thor.layer_stats()
    assert sum(s["refreshes"] for s in stats) > len(stats)  # refreshes happened after step 0


@pytest.mark.parametrize("entry", ["fit", "train_on_batch"])
def test_train_step_traced_once_with_compiled_metrics(entry):
    # Keras builds compiled metrics in the first trace of the train function when there is no
    # strategy; a tf.function whose first trace creates variables is traced again, so THOR's
    # step was traced twice (the digits main job: 1.5-2 s of its first epoch). ThorModel builds
    # them before the first trace. A partial last batch (100 = 64 + 36) must not retrace either.
    x, y = digits(100)
    wrapped = thor_tf.wrap(small_cnn(), verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    traces = _count_traces(wrapped)
    if entry == "fit":
        history = wrapped.fit(x, y, epochs=2, batch_size=64, verbose=0)
        assert wrapped.optimizer.iterations.numpy() == 4
        assert 0.0 < history.history["accuracy"][-1] <= 1.0
    else:
        for _ in range(3):
            logs = wrapped.train_on_batch(x[:64], y[:64], return_dict=True)
        assert wrapped.optimizer.iterations.numpy() == 3
        assert 0.0 < logs["accuracy"] <= 1.0
    assert len(traces) == 1


def test_train_step_traced_once_with_a_loss_per_output():
    # Two outputs, one loss each: Keras' compiled loss makes a Mean tracker per loss (variables)
    # when it is built, which ThorModel does before the first trace, as for metrics.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3, name="a")(hidden),
                                 keras.layers.Dense(2, name="b")(hidden)])
    wrapped = thor_tf.wrap(model, verbose=False)
    wrapped.compile(loss=["mse", "mae"])
    traces = _count_traces(wrapped)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    history = wrapped.fit(x, [rng.normal(size=(40, 3)), rng.normal(size=(40, 2))], batch_size=16,
                          epochs=2, verbose=0)
    assert wrapped.optimizer.iterations.numpy() == 6
    assert len(traces) == 1
    assert {"a_loss", "b_loss"} <= set(history.history)


def test_thor_trains_digits_faster_than_sgd_momentum():
    x, y = digits()
    losses = {}
    for name in ("thor", "sgd"):
        model = small_cnn(seed=1)
        if name == "thor":
            model = thor_tf.wrap(model, learning_rate=0.02, momentum=0.9, damping=0.03, verbose=False)
            model.compile(loss="sparse_categorical_crossentropy")
        else:
            model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
                          loss="sparse_categorical_crossentropy")
        keras.utils.set_random_seed(2)
        model.fit(x, y, epochs=3, batch_size=64, verbose=0, shuffle=True)
        losses[name] = model.evaluate(x, y, verbose=0)
    assert losses["thor"] < 0.7 * losses["sgd"], losses


@pytest.mark.parametrize("option,value", [
    ("learning_rate", -1.0), ("momentum", 1.5), ("damping", 0.0), ("weight_decay", -0.1),
    ("clip_norm", 0.0), ("frequency", 0), ("frequency", [(1, 10)]), ("preset", "fast"),
    ("omega1", -0.1), ("split_dim", 0), ("split_dim", "/nonexistent/calibration.json"),
    ("fisher", "exact"), ("factor_decay", 1.0), ("clipnorm", 1.0), ("exclude", "fc"),
    ("kl_clip", 0.0), ("trace_filter", "ema"), ("trace_smoothing", 0.9), ("factor_examples", 0),
    ("frequency", "adaptiv"),
])
def test_bad_options_raise_value_error_naming_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        thor_tf.wrap(small_cnn(), verbose=False, **{option: value})


def test_omega2_above_omega1_raises():
    with pytest.raises(ValueError, match="omega2"):
        thor_tf.wrap(small_cnn(), omega1=0.01, omega2=0.1, verbose=False)


def test_unsupported_layer_trains_first_order_with_one_warning():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8)),
        keras.layers.Conv1D(4, 3, groups=2, name="temporal"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax", name="out"),
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = thor_tf.wrap(model, verbose=False)
    messages = [str(w.message) for w in caught if "thor_tf" in str(w.message)]
    assert len(messages) == 1 and "temporal (Conv1D: groups=2)" in messages[0]
    assert [b.name for b in wrapped.thor.blocks] == ["out"]
    x, y = digits(64)
    before = model.get_layer("temporal").kernel.numpy().copy()
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x[..., 0], y, epochs=1, batch_size=32, verbose=0)
    assert not np.allclose(model.get_layer("temporal").kernel.numpy(), before)


def _snapshot(wrapped):
    opt = wrapped.optimizer
    return [v.numpy().copy() for v in wrapped.trainable_variables] + [v.numpy().copy() for v in opt.variables
                                                                      if "iteration" not in v.name and "nonfinite" not in v.name]


@pytest.mark.parametrize("poison", ["input", "loss"])
def test_non_finite_batch_changes_nothing_and_training_goes_on(poison):
    x, y = digits(96)
    wrapped = thor_tf.wrap(small_cnn(), frequency=1, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x[:32], y[:32])
    wrapped.train_on_batch(x[32:64], y[32:64])
    before = _snapshot(wrapped)
    bad_x = x[64:].copy()
    if poison == "input":
        bad_x[3, 2, 2, 0] = np.nan
    else:
        bad_x[5] = np.inf
    wrapped.train_on_batch(bad_x, y[64:])
    after = _snapshot(wrapped)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert wrapped.thor.counters()["nonfinite_steps"] == 1
    loss = wrapped.train_on_batch(x[64:], y[64:])
    assert np.isfinite(loss)
    assert wrapped.thor.counters()["nonfinite_steps"] == 1
    for name in ("conv", "fc", "out"):
        for value in list(wrapped.thor.factors(name).values()) + list(wrapped.thor.inverses(name).values()):
            assert np.all(np.isfinite(value))


def test_save_and_load_keep_the_whole_optimizer_state(tmp_path):
    x, y = digits(128)
    wrapped = thor_tf.wrap(small_cnn(), learning_rate=0.03, frequency=2, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    wrapped.fit(x, y, epochs=1, batch_size=32, verbose=0)
    path = os.path.join(tmp_path, "thor.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, thor_tf.ThorModel)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0), atol=1e-6)
    assert loaded.optimizer.get_config()["learning_rate"] == pytest.approx(0.03)
    for a, b in zip(wrapped.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(loaded.thor.factors("fc")["A"], wrapped.thor.factors("fc")["A"])
    # Both continue identically from the restored state.
    wrapped.train_on_batch(x[:32], y[:32])
    loaded.train_on_batch(x[:32], y[:32])
    np.testing.assert_allclose(loaded.get_layer(index=0).get_layer("fc").kernel.numpy(),
                               wrapped.model.get_layer("fc").kernel.numpy(), rtol=1e-5, atol=1e-6)


def test_user_model_still_saves_and_loads_after_wrap(tmp_path):
    model = small_cnn()
    thor_tf.wrap(model, verbose=False)
    path = os.path.join(tmp_path, "plain.keras")
    model.save(path)
    x, _ = digits(16)
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0),
                               model.predict(x, verbose=0), atol=1e-6)


def test_tf_train_checkpoint_restores_optimizer_state(tmp_path):
    x, y = digits(64)
    wrapped = thor_tf.wrap(small_cnn(), preset="thor_nt", frequency=1, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x, y, epochs=1, batch_size=32, verbose=0)
    ckpt = tf.train.Checkpoint(model=wrapped, optimizer=wrapped.optimizer)
    path = ckpt.save(os.path.join(tmp_path, "ckpt"))
    saved_a = wrapped.thor.factors("fc")["A"].copy()
    saved_momentum = [v.numpy().copy() for v in wrapped.optimizer.variables]
    wrapped.fit(x, y, epochs=1, batch_size=32, verbose=0)
    assert not np.array_equal(saved_a, wrapped.thor.factors("fc")["A"])
    ckpt.restore(path)
    np.testing.assert_array_equal(saved_a, wrapped.thor.factors("fc")["A"])
    for saved, v in zip(saved_momentum, wrapped.optimizer.variables):
        np.testing.assert_array_equal(saved, v.numpy())


def test_fit_with_validation_sample_weights_and_callbacks():
    x, y = digits(256)
    wrapped = thor_tf.wrap(small_cnn(), verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    seen = []
    cb = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(logs["val_accuracy"]))
    weights = np.where(y % 2 == 0, 2.0, 0.5).astype("float32")
    wrapped.fit(x, y, sample_weight=weights, validation_data=(x[:64], y[:64]), epochs=2,
                batch_size=32, callbacks=[cb], verbose=0)
    assert len(seen) == 2 and all(np.isfinite(seen))
    loss, acc = wrapped.evaluate(x, y, verbose=0)
    assert np.isfinite(loss) and 0 <= acc <= 1


def test_sample_weights_reach_the_step_and_g():
    """One step (lr 1, momentum 0) with sample weights w_n: Keras' loss is Σ w_n ℓ_n / N, so the
    per-example gradient behind G is w_n (p_n − y_n): the float64 K-FAC step of that."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.integers(0, 3, 16)
    weights = rng.uniform(0.2, 3.0, 16).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    wrapped = thor_tf.wrap(model, learning_rate=1.0, momentum=0.0, kl_clip=None, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y, sample_weight=weights)
    logits = x.astype(np.float64) @ kernel + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    (delta, _), = dense_kfac_steps([x], [weights[:, None] * (p - np.eye(3)[y])], 0.03)
    moved = np.concatenate([kernel - model.layers[0].kernel.numpy(),
                            (bias - model.layers[0].bias.numpy())[None]])
    np.testing.assert_allclose(moved, delta, rtol=2e-4, atol=2e-5 * np.abs(delta).max())


def test_other_optimizer_trains_like_plain_keras():
    x, y = digits(64)
    wrapped = thor_tf.wrap(small_cnn(), verbose=False)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                    loss="sparse_categorical_crossentropy")
    history = wrapped.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert not isinstance(wrapped.optimizer, thor_tf.ThorOptimizer)
    # The same weights, batches and optimizer in plain Keras: the same steps (the hooks observe
    # nothing THOR uses; float32 rounding of the two graphs may differ in the last bits).
    plain = small_cnn()
    plain.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    expected = plain.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    for a, b in zip(wrapped.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sampled_fisher_trains_and_refreshes():
    x, y = digits(256)
    wrapped = thor_tf.wrap(small_cnn(), fisher="sampled", preset="thor_nt", frequency=2, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    first = wrapped.evaluate(x, y, verbose=0)
    wrapped.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert wrapped.evaluate(x, y, verbose=0) < first
    assert all(s["refreshes"] == 8 for s in wrapped.thor.layer_stats())  # 16 steps / 2


def test_sampled_fisher_g_is_the_model_fisher_in_expectation():
    """fisher="sampled": the output layer's G is the mean of g gᵀ with g = p − e_y, y drawn from
    the model's p, whose expectation is diag(p) − p pᵀ (one term per label, by hand), not the
    empirical Fisher of the data's labels. Checked within 5 standard errors of the sampling
    (also by hand: the variance of g gᵀ over the 3 labels of each example), on a batch large
    enough that the empirical Fisher lies beyond 20 of them."""
    n = 2048
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = np.zeros(n, "int64")  # every label 0: far from the model's p
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax",
                                                                    name="out")])
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    wrapped = thor_tf.wrap(model, fisher="sampled", learning_rate=1e-6, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.train_on_batch(x, y)
    got = wrapped.thor.factors("out")["G"]
    logits = x.astype(np.float64) @ kernel + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    outer = lambda label: np.einsum("ni,nj->nij", p - np.eye(3)[label], p - np.eye(3)[label])
    terms = [outer(np.full(n, k)) for k in range(3)]  # g gᵀ for each possible label
    mean = sum(p[:, k, None, None] * terms[k] for k in range(3))  # per example: diag(p) − ppᵀ
    np.testing.assert_allclose(mean, np.einsum("ni,ij->nij", p, np.eye(3))
                               - np.einsum("ni,nj->nij", p, p), atol=1e-12)
    variance = sum(p[:, k, None, None] * (terms[k] - mean) ** 2 for k in range(3))
    expected, stderr = mean.mean(0), np.sqrt(variance.sum(0)) / n
    assert np.all(np.abs(got - expected) < 5 * stderr + 1e-6), (got, expected, stderr)
    empirical = outer(y).mean(0)
    assert np.abs(empirical - expected).max() > 20 * stderr.max()


def test_sampled_fisher_rejects_unknown_loss():
    wrapped = thor_tf.wrap(small_cnn(), fisher="sampled", verbose=False)
    with pytest.raises(ValueError, match="fisher='sampled'"):
        wrapped.compile(loss="hinge")


def test_factor_decay_is_seeded_by_the_first_batch():
    x, y = digits(64)
    decayed = thor_tf.wrap(small_cnn(), factor_decay=0.9, learning_rate=1e-6, verbose=False)
    decayed.compile(loss="sparse_categorical_crossentropy")
    plain = thor_tf.wrap(small_cnn(), factor_decay=0.0, learning_rate=1e-6, verbose=False)
    plain.compile(loss="sparse_categorical_crossentropy")
    decayed.train_on_batch(x[:32], y[:32])
    plain.train_on_batch(x[:32], y[:32])
    first = decayed.thor.factors("fc")["A"].copy()
    np.testing.assert_allclose(first, plain.thor.factors("fc")["A"], rtol=1e-6)
    # Next cadence point: β·old + (1−β)·new.
    decayed.optimizer.engine.state.next_cadence.assign(1)
    plain.optimizer.engine.state.next_cadence.assign(1)
    decayed.train_on_batch(x[32:], y[32:])
    plain.train_on_batch(x[32:], y[32:])
    np.testing.assert_allclose(decayed.thor.factors("fc")["A"],
                               0.9 * first + 0.1 * plain.thor.factors("fc")["A"], rtol=1e-4, atol=1e-6)


def test_mixed_precision_keeps_factors_float32():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = digits(64)
        wrapped = thor_tf.wrap(small_cnn(), verbose=False)
        wrapped.compile(loss="sparse_categorical_crossentropy")
        wrapped.train_on_batch(x[:32], y[:32])  # step 0: every block refreshes from this batch
        wrapped.train_on_batch(x[32:], y[32:])
        factors = wrapped.thor.factors("fc")
        assert factors["A"].dtype == np.float32 and np.all(np.isfinite(factors["A"]))
        conv_a = wrapped.thor.factors("conv")["A"]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # The digits are k/16, exact in bfloat16: the conv's A from its 3x3 patches (bias folded),
    # accumulated in float32, is exact to float32 precision (in bfloat16, k1·k2/256 alone would
    # round: 8 significant bits).
    patches = conv_patches(x[:32].astype(np.float64), (3, 3), (1, 1), "same", (1, 1))
    expected = mean_outer(homogeneous(patches.reshape(-1, 9), True))
    assert conv_a.dtype == np.float32
    np.testing.assert_allclose(conv_a, expected, rtol=1e-6, atol=1e-7)


def test_fit_warns_on_skipped_steps_and_stops_when_an_epoch_is_all_non_finite():
    x, y = digits(128)
    wrapped = thor_tf.wrap(small_cnn(), verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    some_bad = x.copy()
    some_bad[:32] = np.nan  # first of four batches
    with pytest.warns(UserWarning, match="1 of 4 steps in epoch 1"):
        wrapped.fit(some_bad, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    all_bad = np.full_like(x, np.nan)
    with pytest.warns(UserWarning, match="stopping training"):
        history = wrapped.fit(all_bad, y, batch_size=32, epochs=5, verbose=0)
    assert len(history.history["loss"]) == 1


def test_wrapping_twice_raises_and_detach_restores_the_layers():
    model = small_cnn()
    wrapped = thor_tf.wrap(model, verbose=False)
    with pytest.raises(ValueError, match="already wrapped"):
        thor_tf.wrap(model, verbose=False)
    wrapped.thor.detach()
    assert "call" not in model.get_layer("fc").__dict__
    rewrapped = thor_tf.wrap(model, verbose=False, learning_rate=0.01)
    assert len(rewrapped.thor.blocks) == 3


def test_save_and_load_with_schedules_and_frequency_pairs(tmp_path):
    from thor_tf.schedules import ThorDampingDecay, ThorPolynomialDecay

    x, y = digits(64)
    wrapped = thor_tf.wrap(small_cnn(), learning_rate=ThorPolynomialDecay(0.05, 10, 4.0, 2),
                           damping=ThorDampingDecay(0.03, 0.5, 2), frequency=[(0, 2), (3, 5)],
                           verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "sched.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer.damping, ThorDampingDecay)
    assert loaded.optimizer.cadence.get_config() == [[0, 2], [3, 5]]
    assert float(loaded.optimizer.learning_rate) == pytest.approx(float(wrapped.optimizer.learning_rate))
    assert float(loaded.optimizer.current_damping()) == pytest.approx(float(wrapped.optimizer.current_damping()))


class ReturnsItsLoss(keras.Model):
    """A train_step as in keras-io's "customizing what happens in fit" that returns the batch's
    loss and a value of its own under the names of the compiled loss and metric, updating neither
    (so they are not what an epoch's log should come from)."""

    with_metric = False  # also return a value named as the compiled metric

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        logs = {"loss": loss}
        if self.with_metric:
            logs["accuracy"] = tf.constant(0.625)
        return logs


@pytest.mark.parametrize("with_metric", [False, True])
@pytest.mark.parametrize("rule", ["eigenbasis", "inverse"])
def test_own_train_step_logs_what_it_returns(rule, with_metric):
    """History holds what the model's own train_step returned at each epoch's last step (Keras
    would log its never-updated loss tracker, 0.0, or fail on the unbuilt compiled metric), and
    validation logs what Keras' test step computes."""
    x, y = digits(96)
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Dense(16, activation="relu", name="fc")(keras.layers.Flatten()(inp))
    model = ReturnsItsLoss(inp, keras.layers.Dense(10, activation="softmax", name="out")(h))
    model.with_metric = with_metric
    # lr 1e-12: the weights stay (to float32), so the last batch's loss is a plain-Keras twin's.
    wrapped = thor_tf.wrap(model, update_rule=rule, learning_rate=1e-12, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"] if with_metric else None)
    twin = keras.Model(inp, model.outputs)
    twin.compile(loss="sparse_categorical_crossentropy")

    class LastBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.logs = dict(logs)

    last = LastBatch()
    history = wrapped.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                          validation_data=(x[:32], y[:32]), callbacks=[last])
    batch_loss = twin.evaluate(x[64:], y[64:], batch_size=32, verbose=0)
    assert batch_loss > 0.1
    np.testing.assert_allclose(history.history["loss"], [batch_loss] * 2, rtol=1e-5)
    np.testing.assert_allclose(history.history["loss"][-1], last.logs["loss"], rtol=1e-6)
    if with_metric:
        assert history.history["accuracy"] == [0.625, 0.625]
    np.testing.assert_allclose(history.history["val_loss"][-1],
                               twin.evaluate(x[:32], y[:32], verbose=0), rtol=1e-5)
