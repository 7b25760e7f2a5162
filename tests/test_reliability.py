"""Nothing silently wrong on the paths users take after the first fit (issue 8).

Each test reproduces one way the engine used to give a wrong result without a word, and checks the
behaviour against a reference computed independently of the code under test: a float64 NumPy
computation from explicit per-example quantities, or the same model trained without the
disturbance (no loss scale, no bad batch, no interruption, features precomputed).
"""

import os

import keras
import numpy as np
import pytest

import thor_tf
from digits_models import digits, small_cnn
from reference import softmax_dense_kfac_step, homogeneous, mean_outer, softmax

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")

LOSS = "sparse_categorical_crossentropy"


def _weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def _one_layer(d, k, seed=10):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(k, activation="softmax", name="out")])


# -- 1. the KL clip and the whole step are invariant to loss_scale_factor ------------------------
def test_kl_clip_and_step_do_not_depend_on_loss_scale_factor():
    """One step with loss_scale_factor=1024 equals the float64 reference lr·ν·Δ (ν from unscaled
    gradients); a whole run ends with the weights of the same run without a scale."""
    rng = np.random.default_rng(9)
    n, d, k, lam, lr, kappa = 32, 12, 5, 0.1, 0.3, 1e-4
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, k, size=n)
    model = _one_layer(d, k)
    layer = model.get_layer("out")
    w0 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0).astype(np.float64)
    delta, nu = softmax_dense_kfac_step(x, y, w0, lam, lr, kappa)
    wrapped = thor_tf.wrap(model, learning_rate=lr, momentum=0.0, damping=lam, kl_clip=kappa,
                           loss_scale_factor=1024.0, verbose=False)
    wrapped.compile(loss=LOSS)
    wrapped.train_on_batch(x, y)
    w1 = np.concatenate([layer.kernel.numpy(), layer.bias.numpy()[None]], 0)
    assert wrapped.thor.counters()["kl_scale"] == pytest.approx(nu, rel=1e-3)
    np.testing.assert_allclose(w0 - w1, lr * nu * delta, rtol=2e-3, atol=1e-6)

    x, y = digits(256)
    finals = []
    for scale in (None, 1024.0):
        options = {} if scale is None else {"loss_scale_factor": scale}
        run = thor_tf.wrap(small_cnn(0), frequency=3, verbose=False, **options)
        run.compile(loss=LOSS)
        run.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        finals.append((_weights(run), run.thor.counters()["kl_scale"]))
    start = _weights(small_cnn(0))
    moved = np.abs(finals[0][0] - start).max()
    assert np.abs(finals[0][0] - finals[1][0]).max() < 1e-4 * moved
    assert finals[1][1] == pytest.approx(finals[0][1], rel=1e-4)


# -- 2. mixed precision: dynamic loss scaling inside Keras' LossScaleOptimizer -------------------
def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((7,)),
        keras.layers.Dense(5, activation="relu", name="hidden"),
        keras.layers.Dense(4, name="logits"),
        keras.layers.Activation("softmax", dtype="float32", name="probs"),
    ])


@pytest.fixture
def policy():
    def use(name):
        keras.mixed_precision.set_global_policy(name)
    yield use
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_float16_factors_equal_the_float64_reference(policy):
    policy("mixed_float16")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 7)).astype("float32")
    y = rng.integers(0, 4, size=16)
    model = _mlp()
    w1, b1, w2, b2 = (v.numpy().astype(np.float64) for v in model.weights)
    x64 = x.astype(np.float64)
    z1 = x64 @ w1 + b1
    a1 = np.maximum(z1, 0)
    g2 = softmax(a1 @ w2 + b2) - np.eye(4)[y]        # dℓ_n/dz of the logits, per example
    g1 = (g2 @ w2.T) * (z1 > 0)
    wrapped = thor_tf.wrap(model, learning_rate=1e-3, verbose=False)
    wrapped.compile(loss=LOSS)
    assert isinstance(wrapped.optimizer, keras.optimizers.LossScaleOptimizer)
    assert wrapped.thor_optimizer is wrapped.optimizer.inner_optimizer
    wrapped.train_on_batch(x, y)
    # The float16 forward and backward round each layer's values (unit roundoff u = 2^-11 ≈
    # 4.9e-4): against float64 the factors agree to a few u of their largest entry (measured
    # ≤ 5e-4). The first layer's A sees only the rounding of x: from the float16 inputs,
    # accumulated in float32, it is exact to float32 precision.
    x16 = x.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(wrapped.thor.factors("hidden")["A"],
                               mean_outer(homogeneous(x16, True)), rtol=1e-5, atol=1e-6)
    for name, ref_a, ref_g in (("hidden", mean_outer(homogeneous(x64, True)), mean_outer(g1)),
                               ("logits", mean_outer(homogeneous(a1, True)), mean_outer(g2))):
        got = wrapped.thor.factors(name)
        assert got["A"].dtype == np.float32 and got["G"].dtype == np.float32
        for key, ref in (("A", ref_a), ("G", ref_g)):
            np.testing.assert_allclose(got[key], ref, rtol=0, atol=2e-3 * np.abs(ref).max(),
                                       err_msg=f"{name} {key}")
    assert int(wrapped.optimizer.iterations) == 1


def test_mixed_float16_overflowing_step_changes_no_thor_state_and_halves_the_scale(policy):
    policy("mixed_float16")
    x, y = digits(64)
    wrapped = thor_tf.wrap(small_cnn(), frequency=1, verbose=False)
    scaler = keras.optimizers.LossScaleOptimizer(thor_tf.ThorOptimizer(frequency=1), initial_scale=1e30)
    wrapped.compile(optimizer=scaler, loss=LOSS)
    wrapped.fit(x, y, batch_size=64, epochs=1, verbose=0)  # builds; the first step overflows
    assert float(scaler.dynamic_scale) == pytest.approx(0.5e30)
    assert int(scaler.iterations) == 0 and wrapped.thor.counters()["cadence_points"] == 0
    for name in ("conv", "fc", "out"):
        np.testing.assert_array_equal(wrapped.thor.factors(name)["A"], 0.0)  # never refreshed
    before = [v.numpy().copy() for v in wrapped.trainable_variables]
    wrapped.train_on_batch(x, y)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, wrapped.trainable_variables))
    assert float(scaler.dynamic_scale) == pytest.approx(0.25e30)
    scaler.dynamic_scale.assign(2.0 ** 10)  # a scale fp16 can carry: THOR steps again
    wrapped.train_on_batch(x, y)
    assert int(scaler.iterations) == 1 and wrapped.thor.counters()["cadence_points"] == 1
    assert int(scaler.step_counter) == 1


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_to_the_float32_accuracy(policy, name):
    x, y = digits()
    xt, yt, xv, yv = x[:1400], y[:1400], x[1400:], y[1400:]
    accuracy = {}
    for run in ("float32", name):
        policy(run)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu", name="conv"),
            keras.layers.Flatten(), keras.layers.Dense(32, activation="relu", name="fc"),
            keras.layers.Dense(10, name="logits"),
            keras.layers.Activation("softmax", dtype="float32")])
        wrapped = thor_tf.wrap(model, learning_rate=0.02, verbose=False)
        wrapped.compile(loss=LOSS, metrics=["accuracy"])
        wrapped.fit(xt, yt, batch_size=64, epochs=3, verbose=0)
        accuracy[run] = wrapped.evaluate(xv, yv, verbose=0)[1]
    assert accuracy["float32"] > 0.85
    assert accuracy[name] > accuracy["float32"] - 0.03, accuracy


# -- 3 + 6. a skipped batch changes nothing: moving statistics, iterations, loss and metrics -----
def _bn_model(seed=0, dropout=True):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu")(h)
    if dropout:
        h = keras.layers.Dropout(0.2)(h)
    h = keras.layers.Flatten()(h)
    out = keras.layers.Dense(10, activation="softmax", name="out")(h)
    return keras.Model(inp, out)


def test_skipped_batch_is_as_if_it_never_came():
    """Batches b1, NaN, b2, ... against b1, b2, ...: same weights, moving statistics, dropout RNG,
    iterations, lr schedule position, factors, History loss and metrics."""
    from thor_tf.schedules import ThorPolynomialDecay

    x, y = digits(192)
    bad = np.full_like(x[:32], np.nan)
    poisoned_x = np.concatenate([x[:32], bad, x[32:]])
    poisoned_y = np.concatenate([y[:32], y[:32], y[32:]])
    runs = {}
    for label, (xs, ys) in {"clean": (x, y), "poisoned": (poisoned_x, poisoned_y)}.items():
        wrapped = thor_tf.wrap(_bn_model(), frequency=2, verbose=False,
                               learning_rate=ThorPolynomialDecay(0.05, 4, 2.0, 6))
        wrapped.compile(loss=LOSS, metrics=["accuracy"])
        with pytest.warns(UserWarning) if label == "poisoned" else _no_warning():
            history = wrapped.fit(xs, ys, batch_size=32, epochs=2, shuffle=False, verbose=0,
                                  callbacks=[keras.callbacks.TerminateOnNaN()])
        runs[label] = (wrapped, history.history)
    clean, poisoned = runs["clean"][0], runs["poisoned"][0]
    assert len(runs["poisoned"][1]["loss"]) == 2  # TerminateOnNaN did not stop the run
    np.testing.assert_allclose(runs["poisoned"][1]["loss"], runs["clean"][1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(runs["poisoned"][1]["accuracy"], runs["clean"][1]["accuracy"], rtol=1e-6)
    assert int(poisoned.optimizer.iterations) == int(clean.optimizer.iterations) == 12
    assert poisoned.thor.counters()["nonfinite_steps"] == 2
    np.testing.assert_allclose(_weights(poisoned), _weights(clean), rtol=1e-5, atol=1e-6)
    bn = poisoned.model.get_layer("bn")
    assert np.all(np.isfinite(bn.moving_mean.numpy())) and np.all(np.isfinite(bn.moving_variance.numpy()))
    np.testing.assert_allclose(poisoned.evaluate(x, y, verbose=0), clean.evaluate(x, y, verbose=0),
                               rtol=1e-5)
    np.testing.assert_allclose(poisoned.thor.factors("out")["A"], clean.thor.factors("out")["A"],
                               rtol=1e-5, atol=1e-7)


class _no_warning:
    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        return False


# -- 5. freezing layers after wrap: transfer learning in two compiles ----------------------------
def test_freeze_after_wrap_trains_the_head_exactly_then_fine_tunes(capsys):
    """Phase 1 (base frozen) equals THOR on a head-only model fed the base's features; phase 2
    (unfrozen, compiled again) has blocks for every layer and moves the base."""
    x, y = digits(256)
    base_model = small_cnn(0)
    wrapped = thor_tf.wrap(base_model, frequency=2, verbose=True)
    capsys.readouterr()
    conv = base_model.get_layer("conv")
    conv.trainable = False
    wrapped.compile(loss=LOSS)
    table = capsys.readouterr().out
    assert "2 layers with Kronecker blocks" in table and "not trained by this optimizer: conv" in table
    frozen_before = [w.copy() for w in conv.get_weights()]

    features = keras.Sequential(base_model.layers[:2])(x).numpy()  # conv + flatten, inference
    keras.utils.set_random_seed(1)
    head = keras.Sequential([keras.Input(features.shape[1:]),
                             keras.layers.Dense(32, activation="relu", name="fc"),
                             keras.layers.Dense(10, activation="softmax", name="out")])
    head.set_weights([w.copy() for w in base_model.get_layer("fc").get_weights()]
                     + [w.copy() for w in base_model.get_layer("out").get_weights()])
    head_thor = thor_tf.wrap(head, frequency=2, verbose=False)
    head_thor.compile(loss=LOSS)

    wrapped.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    head_thor.fit(features, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(conv.get_weights(), frozen_before):
        np.testing.assert_array_equal(a, b)
    for name in ("fc", "out"):
        for a, b in zip(base_model.get_layer(name).get_weights(), head.get_layer(name).get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert [s["name"] for s in wrapped.thor.layer_stats()] == ["fc", "out"]

    conv.trainable = True
    wrapped.compile(loss=LOSS)
    assert "3 layers with Kronecker blocks" in capsys.readouterr().out
    wrapped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert not np.array_equal(conv.get_weights()[0], frozen_before[0])
    assert [s["refreshes"] > 0 for s in wrapped.thor.layer_stats()] == [True] * 3


# -- 7. layer_stats reports the splits each layer's factors use ------------------------------------
#: small_cnn's factor dimensions, from its layers (not from thor_tf): A is the layer's fan-in plus 1
#: for the bias (the bias row folded in), G its units or filters.
SMALL_CNN_DIMS = {"conv": (3 * 3 * 1 + 1, 8), "fc": (8 * 8 * 8 + 1, 32), "out": (32 + 1, 10)}


def _splits(wrapped):
    return {s["name"]: (s["split_a"], s["split_g"]) for s in wrapped.thor.layer_stats()}


def test_layer_stats_report_the_splits_each_factor_uses(tmp_path):
    """``split_a``/``split_g`` are the diagonal block sizes A and G are kept in (the dimension where
    it is not split, 1 where only the diagonal is kept), from ``wrap`` on and the same once the
    state exists; the plan itself stays in the options."""
    x, y = digits(32)
    wrapped = thor_tf.wrap(small_cnn(), split_dim=16, verbose=False)
    assert {s["name"]: (s["a_dim"], s["g_dim"])
            for s in wrapped.thor.layer_stats()} == SMALL_CNN_DIMS
    assert _splits(wrapped) == {"conv": (10, 8), "fc": (16, 16), "out": (16, 10)}
    path = os.path.join(tmp_path, "calibration.json")
    with open(path, "w") as fh:
        fh.write('{"split_dim": 32}')
    wrapped = thor_tf.wrap(small_cnn(), split_dim=path, verbose=False)
    assert _splits(wrapped) == {"conv": (10, 8), "fc": (32, 32), "out": (32, 10)}
    # A plan: dimension 10 (the conv's A, the output's G) by its entry, 32 (fc's G) kept as its
    # diagonal by its entry, fc's A (513) over diagonal_above, the others at the default.
    plan = thor_tf.SplitPlan(12, by_dim={10: 4, 32: 1}, diagonal_above=500)
    wrapped = thor_tf.wrap(small_cnn(), split_dim=plan, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    expected = {"conv": (4, 8), "fc": (1, 1), "out": (12, 4)}
    assert _splits(wrapped) == expected
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert _splits(wrapped) == expected  # read from the state now
    assert wrapped.thor_optimizer.config.split_dim == plan


def test_layer_stats_report_the_splits_auto_chose():
    """Under ``split_dim="auto"`` the splits are None until ``fit`` calibrates, then those of
    the plan it chose, each factor's dimension computed here from the layers."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 4, 64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh",
                                                                     name="hidden"),
                              keras.layers.Dense(4, use_bias=False, name="out")])
    dims = {"hidden": (12 + 1, 24), "out": (24, 4)}
    wrapped = thor_tf.wrap(model, split_dim="auto", verbose=False, learning_rate=0.01)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert _splits(wrapped) == {"hidden": (None, None), "out": (None, None)}
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    plan = wrapped.thor_optimizer.config.split_dim
    assert isinstance(plan, thor_tf.SplitPlan)
    assert _splits(wrapped) == {name: tuple(min(plan.size(d), d) for d in dims[name])
                                for name in dims}


# -- 8. BackupAndRestore: an interrupted run continues the uninterrupted trajectory -------------
class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses, self.epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(((self.epoch, batch), logs["loss"]))


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("preempted")


def _thor_state(wrapped):
    return ([v.numpy().copy() for v in wrapped.optimizer.variables],
            wrapped.thor.layer_stats(), wrapped.thor.counters())


def test_backup_and_restore_resumes_the_original_trajectory(tmp_path):
    x, y = digits(320)

    def make():
        # No Dropout here: Keras' BackupAndRestore does not resume Dropout's random stream (plain
        # SGD leaves its trajectory the same way); BatchNormalization's statistics are resumed.
        wrapped = thor_tf.wrap(_bn_model(dropout=False), frequency=3, verbose=False)
        wrapped.compile(loss=LOSS, metrics=["accuracy"])
        return wrapped

    fit = dict(batch_size=32, epochs=3, shuffle=False, verbose=0)
    reference, ref_losses = make(), _BatchLosses()
    reference.fit(x, y, callbacks=[ref_losses], **fit)

    backup = os.path.join(tmp_path, "backup")
    interrupted = make()
    with pytest.raises(RuntimeError, match="preempted"):
        interrupted.fit(x, y, callbacks=[_Interrupt(1, 4),
                                         keras.callbacks.BackupAndRestore(backup)], **fit)
    resumed, losses = make(), _BatchLosses()
    resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(backup), losses], **fit)

    assert losses.losses[0][0] == (1, 0) and len(losses.losses) == 20  # epochs 1 and 2 again
    expected = dict(ref_losses.losses)
    for key, value in losses.losses:
        assert value == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    np.testing.assert_allclose(_weights(resumed), _weights(reference), rtol=1e-6, atol=1e-7)
    variables, stats, counters = _thor_state(resumed)
    ref_variables, ref_stats, ref_counters = _thor_state(reference)
    assert counters == ref_counters and len(variables) == len(ref_variables)
    for a, b in zip(variables, ref_variables):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert _comparable(stats) == _comparable(ref_stats)


def test_backup_with_a_step_frequency_restores_the_whole_thor_state(tmp_path):
    """With ``save_freq=k`` the backup holds THOR's whole state as of its last save."""
    x, y = digits(256)
    backup = os.path.join(tmp_path, "backup")
    saved = {}

    class SnapshotBackup(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            super()._save_model()
            saved["state"] = _thor_state(self.model)
            saved["weights"] = _weights(self.model)

    wrapped = thor_tf.wrap(small_cnn(), frequency=2, verbose=False)
    wrapped.compile(loss=LOSS)
    with pytest.raises(RuntimeError):
        wrapped.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                    callbacks=[SnapshotBackup(backup, save_freq=5), _Interrupt(1, 5)])
    assert int(wrapped.optimizer.iterations) == 14
    assert saved["state"][2]["cadence_points"] > 2
    fresh = thor_tf.wrap(small_cnn(), frequency=2, verbose=False)
    fresh.compile(loss=LOSS)
    restored = {}

    class Capture(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            restored["state"] = _thor_state(self.model)
            restored["weights"] = _weights(self.model)
            self.model.stop_training = True

    fresh.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False), Capture()])
    np.testing.assert_array_equal(restored["weights"], saved["weights"])
    variables, stats, counters = restored["state"]
    assert counters == saved["state"][2]
    assert _comparable(stats) == _comparable(saved["state"][1])
    for a, b in zip(variables, saved["state"][0]):
        np.testing.assert_array_equal(a, b)


def _comparable(stats):
    return [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in row.items()}
            for row in stats]
