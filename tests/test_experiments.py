"""Tests for the experiment scripts: time_to_target, and --quick runs of mnist.py and resnet.py.

The two --quick runs train THOR and SGD for real (digits, tiny) in subprocesses, the way a user runs
the scripts, and check the files they write. Together they take about a minute on 2 CPU cores.
"""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


from thor_tf_experiments import cli, reports
from thor_tf_experiments.reports import time_to_target


# --------------------------------------------------------------------------- time_to_target

CUMULATIVE = [10.0, 21.0, 33.5, 45.0]


def test_time_to_target_reached_at_first_epoch():
    assert time_to_target([0.91, 0.95, 0.96, 0.97], CUMULATIVE, 0.9) == (1, 10.0)


def test_time_to_target_reached_later():
    assert time_to_target([0.5, 0.7, 0.85, 0.9], CUMULATIVE, 0.8) == (3, 33.5)


def test_time_to_target_exactly_equal_counts_as_reached():
    assert time_to_target([0.5, 0.75, 0.8, 0.9], CUMULATIVE, 0.75) == (2, 21.0)


def test_time_to_target_first_crossing_wins_even_if_it_drops_again():
    assert time_to_target([0.5, 0.82, 0.7, 0.9], CUMULATIVE, 0.8) == (2, 21.0)


def test_time_to_target_never_reached():
    assert time_to_target([0.5, 0.6, 0.7, 0.79], CUMULATIVE, 0.8) == (None, None)
    assert time_to_target([], [], 0.8) == (None, None)
    assert time_to_target([float("nan"), float("nan")], [1.0, 2.0], 0.1) == (None, None)


def test_time_to_target_without_target_and_bad_lengths():
    assert time_to_target([0.9], [1.0], None) == (None, None)
    with pytest.raises(ValueError, match="same length"):
        time_to_target([0.9, 0.95], [1.0], 0.5)


def test_median_or_none_counts_never_as_infinite():
    assert reports.median_or_none([3, 1, 2]) == 2
    assert reports.median_or_none([1, None, 2]) == 2      # 2 of 3 seeds reached it
    assert reports.median_or_none([1, None, None]) is None  # most seeds never reached it
    assert reports.median_or_none([]) is None


def test_lr_grid_parsing():
    grid = cli.parse_lr_grid(["sgd=0.5,0.1", "adam=1e-4"], cli.DEFAULT_LR_GRID)
    assert grid == {**cli.DEFAULT_LR_GRID, "sgd": (0.5, 0.1), "adam": (1e-4,)}
    grid = cli.parse_lr_grid(["adam=1e-4;sgd=0.2;adamw=3e-3"], cli.DEFAULT_LR_GRID)
    assert grid == {"sgd": (0.2,), "adam": (1e-4,), "adamw": (3e-3,)}
    assert cli.parse_lr_grid(None, cli.DEFAULT_LR_GRID) == cli.DEFAULT_LR_GRID
    with pytest.raises(Exception, match="applies to sgd, adam and adamw"):
        cli.parse_lr_grid(["thor=0.1"], cli.DEFAULT_LR_GRID)


# --------------------------------------------------------------------------- --quick runs

def _run_quick(script, out, optimizers):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")  # the scripts import the installed packages
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / script), "--quick", "--optimizers", optimizers,
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _check_outputs(out, optimizers, epochs, stdout, baseline="sgd"):
    with open(out / "metrics.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == reports.CSV_FIELDS
        rows = list(reader)
    seen = {r["optimizer"] for r in rows}
    assert seen == set(optimizers)
    for row in rows:
        assert 1 <= int(row["epoch"]) <= epochs
        assert 0.0 <= float(row["test_acc"]) <= 1.0
        assert math.isfinite(float(row["train_loss"]))
        assert float(row["epoch_seconds"]) > 0
        assert float(row["cumulative_seconds"]) >= float(row["epoch_seconds"]) - 1e-6
        assert float(row["lr"]) > 0
        refreshes = int(row["refreshes"])
        assert refreshes > 0 if row["optimizer"].startswith("thor") else refreshes == 0
    for name in optimizers:  # every (lr, seed) run has all its epochs
        for key in {(r["lr"], r["seed"]) for r in rows if r["optimizer"] == name}:
            epochs_seen = sorted(int(r["epoch"]) for r in rows
                                 if r["optimizer"] == name and (r["lr"], r["seed"]) == key)
            assert epochs_seen == list(range(1, epochs + 1))

    summary = json.loads((out / "summary.json").read_text())
    for key in ("target", "target_source", "optimizers", "args", "date", "device", "tensorflow",
                "dataset", "model"):
        assert key in summary, key
    assert summary["args"]["quick"] is True
    assert list(summary["optimizers"]) == optimizers
    for name in optimizers:
        entry = summary["optimizers"][name]
        for key in ("lr", "epochs_to_target", "seconds_to_target", "final_acc",
                    "mean_step_seconds", "refreshes", "target"):
            assert key in entry, (name, key)
        assert 0.0 <= entry["final_acc"] <= 1.0
        assert entry["target"] == summary["target"]
        assert (entry["epochs_to_target"] is None) == (entry["seconds_to_target"] is None)
    # The default target is the baseline's final accuracy, which that baseline reaches.
    assert summary["target"] == pytest.approx(summary["optimizers"][baseline]["final_acc"])
    assert summary["optimizers"][baseline]["epochs_to_target"] is not None
    assert "layer_stats" in summary["optimizers"]["thor"]

    for fname in reports.PLOT_FILES:
        path = out / fname
        assert path.is_file() and path.stat().st_size > 1000, fname
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target accuracy" in stdout and "optimizer" in stdout


def test_mnist_quick(tmp_path):
    out = tmp_path / "mnist"
    stdout = _run_quick("mnist.py", out, "thor,sgd")
    _check_outputs(out, ["thor", "sgd"], epochs=2, stdout=stdout)
    assert "epoch 2/2" in stdout and "test_acc" in stdout


def test_resnet_quick(tmp_path):
    out = tmp_path / "resnet"
    stdout = _run_quick("resnet.py", out, "thor,sgd")
    _check_outputs(out, ["thor", "sgd"], epochs=1, stdout=stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "resnet20"
    assert summary["dataset"]["input_shape"][:2] == [32, 32]


def test_transformer_quick(tmp_path):
    """The ViT script: every layer type with a block is registered, AdamW is the target."""
    out = tmp_path / "transformer"
    stdout = _run_quick("transformer.py", out, "thor,adamw")
    _check_outputs(out, ["thor", "adamw"], epochs=2, stdout=stdout, baseline="adamw")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "vit"
    kinds = {s["kind"] for s in summary["optimizers"]["thor"]["layer_stats"]}
    assert {"conv2d", "dense"} <= kinds
