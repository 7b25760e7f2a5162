"""The trace rule: decisions from controlled factor sequences, freezing, presets, one trace."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from digits_models import digits, small_cnn
from thor_tf import scheduler
from thor_tf.callbacks import TraceRuleLogger

LAMBDA = 0.04


def _linear_loss(y_true, y_pred):
    # dℓ_n/dz = y_n / K whatever the weights or inputs: G stays fixed while A follows the inputs.
    return tf.reduce_mean(y_true * y_pred, axis=-1)


def _controlled(omega1, omega2, seed=0, trace_smoothing=0.0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, use_bias=False, name="fc")])
    wrapped = thor_tf.wrap(model, omega1=omega1, omega2=omega2, frequency=1, damping=LAMBDA,
                           learning_rate=1e-3, trace_smoothing=trace_smoothing, verbose=False)
    wrapped.compile(loss=_linear_loss)
    return wrapped


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")


def _expected_decisions(x, y, scales, omega1, omega2, smoothing=0.0):
    """Simulate the rule in float64: tr(A + dI)·tr(G + dI) with d = √λ, A from the scaled inputs;
    with smoothing, tr A is the running estimate s·previous + (1 − s)·batch."""
    d = np.sqrt(LAMBDA)
    trace_g = np.mean(np.sum((y.astype(np.float64) / 3) ** 2, axis=1))  # g_n = y_n / K
    decisions, deltas, used, frozen, smooth = [], [], None, False, None
    for s in scales:
        trace_a = np.mean(np.sum((s * x.astype(np.float64)) ** 2, axis=1))
        if smoothing and smooth is not None and not frozen:
            trace_a = smoothing * smooth + (1 - smoothing) * trace_a
        if not frozen:
            smooth = trace_a
        product = (trace_a + d * 6) * (trace_g + d * 3)
        if frozen:
            decisions.append("frozen")
            deltas.append(np.nan)
            continue
        delta = np.inf if used is None else abs(product - used) / used
        deltas.append(delta)
        if delta > omega1:
            decisions.append("refresh")
            used = product
        elif delta < omega2:
            decisions.append("freeze")
            frozen = True
        else:
            decisions.append("reuse")
    return decisions, deltas


def _run(wrapped, x, y, scales):
    logger = TraceRuleLogger(summary=False)
    factors = []
    for s in scales:
        wrapped.fit(x * s, y, batch_size=len(x), epochs=1, verbose=0, callbacks=[logger], shuffle=False)
        factors.append(wrapped.thor.factors("fc")["A"].copy())
    return logger.rows, factors


def test_decisions_follow_the_rule_on_controlled_sequences():
    x, y = _batch()
    omega1, omega2 = 0.05, 0.01
    # Δ relative to the block in use: refresh, small drift (reuse), accumulated drift (refresh),
    # tiny change (freeze), then big changes that a frozen block ignores.
    scales = [1.0, 1.02, 1.04, 1.05, 1.0405, 2.0, 3.0]
    expected, expected_deltas = _expected_decisions(x, y, scales, omega1, omega2)
    assert expected == ["refresh", "reuse", "refresh", "reuse", "freeze", "frozen", "frozen"]
    wrapped = _controlled(omega1, omega2)
    rows, factors = _run(wrapped, x, y, scales)
    assert [r["decision"] for r in rows] == expected
    got = np.array([r["delta"] for r in rows], dtype=np.float64)
    finite = np.isfinite(np.array(expected_deltas))
    np.testing.assert_allclose(got[finite], np.array(expected_deltas)[finite], rtol=1e-4, atol=1e-6)
    stats = wrapped.thor.layer_stats()[0]
    assert stats["refreshes"] == 2 and stats["reuses"] == 2
    assert stats["frozen"] and stats["frozen_at_step"] == 4
    # The frozen block never changes again.
    for later in factors[4:]:
        np.testing.assert_array_equal(later, factors[4])
    np.testing.assert_array_equal(factors[4], factors[2])  # last refreshed at step 2


def test_trace_smoothing_compares_a_running_estimate():
    x, y = _batch()
    # One noisy batch (scale 1.2) between steady ones: without smoothing it triggers refreshes,
    # with smoothing 0.8 the running estimate barely moves.
    scales = [1.0, 1.0, 1.2, 1.0, 1.0]
    plain, _ = _expected_decisions(x, y, scales, 0.05, 0.0)
    smooth, smooth_deltas = _expected_decisions(x, y, scales, 0.05, 0.0, smoothing=0.8)
    assert plain == ["refresh", "reuse", "refresh", "refresh", "reuse"]
    assert smooth.count("refresh") < plain.count("refresh")
    rows, _ = _run(_controlled(0.05, 0.0, trace_smoothing=0.8), x, y, scales)
    assert [r["decision"] for r in rows] == smooth
    np.testing.assert_allclose([r["delta"] for r in rows][1:], smooth_deltas[1:], rtol=1e-4, atol=1e-6)


def test_boundaries_delta_equal_omega1_reuses_and_equal_omega2_does_not_freeze():
    x, y = _batch()
    probe = _controlled(1.0, 0.0)
    rows, _ = _run(probe, x, y, [1.0, 1.03])
    delta = np.float32(rows[1]["delta"])  # the exact float32 Δ the graph computes
    at_omega1 = _controlled(float(delta), 0.0)
    rows, _ = _run(at_omega1, x, y, [1.0, 1.03])
    assert [r["decision"] for r in rows] == ["refresh", "reuse"]  # Δ = ω1: keep the inverses
    at_omega2 = _controlled(float(delta), float(delta))
    rows, _ = _run(at_omega2, x, y, [1.0, 1.03])
    assert [r["decision"] for r in rows] == ["refresh", "reuse"]  # Δ = ω2: not frozen
    just_above = _controlled(float(np.nextafter(delta, np.float32(0))), 0.0)
    rows, _ = _run(just_above, x, y, [1.0, 1.03])
    assert [r["decision"] for r in rows] == ["refresh", "refresh"]
    just_below = _controlled(1.0, float(np.nextafter(delta, np.float32(1))))
    rows, _ = _run(just_below, x, y, [1.0, 1.03])
    assert [r["decision"] for r in rows] == ["refresh", "freeze"]


def test_decide_function_boundaries():
    delta = tf.constant([0.2, 0.1, 0.05, 0.01, 0.005, np.inf])
    refresh, freeze = scheduler.decide(delta, 0.1, 0.01)
    assert refresh.numpy().tolist() == [True, False, False, False, False, True]
    assert freeze.numpy().tolist() == [False, False, False, False, True, False]




def test_thor_nt_refreshes_every_layer_at_every_cadence_point():
    x, y = digits()
    wrapped = thor_tf.wrap(small_cnn(), preset="thor_nt", frequency=4, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x[:640], y[:640], batch_size=32, epochs=2, verbose=0)  # 40 steps → 10 points
    assert wrapped.thor.counters()["cadence_points"] == 10
    for s in wrapped.thor.layer_stats():
        assert s["refreshes"] == 10 and s["reuses"] == 0 and not s["frozen"]


def test_thor_refreshes_fewer_blocks_than_thor_nt_and_both_train():
    x, y = digits()
    results = {}
    for preset in ("thor", "thor_nt"):
        wrapped = thor_tf.wrap(small_cnn(), preset=preset, frequency=2, learning_rate=0.02, verbose=False)
        wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        start = wrapped.evaluate(x, y, verbose=0)[0]
        keras.utils.set_random_seed(1)
        wrapped.fit(x, y, batch_size=64, epochs=3, verbose=0)
        loss, acc = wrapped.evaluate(x, y, verbose=0)
        results[preset] = (sum(s["refreshes"] for s in wrapped.thor.layer_stats()), loss, acc, start)
    (thor_refreshes, thor_loss, thor_acc, start), (nt_refreshes, nt_loss, nt_acc, _) = (
        results["thor"], results["thor_nt"])
    assert thor_refreshes < nt_refreshes
    assert thor_loss < 0.5 * start and nt_loss < 0.5 * start
    assert thor_acc > 0.85 and nt_acc > 0.85


def test_one_trace_while_decisions_change_and_epoch_schedule_thins_refreshes(tmp_path):
    x, y = digits()
    wrapped = thor_tf.wrap(small_cnn(), frequency=[(0, 1), (1, 5)], omega1=0.02, omega2=0.0,
                           verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    traces = []
    original = wrapped.train_step
    wrapped.train_step = lambda data: (traces.append(1), original(data))[1]
    path = tmp_path / "trace.csv"
    logger = TraceRuleLogger(csv_path=str(path), summary=True)
    wrapped.fit(x[:1600], y[:1600], batch_size=32, epochs=2, verbose=0, callbacks=[logger])
    assert len(traces) == 1
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    decisions = {r["decision"] for r in rows}
    assert "refresh" in decisions and "reuse" in decisions
    per_epoch = [len({r["step"] for r in rows if r["epoch"] == str(e)}) for e in (0, 1)]
    assert per_epoch == [50, 10]  # interval 1 in epoch 0, 5 in epoch 1


@pytest.mark.parametrize("frequency", [0, -3, 2.5, [(1, 5)], [(0, 5), (0, 3)], [(0, 0)], "10"])
def test_bad_frequency_raises(frequency):
    with pytest.raises(ValueError, match="frequency"):
        thor_tf.wrap(small_cnn(), frequency=frequency, verbose=False)


def test_presets_set_omegas():
    for preset, (w1, w2) in scheduler.PRESETS.items():
        opt = thor_tf.ThorOptimizer(preset=preset)
        assert (opt.omega1, opt.omega2) == (w1, w2)
    assert scheduler.PRESETS == {"thor": (0.01, 0.0), "thor_stop": (0.01, 0.001), "thor_nt": (0.0, 0.0)}


def test_logger_writes_tensorboard_scalars(tmp_path, capsys):
    x, y = digits()
    wrapped = thor_tf.wrap(small_cnn(), frequency=5, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    logger = TraceRuleLogger(log_dir=str(tmp_path / "tb"), summary=True)
    wrapped.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0, callbacks=[logger])
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        tags.update(v.tag for v in event.summary.value)
    assert {"thor/conv/decision", "thor/fc/delta", "thor/out/decision"} <= tags
    table = capsys.readouterr().out
    assert "refreshes" in table and "conv" in table
    assert len(logger.rows) == 2 * 3  # 10 steps / frequency 5, three layers
