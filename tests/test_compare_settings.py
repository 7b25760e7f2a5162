"""scripts/compare_settings.py: the target, epochs/seconds to it and mean ± sd over seeds, on
hand-written metrics.csv files whose answers are worked out here."""

import csv
import importlib.util
import json
import os
import statistics

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["optimizer", "lr", "seed", "epoch", "train_loss", "test_loss", "test_acc",
          "epoch_seconds", "cumulative_seconds", "refreshes"]


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location(
        "compare_settings", os.path.join(ROOT, "scripts", "compare_settings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(directory, runs):
    """``runs``: {(optimizer, lr, seed): [accuracy per epoch]}; 10 s per epoch, 3 refreshes each."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        writer.writeheader()
        for (optimizer, lr, seed), accs in runs.items():
            for epoch, acc in enumerate(accs, 1):
                writer.writerow({"optimizer": optimizer, "lr": lr, "seed": seed, "epoch": epoch,
                                 "train_loss": 0, "test_loss": 0, "test_acc": acc,
                                 "epoch_seconds": 10, "cumulative_seconds": 10 * epoch,
                                 "refreshes": 3 * epoch if optimizer == "thor" else 0})


def test_target_is_the_best_baselines_median_final_and_settings_are_judged_against_it(cs, tmp_path):
    base, variant = str(tmp_path / "base"), str(tmp_path / "variant")
    _write(base, {
        # adam 1e-3: finals 0.80, 0.84, 0.82 -> median 0.82; adam 3e-3: median 0.79 -> 1e-3 kept.
        ("adam", 1e-3, 0): [0.70, 0.75, 0.80], ("adam", 1e-3, 1): [0.72, 0.80, 0.84],
        ("adam", 1e-3, 2): [0.71, 0.78, 0.82],
        ("adam", 3e-3, 0): [0.70, 0.75, 0.79], ("adam", 3e-3, 1): [0.70, 0.75, 0.79],
        ("adam", 3e-3, 2): [0.70, 0.75, 0.79],
        # sgd: median final 0.81 < adam's 0.82, so adam sets the target.
        ("sgd", 0.1, 0): [0.6, 0.7, 0.81], ("sgd", 0.1, 1): [0.6, 0.7, 0.81],
        ("sgd", 0.1, 2): [0.6, 0.7, 0.81],
        ("thor", 0.02, 0): [0.80, 0.83, 0.85], ("thor", 0.02, 1): [0.79, 0.81, 0.84],
        ("thor", 0.02, 2): [0.78, 0.80, 0.86],
    })
    _write(variant, {("thor", 0.02, s): [0.75, 0.79, 0.81] for s in (0, 1, 2)})
    name, settings, baselines = cs.parse_model(
        f"cnn|a={base}:thor|b={variant}:thor|baselines={base}")
    result = cs.compare(name, settings, baselines)
    assert result["target"] == pytest.approx(0.82)
    assert result["target_from"] == "adam lr 0.001"
    a = result["settings"]["a"]
    assert a["final_mean"] == pytest.approx(statistics.fmean([0.85, 0.84, 0.86]))
    assert a["final_sd"] == pytest.approx(statistics.stdev([0.85, 0.84, 0.86]))
    assert a["acc_per_epoch"][0]["mean"] == pytest.approx(0.79)
    # 0.83 >= 0.82 at epoch 2 on seed 0; seed 1 at epoch 3 (0.81 < 0.82); seed 2 at epoch 3.
    assert [r["epochs"] for r in a["to_target"].values()] == [2, 3, 3]
    assert a["epochs_to_target_median"] == 3 and a["seconds_to_target_median"] == 30
    assert a["refreshes"] == [9, 9, 9]
    # Adam's own seeds: 0 never reaches 0.82 (final 0.80), 1 and 2 at epoch 3.
    adam = result["settings"]["adam"]
    assert [None if r is None else r["epochs"] for r in adam["to_target"].values()] == [None, 3, 3]
    assert a["seconds_vs_best_baseline"] == pytest.approx(1.0)
    # Seed by seed against that seed's best baseline: seed 0 SGD (0.81 > Adam's 0.80, first
    # reached at epoch 3), seeds 1 and 2 Adam (0.84, 0.82 at epoch 3).
    pairs = a["paired"]
    assert [p["baseline"] for p in pairs.values()] == ["sgd", "adam", "adam"]
    assert [p["epochs"] for p in pairs.values()] == [2, 3, 3]
    assert pairs[0]["epochs_ratio"] == pytest.approx(2 / 3)
    assert pairs[0]["seconds_ratio"] == pytest.approx(20 / 30)
    assert pairs[1]["epochs_ratio"] == pytest.approx(1.0)
    b = result["settings"]["b"]
    assert b["epochs_to_target_median"] is None and b["seconds_vs_best_baseline"] is None
    assert "| a | 85.00 ± 1.00 % (85.00 / 84.00 / 86.00)" in cs.markdown(result)


def test_main_writes_json_and_png(cs, tmp_path):
    base = str(tmp_path / "base")
    _write(base, {("adam", 1e-3, 0): [0.5, 0.6], ("thor", 0.02, 0): [0.55, 0.65]})
    out = str(tmp_path / "out" / "cmp")
    cs.main(["--model", f"mlp|thor={base}:thor|baselines={base}", "--out", out, "--note", "x"])
    data = json.load(open(out + ".json"))
    assert data["note"] == "x" and data["models"][0]["target"] == pytest.approx(0.6)
    assert os.path.getsize(out + ".png") > 1000


def test_bad_setting_is_a_clear_error(cs):
    with pytest.raises(SystemExit, match="LABEL=DIR:OPTIMIZER"):
        cs.parse_model("cnn|oops|baselines=x")
