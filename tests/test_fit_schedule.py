"""THOR's default learning rate, ``thor_tf.schedules.FitWarmupCosine``: warmup + cosine over the
length that ``fit`` knows, set by ``ThorModel.fit`` in two optimizer variables.

Each test compares against a float64 NumPy reference of warmup + cosine written out below (not the
code under test), and checks that what it asserts would be seen if the property were broken (a
length off by one epoch, the other rule for a second fit, a schedule not restored, a retrace).
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from digits_models import digits, small_cnn
from thor_tf.schedules import FitWarmupCosine, WarmupCosine

LOSS = "sparse_categorical_crossentropy"
EIGENBASIS_PEAK, INVERSE_PEAK = 0.03, 0.05
#: The run length each rule's default peak holds up to (None: every length).
REFERENCE_STEPS = {"eigenbasis": 256, "inverse": None}


def warmup_cosine(steps, total, peak, warmup_fraction=0.05, floor=0.0):
    """float64 rates at 0-based ``steps`` of a run of ``total`` steps: a linear ramp
    ``peak·(s + 1)/W`` over ``W = round(warmup_fraction·total)`` steps (NumPy's round, like
    Python's, takes a tie to the even integer), then half a cosine from ``peak`` to ``floor``
    over the ``total − W`` steps left, ``floor`` after them."""
    s = np.asarray(steps, dtype=np.float64)
    w = float(np.round(warmup_fraction * total))
    ramp = peak * (s + 1.0) / max(w, 1.0)
    progress = np.clip((s - w) / max(total - w, 1.0), 0.0, 1.0)
    cosine = floor + (peak - floor) * 0.5 * (1.0 + np.cos(np.pi * progress))
    return np.where(s < w, ramp, cosine)


class RateLog(keras.callbacks.Callback):
    """The rate each step applies: the optimizer's rate at its ``iterations`` before the step."""

    def __init__(self):
        super().__init__()
        self.rates, self.steps = [], []

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.steps.append(int(optimizer.iterations.numpy()))
        self.rates.append(float(optimizer.learning_rate))


class ScriptedRate(keras.callbacks.Callback):
    """Sets a float learning rate to ``rates[k]`` before the k-th step of the fit: a twin whose
    applied rates are the NumPy reference's (to float32), to compare trained weights with."""

    def __init__(self, rates):
        super().__init__()
        self.rates, self.k = list(rates), 0

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate = float(self.rates[self.k])
        self.k += 1


def _wrapped(**options):
    wrapped = thor_tf.wrap(small_cnn(0), frequency=2, verbose=False, **options)
    wrapped.compile(loss=LOSS)
    return wrapped


def _fit(model, x, y, **kwargs):
    log = RateLog()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[log], **kwargs)
    return log


def _schedule(model):
    return model.thor_optimizer._learning_rate


def _max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


# -- the default, and what an explicit rate keeps --------------------------------------------------
def test_no_learning_rate_gives_the_fit_schedule_at_the_rules_peak_and_explicit_rates_stay():
    for options, peak in (({}, EIGENBASIS_PEAK), ({"update_rule": "inverse"}, INVERSE_PEAK)):
        optimizer = thor_tf.ThorOptimizer(**options)
        schedule = optimizer._learning_rate
        assert type(schedule) is FitWarmupCosine and schedule.peak == peak
        assert schedule.get_config() == {"peak": peak, "warmup_fraction": 0.05, "floor": 0.0,
                                         "reference_steps": REFERENCE_STEPS[options.get(
                                             "update_rule", "eigenbasis")]}
        # Its run length and origin are variables of the optimizer (saved with it); no length yet:
        # the rate is the peak.
        names = [v.name for v in optimizer.variables]
        assert names[:3] == ["iteration", "fit_schedule_total_steps", "fit_schedule_origin"]
        assert schedule.total_steps == 0 and float(optimizer.learning_rate) == pytest.approx(peak)
        model = _wrapped(**options)
        assert type(_schedule(model)) is FitWarmupCosine and _schedule(model).peak == peak
    # Explicit rates: as before (a float is Keras' learning-rate variable, no schedule variables).
    constant = _wrapped(learning_rate=0.02).thor_optimizer
    assert float(constant.learning_rate) == pytest.approx(0.02)
    assert [v.name for v in constant.variables][:2] == ["iteration", "learning_rate"]
    assert not any(v.name.startswith("fit_schedule") for v in constant.variables)
    assert _schedule(_wrapped(learning_rate=WarmupCosine(50))).get_config() == WarmupCosine(
        50, peak=EIGENBASIS_PEAK, reference_steps=256).get_config()
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert thor_tf.ThorOptimizer(learning_rate=decay)._learning_rate is decay
    # One schedule object given to two optimizers: each has its own state.
    shared = FitWarmupCosine(peak=0.03)
    first, second = (thor_tf.ThorOptimizer(learning_rate=shared) for _ in range(2))
    assert first._learning_rate is shared and second._learning_rate is not shared
    assert second._learning_rate.get_config() == shared.get_config()


def test_config_round_trips_of_the_optimizer_and_the_model_and_older_configs():
    optimizer = thor_tf.ThorOptimizer(update_rule="inverse")
    back = thor_tf.ThorOptimizer.from_config(optimizer.get_config())
    assert type(back._learning_rate) is FitWarmupCosine
    assert back._learning_rate.get_config() == optimizer._learning_rate.get_config()
    assert back.get_config() == optimizer.get_config()
    model = thor_tf.wrap(small_cnn(0), verbose=False)
    config = model.get_config()
    assert config["thor_options"]["learning_rate"]["class_name"] == "FitWarmupCosine"
    model_back = thor_tf.ThorModel.from_config(config)
    assert type(model_back._learning_rate) is FitWarmupCosine
    assert model_back.get_config()["thor_options"] == config["thor_options"]
    # Saved before this schedule existed: the default was stored as a float, and stays a constant.
    old = dict(optimizer.get_config(), learning_rate=0.05)
    assert float(thor_tf.ThorOptimizer.from_config(old).learning_rate) == pytest.approx(0.05)
    old_model = dict(config, thor_options=dict(config["thor_options"], learning_rate=0.01))
    old_model["model"] = keras.saving.serialize_keras_object(small_cnn(0))
    loaded = thor_tf.ThorModel.from_config(old_model)
    loaded.compile(loss=LOSS)
    assert "learning_rate" in [v.name for v in loaded.optimizer.variables]
    assert float(loaded.optimizer.learning_rate) == pytest.approx(0.01)


# -- (a) a run of E epochs is WarmupCosine(E·steps) -----------------------------------------------
@pytest.mark.parametrize("rule,peak", [("eigenbasis", EIGENBASIS_PEAK), ("inverse", INVERSE_PEAK)])
def test_fit_applies_warmup_cosine_over_its_epochs_as_the_explicit_schedule_does(rule, peak):
    x, y = digits(800)  # 25 steps per epoch; 2 epochs: T = 50, W = round(2.5) = 2 (a tie)
    default = _wrapped(update_rule=rule)
    log = _fit(default, x, y, epochs=2)
    assert log.steps == list(range(50))
    np.testing.assert_allclose(log.rates, warmup_cosine(range(50), 50, peak), rtol=1e-6,
                               atol=1e-12)
    assert (_schedule(default).total_steps, _schedule(default).origin) == (50, 0)
    # The rates that count are the ones the update applied: the weights are those of a twin
    # given the explicit schedule, to float32 round-off.
    twin = _wrapped(update_rule=rule, learning_rate=WarmupCosine(50))
    _fit(twin, x, y, epochs=2)
    np.testing.assert_allclose(_max_difference(default, twin), 0.0, atol=1e-6)
    # ... and a length one epoch off is seen: both in the rates and in the weights.
    longer = _wrapped(update_rule=rule, learning_rate=WarmupCosine(75))
    longer_log = _fit(longer, x, y, epochs=2)
    assert np.abs(np.array(longer_log.rates) - log.rates).max() > 0.1 * peak
    assert _max_difference(default, longer) > 1e3 * 1e-6


# -- (b) a second fit ------------------------------------------------------------------------------
def test_a_second_fit_restarts_from_epoch_0_and_continues_from_initial_epoch():
    x, y = digits(160)  # 5 steps per epoch
    model = _wrapped()
    _fit(model, x, y, epochs=2)  # steps 0..9: WarmupCosine(10)
    # initial_epoch=0: a new warmup + cosine over this call's 3 epochs, from the current step.
    restart = _fit(model, x, y, epochs=3)
    assert restart.steps == list(range(10, 25))
    np.testing.assert_allclose(restart.rates, warmup_cosine(range(15), 15, EIGENBASIS_PEAK),
                               rtol=1e-6, atol=1e-12)
    assert (_schedule(model).total_steps, _schedule(model).origin) == (15, 10)
    # initial_epoch=k: the rest of a run of `epochs` epochs whose first k were done: here a run
    # of 6 epochs (30 steps) whose first 3 are the restart's, from its origin.
    cont = _fit(model, x, y, epochs=6, initial_epoch=3)
    assert cont.steps == list(range(25, 40))
    expected = warmup_cosine(range(15, 30), 30, EIGENBASIS_PEAK)
    np.testing.assert_allclose(cont.rates, expected, rtol=1e-6, atol=1e-12)
    assert (_schedule(model).total_steps, _schedule(model).origin) == (30, 10)
    # The two rules give different rates here: a continuation read as a restart would be seen.
    as_restart = warmup_cosine(range(15), 15, EIGENBASIS_PEAK)
    assert np.abs(expected - as_restart).max() > 0.1 * EIGENBASIS_PEAK
    # The rates the steps applied: a twin given the reference's rates step by step (a float rate
    # set before each step) ends with the same weights; given the restart's rates in the third
    # call, it does not.
    for third, equal in ((expected, True), (as_restart, False)):
        twin = _wrapped(learning_rate=EIGENBASIS_PEAK)
        for epochs, initial, rates in ((2, 0, warmup_cosine(range(10), 10, EIGENBASIS_PEAK)),
                                       (3, 0, as_restart), (6, 3, third)):
            twin.fit(x, y, batch_size=32, epochs=epochs, initial_epoch=initial, shuffle=False,
                     verbose=0, callbacks=[ScriptedRate(rates)])
        assert (_max_difference(model, twin) <= 1e-6) == equal


# -- (c) no length: a custom loop, data of unknown length ------------------------------------------
def _loop_model(**options):
    model = thor_tf.wrap(small_cnn(0), frequency=2, verbose=False, **options)
    model.compile()  # attaches THOR: model.optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)

    return model, step


def _run_loop(model, step, x, y, eager_steps=0):
    traced, rates = tf.function(step), []
    for i in range(0, 96, 32):
        rates.append(float(model.optimizer.learning_rate))
        traced(tf.constant(x[i:i + 32]), tf.constant(y[i:i + 32]))
    rates.append(float(model.optimizer.learning_rate))
    traced(tf.constant(x[96:112]), tf.constant(y[96:112]))  # another batch size: a second trace
    for i in range(eager_steps):
        step(tf.constant(x[:32]), tf.constant(y[:32]))
    return rates


def test_a_custom_loop_gets_the_peak_and_says_so_once_per_optimizer(capsys):
    x, y = digits(128)
    capsys.readouterr()
    model, step = _loop_model()
    rates = _run_loop(model, step, x, y, eager_steps=1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("thor_tf:")]
    assert lines == [
        "thor_tf: outside ThorModel.fit no run length is known, so the default learning rate is "
        "constant at 0.03 (no warmup, no decay); for warmup + cosine pass "
        "learning_rate=thor_tf.schedules.WarmupCosine(total_steps) to thor_tf.wrap / "
        "ThorOptimizer."]
    np.testing.assert_allclose(rates, EIGENBASIS_PEAK, rtol=1e-7)
    assert _schedule(model).total_steps == 0
    # The rate the steps applied: a twin at the explicit constant takes the same steps, one with
    # warmup + cosine over the loop does not.
    constant, constant_step = _loop_model(learning_rate=EIGENBASIS_PEAK)
    _run_loop(constant, constant_step, x, y, eager_steps=1)
    assert _max_difference(model, constant) <= 1e-6
    cosine, cosine_step = _loop_model(learning_rate=WarmupCosine(6))
    _run_loop(cosine, cosine_step, x, y, eager_steps=1)
    assert _max_difference(model, cosine) > 1e-4
    # Once per optimizer: the first model's optimizer stays silent, the new ones said it once each
    # (the explicit rates say nothing).
    tf.function(step)(tf.constant(x[:32]), tf.constant(y[:32]))
    other, other_step = _loop_model()
    tf.function(other_step)(tf.constant(x[:32]), tf.constant(y[:32]))
    out = capsys.readouterr().out
    assert out.count("thor_tf: outside ThorModel.fit") == 1


def test_fit_on_data_of_unknown_length_gets_the_peak_unless_steps_per_epoch_is_given(capsys):
    x, y = digits(96)

    def batches():  # a generator: Keras does not know the steps per epoch
        for i in range(0, 96, 32):
            yield x[i:i + 32], y[i:i + 32]

    capsys.readouterr()
    model = _wrapped()
    log = RateLog()
    model.fit(batches(), epochs=1, shuffle=False, verbose=0, callbacks=[log])
    assert int(model.optimizer.iterations.numpy()) >= 3
    np.testing.assert_allclose(log.rates, EIGENBASIS_PEAK, rtol=1e-7)
    out = capsys.readouterr().out
    assert out.count("thor_tf: fit does not know its steps per epoch") == 1
    assert "pass steps_per_epoch=... to fit, or learning_rate=thor_tf.schedules.WarmupCosine(" \
           "total_steps)" in out
    # With steps_per_epoch the length is known again: warmup + cosine over epochs x steps.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    log = RateLog()
    model.fit(data, epochs=2, steps_per_epoch=3, verbose=0, callbacks=[log])
    np.testing.assert_allclose(log.rates, warmup_cosine(range(6), 6, EIGENBASIS_PEAK), rtol=1e-6)
    assert "thor_tf:" not in capsys.readouterr().out


# -- (d) saved and restored mid-run ----------------------------------------------------------------
class _SaveAndStop(keras.callbacks.Callback):
    """At the end of epoch ``epoch``: ``model.save`` and a ``tf.train.Checkpoint``, then stop."""

    def __init__(self, epoch, path):
        super().__init__()
        self.epoch, self.path = epoch, path

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.save(self.path + ".keras")
            tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).write(
                self.path + ".ckpt")
            self.model.stop_training = True


def test_a_run_saved_mid_fit_and_resumed_continues_its_schedule(tmp_path, capsys):
    x, y = digits(160)  # 5 steps per epoch; 4 epochs: T = 20
    expected = warmup_cosine(range(20), 20, EIGENBASIS_PEAK)
    reference = _wrapped()
    reference_log = _fit(reference, x, y, epochs=4)
    np.testing.assert_allclose(reference_log.rates, expected, rtol=1e-6, atol=1e-12)

    path = os.path.join(tmp_path, "run")
    interrupted = _wrapped()
    interrupted.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0,
                    callbacks=[_SaveAndStop(1, path)])
    assert int(interrupted.optimizer.iterations.numpy()) == 10

    loaded = keras.models.load_model(path + ".keras")
    assert (_schedule(loaded).total_steps, _schedule(loaded).origin) == (20, 0)
    assert float(loaded.optimizer.learning_rate) == pytest.approx(expected[10], rel=1e-6)
    resumed = _fit(loaded, x, y, epochs=4, initial_epoch=2)
    assert resumed.steps == list(range(10, 20))
    np.testing.assert_allclose(resumed.rates, expected[10:], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(_max_difference(loaded, reference), 0.0, atol=1e-5)

    # tf.train.Checkpoint restores it too; a step outside fit then continues that schedule (and
    # says so), where an optimizer that was not restored would take the peak.
    fresh = _wrapped()
    assert float(fresh.optimizer.learning_rate) == pytest.approx(EIGENBASIS_PEAK)
    checkpoint = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer)
    checkpoint.read(path + ".ckpt").assert_consumed()
    assert (_schedule(fresh).total_steps, _schedule(fresh).origin) == (20, 0)
    assert float(fresh.optimizer.learning_rate) == pytest.approx(expected[10], rel=1e-6)
    assert abs(expected[10] - EIGENBASIS_PEAK) > 0.1 * EIGENBASIS_PEAK
    capsys.readouterr()
    fresh.train_on_batch(x[:32], y[:32])
    assert float(fresh.optimizer.learning_rate) == pytest.approx(expected[11], rel=1e-6)
    assert ("thor_tf: outside ThorModel.fit the default learning rate continues the warmup + "
            "cosine a fit set (20 steps from step 0, then 0)") in capsys.readouterr().out


# -- (e) one trace for fits of any length ----------------------------------------------------------
def test_the_train_function_is_traced_once_across_fits_of_different_lengths():
    x, y = digits(160)
    model = _wrapped()
    traces = []
    original = model.train_step

    def counting(data):
        traces.append(1)
        return original(data)

    model.train_step = counting
    _fit(model, x, y, epochs=1)
    log = _fit(model, x, y, epochs=3)  # another length: read from the variables, no retrace
    assert len(traces) == 1
    rates = warmup_cosine(range(15), 15, EIGENBASIS_PEAK)
    np.testing.assert_allclose(log.rates, rates, rtol=1e-6, atol=1e-12)
    # ... and applied (not only reported): a twin given these rates step by step agrees.
    twin = _wrapped(learning_rate=EIGENBASIS_PEAK)
    for epochs, script in ((1, warmup_cosine(range(5), 5, EIGENBASIS_PEAK)), (3, rates)):
        twin.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                 callbacks=[ScriptedRate(script)])
    assert _max_difference(model, twin) <= 1e-6
    # The counter sees a trace when there is one.
    model.make_train_function(force=True)
    _fit(model, x, y, epochs=1)
    assert len(traces) == 2


# -- a train_step that steps the optimizer more than once per batch --------------------------------
class TwiceModel(keras.Model):
    """Applies the optimizer twice per batch (a critic trained twice per step)."""

    def train_step(self, data):
        x, y = data
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_train_step_that_steps_twice_per_batch_is_warned_about():
    x, y = digits(64)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    model = thor_tf.wrap(TwiceModel(inputs, keras.layers.Dense(10, activation="softmax")(
        keras.layers.Flatten()(inputs))), verbose=False)
    model.compile(loss=LOSS)
    with pytest.warns(UserWarning, match="took 4 steps in an epoch of 2 batches"):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)


# -- (g) the run's length and the peak ---------------------------------------------------------------
def test_reference_steps_scale_the_whole_schedule_by_sqrt_of_reference_over_length():
    """WarmupCosine(T, peak, reference_steps=R) is sqrt(R/T)·warmup_cosine(T, peak) past R steps
    and warmup_cosine(T, peak) itself (the same float32 values) up to R."""
    steps = np.arange(0, 1100, 7)
    for total in (1000, 257):
        rates = WarmupCosine(total, 0.03, reference_steps=256)(tf.constant(steps)).numpy()
        reference = np.sqrt(256.0 / total) * warmup_cosine(steps, total, 0.03)
        np.testing.assert_allclose(rates, reference, rtol=2e-7, atol=0)
        last_warmup_step = round(0.05 * total) - 1  # the rate there is the (scaled) peak
        top = WarmupCosine(total, 0.03, reference_steps=256)(tf.constant(last_warmup_step))
        np.testing.assert_allclose(top.numpy(), np.sqrt(256.0 / total) * 0.03, rtol=1e-7)
    for total in (256, 50):  # not longer than R: the schedule as written, bit for bit
        scaled = WarmupCosine(total, 0.03, reference_steps=256)(tf.constant(steps)).numpy()
        plain = WarmupCosine(total, 0.03)(tf.constant(steps)).numpy()
        np.testing.assert_array_equal(scaled, plain)
    # The floor is scaled with the peak (the shape stays: floor/peak is unchanged).
    end = WarmupCosine(1024, 0.04, floor=0.004, reference_steps=256)(tf.constant(1024)).numpy()
    np.testing.assert_allclose(end, 0.5 * 0.004, rtol=1e-6)
    assert WarmupCosine(1024, 0.04, reference_steps=256).effective_peak == pytest.approx(0.02)
    assert thor_tf.schedules.horizon_scale(0, 256) == 1.0  # no length known: no scaling
    for bad in (0, -3, 2.5, True, "256"):
        with pytest.raises(ValueError, match="reference_steps must be None or a positive integer"):
            WarmupCosine(100, 0.03, reference_steps=bad)
        with pytest.raises(ValueError, match="reference_steps"):
            FitWarmupCosine(0.03, reference_steps=bad)


def test_the_fit_schedule_scales_in_the_graph_as_the_explicit_schedule_does():
    """FitWarmupCosine computes sqrt(R/T) from its T variable inside the traced step: the rates
    of an explicit WarmupCosine(T, reference_steps=R) bit for bit, for lengths on both sides of R,
    with one trace."""
    optimizer = thor_tf.ThorOptimizer(learning_rate=FitWarmupCosine(0.03, reference_steps=40))
    schedule = optimizer._learning_rate
    steps = tf.constant(np.arange(0, 130, 3), tf.int64)
    traced = tf.function(schedule)
    for total in (30, 40, 41, 120):
        schedule.set_run(iterations=0, epochs=total, initial_epoch=0, steps_per_epoch=1)
        np.testing.assert_array_equal(
            traced(steps).numpy(),
            WarmupCosine(total, 0.03, reference_steps=40)(steps).numpy())
    np.testing.assert_allclose(traced(steps).numpy(),  # T = 120 is set
                               np.sqrt(40 / 120) * warmup_cosine(steps.numpy(), 120, 0.03),
                               rtol=2e-7, atol=1e-12)
    assert traced.experimental_get_tracing_count() == 1


def test_the_default_takes_the_rules_reference_steps_and_a_given_peak_is_kept():
    """wrap(model) / WarmupCosine(T) without a peak: the rule's rate and reference length; a peak
    the user gives is used as written (no reference length) at any length."""
    default = thor_tf.ThorOptimizer()._learning_rate
    assert (default.peak, default.reference_steps) == (EIGENBASIS_PEAK, 256)
    explicit = _schedule(_wrapped(learning_rate=WarmupCosine(1407)))
    assert explicit.reference_steps == 256
    assert explicit.effective_peak == pytest.approx(0.03 * np.sqrt(256 / 1407))  # 1.28e-2
    given = _schedule(_wrapped(learning_rate=WarmupCosine(1407, peak=0.03)))
    assert given.reference_steps is None and given.effective_peak == 0.03
    # The other rules measured no horizon: one peak at every length.
    assert thor_tf.ThorOptimizer(update_rule="inverse")._learning_rate.reference_steps is None
    adam_step = thor_tf.ThorOptimizer(update_rule=thor_tf.rules.Eigenbasis(step="adam"))
    assert (adam_step._learning_rate.peak, adam_step._learning_rate.reference_steps) == (0.01, None)
    # Saved configs keep it; configs saved before it existed load without one.
    back = FitWarmupCosine.from_config(default.get_config())
    assert back.reference_steps == 256
    old = {"peak": 0.03, "warmup_fraction": 0.05, "floor": 0.0}
    assert FitWarmupCosine.from_config(old).reference_steps is None
    assert WarmupCosine.from_config(dict(old, total_steps=2000)).effective_peak == 0.03


def test_a_fit_longer_than_the_reference_applies_the_scaled_rates():
    """A fit of T = 50 steps with reference_steps 20: the rates applied are sqrt(20/50) times
    the unscaled warmup + cosine (the NumPy reference), and the weights are a twin's given those
    rates one by one; a schedule without the scaling would be 1/sqrt(0.4) = 1.58x off."""
    x, y = digits(800)  # 25 steps per epoch
    model = _wrapped(learning_rate=FitWarmupCosine(0.03, reference_steps=20))
    log = _fit(model, x, y, epochs=2)
    expected = np.sqrt(20 / 50) * warmup_cosine(range(50), 50, 0.03)
    np.testing.assert_allclose(log.rates, expected, rtol=1e-6, atol=1e-12)
    twin = _wrapped(learning_rate=0.03)
    twin.fit(x, y, batch_size=32, shuffle=False, verbose=0, epochs=2,
             callbacks=[ScriptedRate(expected)])
    np.testing.assert_allclose(_max_difference(model, twin), 0.0, atol=1e-6)
