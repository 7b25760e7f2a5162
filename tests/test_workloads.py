"""experiments.workloads: a workload is one entry in one registry, and every tool reads it there."""

import json

import numpy as np

from experiments import report, suite, workloads as wl


def _toy_data(quick):
    """A linear teacher y = x·w with noise: 192 training and 64 held-out rows of 6 features."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(256, 1))).astype("float32")
    return wl.Data(x[:192], y[:192], x[192:], y[192:], "toy linear teacher: 192 train / 64 test")


def _toy_model(data, quick):
    import keras

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="predictions")(hidden))


TOY = wl.Workload("toy_teacher", "MLP on a linear teacher (192 train)", _toy_data, _toy_model,
                  lambda: "mse", "loss", False, batch_size=32, epochs=4,
                  baselines={"adam": (1e-2,)}, label="toy teacher (MSE)", metric_format="loss")


def test_a_new_workload_is_one_registry_entry(tmp_path, monkeypatch):
    """Registered in ``ALL_WORKLOADS`` and nowhere else: the suite trains it (THOR and its
    baseline, the suite's rows and summary) and the report names it as the entry says."""
    monkeypatch.setitem(wl.ALL_WORKLOADS, TOY.name, TOY)
    summaries = suite.main(["--workloads", TOY.name, "--seeds", "0", "--evals", "2",
                            "--out", str(tmp_path)])
    (summary,) = summaries
    assert summary["workload"] == TOY.name and summary["best_baseline"] == "adam"
    record = json.loads((tmp_path / "suite.json").read_text())
    assert record["data"] == {TOY.name: "toy linear teacher: 192 train / 64 test"}
    rows = [r for r in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    assert len(rows) == 2 * 3  # THOR and Adam, step 0 and two evaluations each
    # Both learn the teacher: the held-out MSE falls well below its value at step 0 (the
    # targets' variance, about |w|² ≈ 6).
    first = np.var(_toy_data(False).y_test)
    for name in ("thor", "adam"):
        final = summary["optimizers"][name]["final"]
        assert np.isfinite(final) and final < 0.5 * first, (name, final, first)
    assert report.workload_format(TOY.name) == ("toy teacher (MSE)", "loss")
    assert report.workload_format("no_such_workload") == ("no_such_workload", "num")


def test_every_workload_declares_what_the_tools_read():
    """Names match their keys; each has a baseline grid, a metric direction and a known format."""
    for name, w in wl.ALL_WORKLOADS.items():
        assert w.name == name and w.title and w.baselines, name
        assert w.metric_format in ("acc", "loss", "loss1", "num"), name
        assert w.eval_split in ("test", "train"), name
    for name in wl.WORKLOADS:  # the suite's: README's table names them
        assert wl.WORKLOADS[name].label, name
