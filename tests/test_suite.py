"""experiments/suite.py: the rules of the comparison (best rate by the median over seeds, the
target, steps to it, never), the same batches for every optimizer, the baselines' schedule, THOR
at thor_tf's defaults, the autoencoder's loss, and a --quick run end to end."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from experiments import suite, workloads as wl


def _rows(workload, optimizer, lr, seed, curve, seconds_per_eval=1.0, load=0.02):
    """Metric rows at steps 0, 10, 20, ... with the given metric values; the run's timing
    columns (the run so far) with ``load`` from step 10 on."""
    return [{"workload": workload, "optimizer": optimizer, "lr": lr, "seed": seed, "step": 10 * i,
             "seconds": seconds_per_eval * i, "metric": m, "train_loss": None,
             "first_seconds": seconds_per_eval if i else None,
             "steady_seconds_per_step": seconds_per_eval / 10 if i > 1 else None,
             "load": load if i else None}
            for i, m in enumerate(curve)]


def _workload(higher=True):
    return wl.Workload("w", "w", None, None, None, "accuracy" if higher else "loss", higher,
                       batch_size=4, epochs=1, baselines={})


def test_best_rate_is_the_median_over_seeds_and_the_target_is_the_best_baselines_median():
    rows = []
    # adam 1e-3: finals 0.80, 0.90, 0.70 (median 0.80); adam 1e-2: 0.85, 0.60, 0.86 (0.85, best
    # by the median though seed 1 is poor); muon 3e-3: 0.84, 0.84, 0.84.
    for seed, final in enumerate((0.80, 0.90, 0.70)):
        rows += _rows("w", "adam", 1e-3, seed, [0.1, 0.5, final])
    for seed, final in enumerate((0.85, 0.60, 0.86)):
        rows += _rows("w", "adam", 1e-2, seed, [0.1, 0.6, final])
    for seed in range(3):
        rows += _rows("w", "muon", 3e-3, seed, [0.1, 0.84, 0.84])
    # THOR reaches 0.85 at step 10 on seeds 0 and 1, never on seed 2.
    for seed, curve in enumerate(([0.1, 0.85, 0.9], [0.1, 0.86, 0.88], [0.1, 0.5, 0.7])):
        rows += _rows("w", "thor", 0.0, seed, curve, seconds_per_eval=2.0)
    s = suite.summarize_workload(_workload(), rows)
    assert s["best_baseline"] == "adam" and s["optimizers"]["adam"]["lr"] == 1e-2
    assert s["target"] == pytest.approx(0.85)
    adam, thor = s["optimizers"]["adam"], s["optimizers"]["thor"]
    assert adam["steps_to_target"] == [20, None, 20] and adam["median_steps"] == 20
    assert thor["steps_to_target"] == [10, 10, None] and thor["median_steps"] == 10
    assert thor["median_seconds"] == 2.0 and adam["median_seconds"] == 2.0
    assert s["steps_ratio"] == pytest.approx(0.5) and s["seconds_ratio"] == pytest.approx(1.0)
    assert s["timing"]["comparable"] and s["timing"]["ratios"]["steady_step"] == pytest.approx(2.0)
    assert thor["median_first_seconds"] == 2.0 and thor["load"] == [0.02] * 3
    assert thor["final"] == pytest.approx(0.88)  # median of 0.9, 0.88, 0.7
    assert s["thor_at_least_as_good"] is True
    # adam's best 1e-2 is at the end of its grid {1e-3, 1e-2}: said so.
    assert any("adam" in w and "end of its grid" in w for w in s["warnings"])


def test_seconds_under_different_loads_are_not_compared():
    """One seed whose THOR run had much less CPU than the baseline's: the seconds ratio is
    refused (None, "not comparable" in the table, the reason in the notes); steps still count."""
    rows = []
    for seed in range(2):
        rows += _rows("w", "adam", 1e-3, seed, [0.1, 0.5, 0.8])
        rows += _rows("w", "thor", 0.0, seed, [0.1, 0.8, 0.9], load=0.5 if seed else 0.03)
    s = suite.summarize_workload(_workload(), rows)
    assert s["steps_ratio"] == pytest.approx(0.5)
    assert s["seconds_ratio"] is None and not s["timing"]["comparable"]
    assert "seed 1" in s["timing"]["reason"] and "50%" in s["timing"]["reason"]
    text = suite.markdown([s], {})
    assert "0.50x, not comparable" in text and "seconds not comparable: seed 1" in text


def test_older_csv_without_timing_columns_combines_as_not_comparable(tmp_path):
    """--combine of a metrics.csv written before the timing columns: read, summarized, and its
    seconds "not comparable" (no load recorded)."""
    old = tmp_path / "old"
    old.mkdir()
    rows = []
    for name in ("thor", "adam"):
        rows += _rows("digits_cnn", name, 0.0 if name == "thor" else 1e-2, 0, [0.1, 0.9, 0.95])
    old_fields = suite.FIELDS[:8]
    with open(old / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=old_fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    read = suite._read_rows(old / "metrics.csv")
    assert read[1]["load"] is None and read[1]["metric"] == 0.9 and read[1]["seed"] == 0
    (summary,) = suite.main(["--quick", "--combine", str(old), "--out", str(tmp_path / "new")])
    assert summary["seconds_ratio"] is None and not summary["timing"]["comparable"]
    assert "no machine load recorded" in summary["timing"]["reason"]


def test_lower_is_better_metric_and_never_reached_median():
    rows = []
    for seed in range(3):
        rows += _rows("w", "adam", 1e-3, seed, [5.0, 3.0, 2.0])
        rows += _rows("w", "thor", 0.0, seed, [5.0, 2.5 if seed == 0 else 4.0, 2.1])
    s = suite.summarize_workload(_workload(higher=False), rows)
    assert s["target"] == 2.0
    thor = s["optimizers"]["thor"]
    assert thor["steps_to_target"] == [None, None, None] and thor["median_steps"] is None
    assert s["steps_ratio"] is None and s["thor_at_least_as_good"] is False
    text = suite.markdown([s], {})
    assert "never" in text and "2.0000" in text


def test_nan_final_never_counts_as_best():
    rows = []
    for seed in range(3):
        rows += _rows("w", "sgd", 1.0, seed, [0.1, 0.9, float("nan")])
        rows += _rows("w", "sgd", 0.1, seed, [0.1, 0.5, 0.6])
    s = suite.summarize_workload(_workload(), rows)
    assert s["optimizers"]["sgd"]["lr"] == 0.1 and s["target"] == pytest.approx(0.6)


def test_batch_order_is_the_seeds_and_drops_the_partial_batch():
    a = suite.batch_order(10, 3, 2, seed=5, single_pass=False)
    assert a.shape == (6, 3)                           # 3 full batches per epoch, 2 epochs
    for epoch in (a[:3], a[3:]):
        assert len(set(epoch.ravel())) == 9            # no row twice within an epoch
    assert np.array_equal(a, suite.batch_order(10, 3, 2, seed=5, single_pass=False))
    assert not np.array_equal(a, suite.batch_order(10, 3, 2, seed=6, single_pass=False))
    rng = np.random.default_rng([5, 2024])
    assert np.array_equal(a[:3].ravel(), rng.permutation(10)[:9])
    assert np.array_equal(suite.batch_order(7, 2, 1, 0, single_pass=True).ravel(), np.arange(6))


def test_eval_steps():
    assert suite.eval_steps(8, 10) == list(range(1, 9))
    assert suite.eval_steps(100, 10) == list(range(10, 101, 10))
    points = suite.eval_steps(351, 10)
    assert len(points) == 10 and points[-1] == 351


def test_baseline_schedule_is_warmup_then_cosine_to_the_floor():
    w = wl.WORKLOADS["digits_cnn"]
    sched = suite.baseline_schedule(0.01, 200, w)          # warmup 10 steps, cosine to 0
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.005, rel=1e-5)
    assert float(sched(10)) == pytest.approx(0.01, rel=1e-5)
    ref = 0.01 * 0.5 * (1 + math.cos(math.pi * (105 - 10) / 190))
    assert float(sched(105)) == pytest.approx(ref, rel=1e-5)
    assert float(sched(200)) == pytest.approx(0.0, abs=1e-9)
    gpt = suite.baseline_schedule(0.01, 200, wl.WORKLOADS["char_gpt"])
    assert float(gpt(200)) == pytest.approx(0.001, rel=1e-5)  # nanoGPT: to lr/10


def test_thor_in_the_suite_is_wrap_with_thor_tf_defaults_and_warmup_cosine():
    import thor_tf

    w = wl.WORKLOADS["tabular_mlp"]
    data = w.load(True)
    model = suite.compiled_model("thor", 0.0, w, data, True, 77, {})
    opt = model.thor_optimizer
    defaults = thor_tf.ThorOptimizer()
    assert opt.config == defaults.config
    assert isinstance(opt._learning_rate, thor_tf.schedules.WarmupCosine)
    # WarmupCosine(77) without a peak: wrap gives it the default rule's rate.
    rule = thor_tf.rules.Eigenbasis()
    assert opt._learning_rate.get_config() == thor_tf.schedules.WarmupCosine(
        77, peak=rule.default_learning_rate, reference_steps=rule.reference_steps).get_config()


def test_a_run_with_use_ema_trains_on_its_weights_and_evaluates_their_moving_average():
    """Keras' ``use_ema`` under THOR, in the suite's segments: the optimizer's averages are the
    float64 moving average of the per-step weights (Keras' rule: the first step's weights, then
    ``a = m·a + (1−m)·w``); a segment's end leaves the trained weights in place (one run in
    segments trains as one fit would), and an evaluation sees the averages and puts the trained
    weights back."""
    import keras

    w = wl.WORKLOADS["tabular_mlp"]
    data = w.load(True)
    momentum = 0.8
    trajectory = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            opt = self.model.optimizer
            trajectory.append([v.numpy().astype(np.float64) for v in opt._trainable_variables])

    keras.utils.set_random_seed(0)
    run = suite.SegmentedRun(w, data, "thor", 0.0, 0, True, 12,
                             thor_options=[("use_ema", True), ("ema_momentum", momentum)],
                             callbacks=[Record()])
    order, plan = suite.segment_plan(w, data, 0, 2)
    for index, _, idx in plan[:2]:
        run.train(index, idx[:6 * w.batch_size])
    opt = run.model.optimizer
    assert len(trajectory) == 12 and int(opt.iterations) == 12
    average = trajectory[0]
    for weights in trajectory[1:]:
        average = [momentum * a + (1 - momentum) * x for a, x in zip(average, weights)]
    trained = [v.numpy() for v in opt._trainable_variables]
    for value, last in zip(trained, trajectory[-1]):
        np.testing.assert_array_equal(value, last.astype(np.float32))   # not finalized
    for got, ref in zip(opt._model_variables_moving_average, average):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - t).max() for a, t in zip(average, trained)) > 1e-3  # they differ
    # The evaluation is of the averaged weights; the trained ones are back after it.
    row = run.evaluate(12, None)
    for variable, value in zip(opt._trainable_variables, trained):
        np.testing.assert_array_equal(variable.numpy(), value)
    x, y = (data.x_train, data.y_train) if w.eval_split == "train" else (data.x_test, data.y_test)
    of_trained = run.model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)[w.metric]
    assert row["metric"] != pytest.approx(of_trained, rel=1e-3)
    for variable, ref in zip(opt._trainable_variables, average):
        variable.assign(ref.astype(np.float32))
    expected = run.model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)[w.metric]
    assert row["metric"] == pytest.approx(expected, rel=1e-5)


def test_autoencoder_loss_is_sigmoid_cross_entropy_summed_over_pixels():
    rng = np.random.default_rng(0)
    y = rng.uniform(size=(5, 12))
    z = rng.normal(size=(5, 12)) * 3
    ref = np.mean(np.sum(np.logaddexp(0.0, z) - y * z, axis=1))   # float64, per example summed
    loss = wl.WORKLOADS["autoencoder"].loss()
    assert float(loss(y.astype("float32"), z.astype("float32"))) == pytest.approx(ref, rel=1e-5)


def test_quick_suite_end_to_end(tmp_path, capsys):
    out = tmp_path / "suite"
    suite.main(["--quick", "--no-download", "--workloads", "digits_cnn,tabular_mlp", "--out",
                str(out)])
    summary = json.loads((out / "suite.json").read_text())
    names = [s["workload"] for s in summary["workloads"]]
    assert names == ["digits_cnn", "tabular_mlp"]
    for s in summary["workloads"]:
        assert set(s["optimizers"]) == {"thor"} | set(wl.WORKLOADS[s["workload"]].quick["baselines"])
        for info in s["optimizers"].values():
            assert info["total_steps"] > 0 and math.isfinite(info["final"])
    digits = summary["workloads"][0]
    assert digits["optimizers"]["thor"]["final"] > 0.5       # 10 classes: chance is 0.1
    text = (out / "suite.md").read_text()
    assert "| digits_cnn" in text and "THOR/best" in text
    assert (out / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --combine joins runs made apart and gives the same summary.
    again = tmp_path / "joined"
    suite.main(["--quick", "--combine", str(out), "--out", str(again)])
    joined = json.loads((again / "suite.json").read_text())
    assert joined["workloads"][0]["target"] == digits["target"]
