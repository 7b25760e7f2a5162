"""The trace rule: decisions from controlled factor sequences, freezing, presets, one trace."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from digits_models import digits, small_cnn
from thor_tf import scheduler, trace_rule
from thor_tf.callbacks import TraceRuleLogger

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")

LAMBDA = 0.04


def _linear_loss(y_true, y_pred):
    # dℓ_n/dz = y_n / K whatever the weights or inputs: G stays fixed while A follows the inputs.
    return tf.reduce_mean(y_true * y_pred, axis=-1)


def _controlled(omega1, omega2, seed=0, trace_filter="none", frequency=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, use_bias=False, name="fc")])
    wrapped = thor_tf.wrap(model, omega1=omega1, omega2=omega2, frequency=frequency,
                           damping=LAMBDA, learning_rate=1e-3, trace_filter=trace_filter,
                           verbose=False)
    wrapped.compile(loss=_linear_loss)
    return wrapped


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")


def _expected_decisions(x, y, scales, omega1, omega2):
    """Simulate the published rule in float64 from the explicit per-example quantities: the seed's
    T = tr A · tr G + λ_b·a_dim·g_dim with A = mean a aᵀ of the scaled inputs, G = mean g gᵀ with
    g_n = y_n / K (the linear loss), λ_b = λ (Dense, P = 1)."""
    a_rows = [s * x.astype(np.float64) for s in scales]
    g_rows = y.astype(np.float64) / 3
    G = sum(np.outer(g, g) for g in g_rows) / len(g_rows)
    decisions, deltas, used, frozen = [], [], None, False
    for rows in a_rows:
        A = sum(np.outer(a, a) for a in rows) / len(rows)
        product = np.trace(A) * np.trace(G) + LAMBDA * 6 * 3
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
    scales = [1.0, 1.02, 1.05, 1.06, 1.0505, 2.0, 3.0]
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
    refresh, freeze = trace_rule.decide(delta, 0.1, 0.01)
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
    for preset, (w1, w2) in trace_rule.PRESETS.items():
        opt = thor_tf.ThorOptimizer(preset=preset)
        assert (opt.omega1, opt.omega2) == (w1, w2)
    assert trace_rule.PRESETS == {"thor": (0.01, 0.0), "thor_stop": (0.01, 0.001), "thor_nt": (0.0, 0.0)}


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


# -- the seed's Δ against a float64 computation from the batch's own activations and gradients ------

def test_published_delta_is_the_seed_formula_on_conv_and_dense_blocks():
    """Δ = |T1 − T0| / T0 with T = tr A · tr G + (λ/P)·a_dim·g_dim, A and G from explicit patches
    and per-example output gradients of softmax cross-entropy (KFC: P = Ho·Wo for the conv)."""
    from reference import conv_patches, homogeneous, mean_outer, softmax

    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((5, 5, 1)),
        keras.layers.Conv2D(2, 3, name="conv"),  # linear: dℓ/dz_conv = (p − y) W2ᵀ, reshaped
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax", name="out"),
    ])
    lam = 0.05
    wrapped = thor_tf.wrap(model, omega1=100.0, omega2=0.0, frequency=1, damping=lam,
                           learning_rate=0.01, kl_clip=None, trace_filter="none", verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(4)
    batches = [(rng.normal(size=(6, 5, 5, 1)).astype("float32") * s, rng.integers(0, 3, 6))
               for s in (1.0, 1.3)]

    def traces(x, y):
        k, b, w2, b2 = [np.asarray(w, np.float64) for w in model.get_weights()]
        patches = conv_patches(x.astype(np.float64), (3, 3), (1, 1), "valid", (1, 1))  # [N,3,3,9]
        z1 = patches @ k.reshape(9, 2) + b  # [N, 3, 3, 2]
        h = z1.reshape(len(x), -1)
        p = softmax(h @ w2 + b2)
        g_out = p - np.eye(3)[y]  # per-example dℓ/dz of the output layer
        g_conv = (g_out @ w2.T).reshape(z1.shape)
        positions = 9.0
        out = {}
        for name, a_rows, g_rows, pos in (
                ("conv", patches.reshape(-1, 9), g_conv.reshape(-1, 2), positions),
                ("out", h, g_out, 1.0)):
            A = mean_outer(homogeneous(a_rows, True))
            G = mean_outer(g_rows)
            out[name] = np.trace(A) * np.trace(G) + lam / pos * A.shape[0] * G.shape[0]
        return out

    logger = TraceRuleLogger(summary=False)
    products = []
    for x, y in batches:
        products.append(traces(x, y))  # at the weights this step sees
        wrapped.fit(x, y, batch_size=6, epochs=1, verbose=0, callbacks=[logger], shuffle=False)
    got = {r["layer"]: r["delta"] for r in logger.rows[2:]}
    assert [r["decision"] for r in logger.rows] == ["refresh"] * 2 + ["reuse"] * 2
    for name in ("conv", "out"):
        expected = abs(products[1][name] - products[0][name]) / products[0][name]
        assert expected > 0.05  # the batches differ: a real test of the formula
        np.testing.assert_allclose(got[name], expected, rtol=2e-4)
    stats = {s["name"]: s for s in wrapped.thor.layer_stats()}
    assert stats["conv"]["refreshes"] == 1


def test_trace_product_is_the_trace_of_the_damped_kronecker_block():
    rng = np.random.default_rng(0)
    A = np.cov(rng.normal(size=(4, 20)))
    G = np.cov(rng.normal(size=(3, 20)))
    lam = 0.07
    expected = np.trace(np.kron(A, G) + lam * np.eye(12))
    got = trace_rule.trace_product(np.trace(A), np.trace(G), lam, 4, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


# -- the noise filter on synthetic trace sequences (pure tensor functions) ------------------------

def _run_filter(sequences, refresh_at=(), omega1=float("inf"), omega2=0.0, first_refresh=True):
    """Drive the filter over ``sequences`` [S, K] (float64 in, float32 tensors inside): point 0
    refreshes (no block yet), later points refresh where the rule says so or where forced
    (``refresh_at``). Returns (Δ [S, K], refresh [S, K]) as NumPy arrays."""
    seqs = tf.constant(sequences, tf.float32)
    n, k = sequences.shape
    state = trace_rule.initial_filter_state((n,))
    calm = tf.zeros((n,), tf.int64)
    has_used = tf.zeros((n,), tf.bool)
    deltas, refreshes = [], []
    for t in range(k):
        obs = seqs[:, t]
        state = trace_rule.filter_observe(state, obs)
        delta = trace_rule.filter_delta(state, 0.0, has_used)
        refresh, freeze, calm = trace_rule.decide(delta, omega1, omega2, calm, trace_rule.FREEZE_AFTER)
        if t == 0 or t in refresh_at:
            refresh = tf.ones_like(refresh)
        state = trace_rule.filter_refresh(state, refresh)
        state = trace_rule.filter_noise(state, obs)
        has_used = tf.logical_or(has_used, refresh)
        deltas.append(delta.numpy())
        refreshes.append(refresh.numpy())
    return np.stack(deltas, 1), np.stack(refreshes, 1)


def test_filter_reads_zero_on_a_stationary_noisy_sequence():
    rng = np.random.default_rng(0)
    sigma = 0.05  # 5 % per-batch noise, as on the Fashion-MNIST CNN; ω1 = 1 %
    seqs = 1.0 + sigma * rng.normal(size=(400, 40))
    deltas, refreshes = _run_filter(seqs, omega1=0.01)
    published = np.abs(seqs[:, 1:] / seqs[:, :1] - 1.0)  # single batch against the first
    assert published.mean() > 0.03  # the published Δ reads the noise
    later = deltas[:, 5:]
    assert later.mean() < 0.002  # the filter reads ≈ 0
    assert np.median(later) == 0.0
    assert refreshes[:, 5:].mean() < 0.05  # rare false refreshes


@pytest.mark.parametrize("x", [0.2, -0.15])
def test_filter_reads_a_step_change_right_after_a_refresh_as_later(x):
    rng = np.random.default_rng(1)
    sigma, k = 0.01, 60
    seqs = 1.0 + sigma * rng.normal(size=(200, k))
    # (a) refresh forced at point 20, step right after it; (b) step 25 points after that refresh.
    right_after = seqs.copy()
    right_after[:, 21:] *= 1 + x
    d_a, _ = _run_filter(right_after, refresh_at=(20,))
    later = seqs.copy()
    later[:, 45:] *= 1 + x
    d_b, _ = _run_filter(later, refresh_at=(20,))
    window = trace_rule.TRACE_WINDOW
    # Reference: m_ref ≈ 1 (refresh at point 20), the new level 1 + x: Δ ≈ |x| / 1.
    read_a = d_a[:, 21 + 1]  # within two points of the step
    read_b = d_b[:, 45 + window - 1]  # once the window holds only post-step points
    for read in (read_a, read_b):
        assert abs(np.median(read) - abs(x)) < 0.15 * abs(x)
    # Before the step both read ≈ 0.
    assert np.median(d_a[:, 10:20]) < 0.01 * abs(x) and np.median(d_b[:, 30:45]) < 0.01 * abs(x)
    # The old exponential smoothing (s = 0.9) read only ~(1 − s)·x one point after a refresh.
    assert np.median(read_a) > 5 * 0.1 * abs(x) * 0.9


def test_filtered_rule_freezes_only_after_sustained_evidence():
    x, y = _batch()
    n = trace_rule.FREEZE_AFTER
    rows, _ = _run(_controlled(0.05, 0.01, trace_filter="mean"), x, y, [1.0] * (n + 3))
    assert [r["decision"] for r in rows] == ["refresh"] + ["reuse"] * (n - 1) + ["freeze"] + ["frozen"] * 2
    rows, _ = _run(_controlled(0.05, 0.01, trace_filter="none"), x, y, [1.0] * 3)
    assert [r["decision"] for r in rows] == ["refresh", "freeze", "frozen"]  # as published
    # A Δ >= ω2 in between restarts the count.
    scales = [1.0] * (n - 1) + [1.03] + [1.03] * (n - 1)
    rows, _ = _run(_controlled(0.5, 0.01, trace_filter="mean"), x, y, scales)
    assert "freeze" not in [r["decision"] for r in rows]


# -- adaptive cadence ----------------------------------------------------------------------------

def test_adaptive_interval_grows_while_layers_reuse_and_shrinks_when_they_refresh():
    x, y = _batch()
    cadence = trace_rule.AdaptiveCadence(base=1, max_interval=4)
    wrapped = _controlled(0.05, 0.0, frequency=cadence)
    traces = []
    original = wrapped.train_step
    wrapped.train_step = lambda data: (traces.append(1), original(data))[1]
    logger = TraceRuleLogger(summary=False)
    intervals = []
    for step in range(19):
        scale = 1.0 if step < 11 else 3.0
        wrapped.fit(x * scale, y, batch_size=len(x), epochs=1, verbose=0, callbacks=[logger],
                    shuffle=False)
        intervals.append(wrapped.thor.counters()["interval"])
    steps = [r["step"] for r in logger.rows]
    decisions = [r["decision"] for r in logger.rows]
    # step 0 refresh (interval stays 1), reuses double it 1 → 2 → 4 (cap), the change at step 11
    # refreshes and halves it to 2, the next reuse doubles it again.
    assert steps == [0, 1, 3, 7, 11, 13, 17]
    assert decisions == ["refresh", "reuse", "reuse", "reuse", "refresh", "reuse", "reuse"]
    assert intervals[0] == 1 and intervals[3] == 4 and intervals[11] == 2 and intervals[13] == 4
    assert len(traces) == 1
    assert wrapped.thor.counters()["cadence_points"] == 7


def test_adaptive_cadence_serializes_and_validates():
    opt = thor_tf.ThorOptimizer(frequency="adaptive")
    assert opt.get_config()["trace_rule"]["frequency"] == "adaptive"
    assert opt.cadence.adaptive.base == 10 and opt.cadence.adaptive.max_interval == 80
    custom = thor_tf.ThorOptimizer(frequency=trace_rule.AdaptiveCadence(5, 20), trace_filter="none")
    config = custom.get_config()
    assert config["trace_rule"]["trace_filter"] == "none"
    again = thor_tf.ThorOptimizer.from_config(config)
    assert (again.cadence.adaptive.base, again.cadence.adaptive.max_interval) == (5, 20)
    for bad in ("adaptiv", {"adaptive": {"base": 0}}, {"adaptive": {"base": 4, "max_interval": 2}},
                {"adaptive": {"basis": 4}}):
        with pytest.raises(ValueError, match="frequency"):
            thor_tf.ThorOptimizer(frequency=bad)
    with pytest.raises(ValueError, match="trace_filter.*'mean', 'none'"):
        thor_tf.ThorOptimizer(trace_filter="ema")
    with pytest.raises(ValueError, match="trace_smoothing.*trace_filter"):
        thor_tf.ThorOptimizer(trace_smoothing=0.9)
    # A config saved before trace_filter existed (the trace rule's options top-level) still loads.
    legacy = thor_tf.ThorOptimizer().get_config()
    legacy.update(legacy.pop("trace_rule"))
    legacy.pop("trace_filter")
    legacy["trace_smoothing"] = 0.9
    assert thor_tf.ThorOptimizer.from_config(legacy).trace_filter == "mean"


def _rotations(count, dim=6, seed=3):
    """``count`` random orthogonal ``dim × dim`` matrices (float64): ``x @ Q`` keeps every row's
    norm, so tr A is unchanged while A = Qᵀ A₀ Q turns."""
    rng = np.random.default_rng(seed)
    return [np.linalg.qr(rng.normal(size=(dim, dim)))[0] for _ in range(count)]


@pytest.mark.parametrize("trace_filter", ["mean", "none"])
def test_trace_rule_is_blind_to_a_turning_factor_and_max_block_age_bounds_its_age(trace_filter):
    x, y = _batch()
    turns = _rotations(10)
    inputs = [(x.astype(np.float64) @ q).astype("float32") for q in turns]
    results = {}
    for age in (None, 3):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, use_bias=False, name="fc")])
        wrapped = thor_tf.wrap(model, frequency=1, damping=LAMBDA, learning_rate=1e-3,
                               trace_filter=trace_filter, max_block_age=age, verbose=False)
        wrapped.compile(loss=_linear_loss)
        logger = TraceRuleLogger(summary=False)
        factors = []
        for xs in inputs:
            wrapped.fit(xs, y, batch_size=len(x), epochs=1, verbose=0, callbacks=[logger],
                        shuffle=False)
            factors.append(wrapped.thor.factors("fc")["A"].copy())
        results[age] = ([r["decision"] for r in logger.rows], factors)
    # Every batch has the same tr A (rotated rows) and G (the linear loss): the trace rule keeps
    # the first block for good, ...
    decisions, factors = results[None]
    assert decisions == ["refresh"] + ["reuse"] * 9
    first = inputs[0].astype(np.float64)
    for f in factors:
        np.testing.assert_allclose(f, first.T @ first / len(first), rtol=1e-5, atol=1e-7)
    # ... although A itself turns: its relative change is far from the trace's (0).
    last = inputs[-1].astype(np.float64)
    a_first, a_last = first.T @ first / len(first), last.T @ last / len(last)
    assert abs(np.trace(a_last) - np.trace(a_first)) / np.trace(a_first) < 1e-6
    assert np.linalg.norm(a_last - a_first) / np.linalg.norm(a_first) > 0.3
    # With max_block_age = 3 steps the block is refreshed at steps 0, 3, 6, 9 and each refresh
    # installs that batch's A (float64 reference from the explicit rows).
    decisions, factors = results[3]
    assert decisions == ["refresh", "reuse", "reuse"] * 3 + ["refresh"]
    for step, f in enumerate(factors):
        rows = inputs[step - step % 3].astype(np.float64)
        np.testing.assert_allclose(f, rows.T @ rows / len(rows), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("age", [0, -1, 2.5, True, "10"])
def test_bad_max_block_age_raises(age):
    with pytest.raises(ValueError, match="max_block_age"):
        thor_tf.ThorOptimizer(max_block_age=age)


def test_max_block_age_round_trips_through_the_optimizer_config(tmp_path):
    # Non-default values only (50 is the default: a from_config that dropped the key would
    # still read 50), through get_config/from_config and through a saved model.
    assert thor_tf.ThorOptimizer().max_block_age == 50
    for age in (7, None):
        config = thor_tf.ThorOptimizer(max_block_age=age).get_config()
        assert config["trace_rule"]["max_block_age"] == age
        restored = thor_tf.ThorOptimizer.from_config(config)
        assert restored.max_block_age == age and restored.config.trace_rule.max_block_age == age
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
    wrapped = thor_tf.wrap(model, max_block_age=7, verbose=False)
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"))
    path = str(tmp_path / "age.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.max_block_age == 7
    assert loaded.optimizer.config.trace_rule.max_block_age == 7


def test_scheduler_module_reexports_the_trace_rule_objects():
    # thor_tf.scheduler is the old home: its names must be the trace rule's own objects (not
    # copies), so isinstance checks and config round trips agree whichever module a user imports.
    names = [n for n in dir(scheduler) if not n.startswith("_")]
    assert {"AdaptiveCadence", "CadenceSchedule", "PRESETS", "TRACE_FILTERS", "TRACE_WINDOW",
            "FREEZE_AFTER", "FilterState", "filter_step", "decide"} <= set(names)
    for name in names:
        assert getattr(scheduler, name) is getattr(trace_rule, name), name
    assert trace_rule.TRACE_WINDOW == 8 and trace_rule.FREEZE_AFTER == 5


def test_the_trace_rules_options_are_one_object_also_taken_by_name():
    """``thor_tf.TraceRule`` holds the trace rule's six options (ThorConfig has no field of its
    own for them); ``wrap``/``ThorOptimizer`` take each by name too; configs save it nested and
    load the flat form earlier releases saved; a name given twice with two values is refused."""
    import dataclasses

    from thor_tf.config import ThorConfig

    by_name = thor_tf.ThorOptimizer(preset="thor_stop", max_block_age=7, frequency=5)
    as_object = thor_tf.ThorOptimizer(
        trace_rule=thor_tf.TraceRule(preset="thor_stop", max_block_age=7, frequency=5))
    assert by_name.config == as_object.config
    assert by_name.config.trace_rule == thor_tf.TraceRule(5, "thor_stop", max_block_age=7)
    assert (by_name.omega1, by_name.omega2) == (0.01, 0.001) and by_name.frequency == 5
    assert not {f.name for f in dataclasses.fields(ThorConfig)} & set(thor_tf.TraceRule.options())
    config = by_name.get_config()
    assert config["trace_rule"] == {"frequency": 5, "preset": "thor_stop", "omega1": None,
                                    "omega2": None, "trace_filter": "mean", "max_block_age": 7}
    assert not set(config) & set(thor_tf.TraceRule.options())
    flat = dict(config)
    flat.update(flat.pop("trace_rule"))       # as saved before the trace rule had a home
    assert thor_tf.ThorOptimizer.from_config(flat).config == by_name.config
    assert thor_tf.ThorOptimizer.from_config(config).config == by_name.config
    with pytest.raises(ValueError, match="`preset` is given twice"):
        thor_tf.ThorOptimizer(trace_rule=thor_tf.TraceRule(preset="thor_stop"), preset="thor_nt")
    # A name the object leaves at its default is set by name.
    both = thor_tf.ThorOptimizer(trace_rule=thor_tf.TraceRule(preset="thor_stop"),
                                 max_block_age=None)
    assert both.max_block_age is None and both.preset == "thor_stop"
    with pytest.raises(ValueError, match="`trace_rule` must be a thor_tf.TraceRule"):
        thor_tf.ThorOptimizer(trace_rule="thor")
    with pytest.raises(ValueError, match="`max_block_age` must be None or an int"):
        thor_tf.TraceRule(max_block_age=0)
