"""Tests for the experiment scripts: time_to_target, and --quick runs of mnist.py.

The --quick runs train THOR and the baselines for real (digits, tiny) through each script's
``main(argv)``, what ``python experiments/<script>.py`` runs, and check the files they write (in
this process: a subprocess would cost every run TensorFlow's import again, ~6 s of CI's CPU;
tests/test_entry_points.py runs each script's argument parsing as its command line does).
"""

import csv
import importlib
import json
import math

import pytest

from experiments import cli, reports
from experiments.reports import time_to_target


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
    assert grid == {**cli.DEFAULT_LR_GRID, "sgd": (0.2,), "adam": (1e-4,), "adamw": (3e-3,)}
    assert cli.parse_lr_grid(None, cli.DEFAULT_LR_GRID) == cli.DEFAULT_LR_GRID
    with pytest.raises(Exception, match="applies to sgd, adam, adamw, muon"):
        cli.parse_lr_grid(["thor=0.1"], cli.DEFAULT_LR_GRID)
    assert cli.parse_lr_grid(["muon=1e-2"], cli.DEFAULT_LR_GRID)["muon"] == (1e-2,)


def test_muon_is_a_first_order_baseline_with_keras_default_lr_in_its_grid():
    assert "muon" in cli.OPTIMIZERS and "muon" in cli.FIRST_ORDER
    assert cli.DEFAULT_LR_GRID["muon"] == (1e-3, 3e-3, 1e-2, 3e-2)
    assert cli.parse_optimizers("thor,adam,muon") == ["thor", "adam", "muon"]
    # A script's grid that leaves an optimizer out gets this module's (mnist.py names only sgd
    # and adam; adamw used to fail there with a KeyError).
    from experiments import mnist
    args = mnist.parse_args(["--optimizers", "thor,adamw,muon", "--dataset", "fashion_mnist"])
    assert args.lr_grid["muon"] == mnist.LR_GRID["muon"] == (3e-3, 1e-2)  # the main job's
    assert args.lr_grid["adamw"] == cli.DEFAULT_LR_GRID["adamw"]
    assert args.lr_grid["adam"] == mnist.LR_GRID["adam"]
    assert (args.epochs, args.batch_size) == (3, 128)
    # The digits fallback: longer (3 epochs of 128 are 33 steps) and its own, higher rates.
    args = mnist.parse_args(["--dataset", "digits"])
    assert (args.epochs, args.batch_size) == (mnist.DIGITS_EPOCHS, mnist.DIGITS_BATCH) == (10, 64)
    assert args.lr_grid["adam"] == (1e-2, 3e-2) and args.lr_grid["muon"] == (1e-2, 3e-2)
    assert mnist.parse_args(["--dataset", "digits", "--epochs", "2"]).epochs == 2
    import keras
    if hasattr(keras.optimizers, "Muon"):
        import inspect
        default = inspect.signature(keras.optimizers.Muon.__init__).parameters["learning_rate"]
        assert default.default in cli.DEFAULT_LR_GRID["muon"]


def _result(name, lr, acc):
    return reports.RunResult(name, lr, 0, rows=[{"test_acc": acc, "cumulative_seconds": 1.0}])


def test_default_target_is_the_best_of_all_first_order_baselines_muon_and_adamw_included():
    results = [_result("thor", 0.02, 0.95), _result("sgd", 0.1, 0.80), _result("adam", 1e-3, 0.85),
               _result("adamw", 1e-3, 0.86), _result("muon", 1e-3, 0.90),
               _result("muon", 3e-3, 0.87)]
    target, source = reports.choose_target(results, None)
    assert target == 0.90 and "muon" in source and "lr=0.001" in source
    target, source = reports.choose_target(results[:-2], None)
    assert target == 0.86 and "adamw" in source
    target, _ = reports.choose_target(results, None, target_from="adam")
    assert target == 0.85
    target, source = reports.choose_target(results[:1], None)
    assert target is None and "sgd/adam/adamw/muon" in source


# --------------------------------------------------------------------------- --quick runs

def _run_quick(capsys, script, out, optimizers, *extra):
    module = importlib.import_module(f"experiments.{script}")
    module.main(["--quick", "--optimizers", optimizers, "--out", str(out), *extra])
    return capsys.readouterr().out


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


def test_mnist_quick_with_sgd_and_muon(tmp_path, capsys):
    """The main job's script, quick: THOR, SGD and keras.optimizers.Muon (Keras >= 3.10; one run
    of the script for both baselines, CI's time). Muon trains (digits, 2 epochs of 23 steps, lr
    3e-3: well above the 10 % of chance), appears in metrics.csv and the summary; the target is
    the better baseline's final accuracy."""
    import keras

    with_muon = hasattr(keras.optimizers, "Muon")
    names = ["thor", "sgd", "muon"] if with_muon else ["thor", "sgd"]
    out = tmp_path / "mnist"
    stdout = _run_quick(capsys, "mnist", out, ",".join(names),
                        *(["--lr-grid", "muon=3e-3"] if with_muon else []))
    summary = json.loads((out / "summary.json").read_text())
    finals = {n: summary["optimizers"][n]["final_acc"] for n in names[1:]}
    _check_outputs(out, names, epochs=2, stdout=stdout, baseline=max(finals, key=finals.get))
    assert "epoch 2/2" in stdout and "test_acc" in stdout
    if not with_muon:
        pytest.skip(f"keras.optimizers.Muon needs Keras >= 3.10; this is Keras {keras.__version__}")
    muon = summary["optimizers"]["muon"]
    assert muon["lr"] == pytest.approx(3e-3)
    assert muon["final_acc"] > 0.5, muon
    assert muon["refreshes"] == 0
    with open(out / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["optimizer"] == "muon"]
    assert len(rows) == 2 and float(rows[-1]["train_loss"]) < math.log(10), rows
    assert "[muon lr=0.003 seed=0] epoch 2/2" in stdout


def test_muon_baseline_optimizer_settings():
    """make_model's Muon: Keras' Muon with the output layer on its AdamW step, weight decay as
    AdamW's (Keras' 0.004 unless --weight-decay), none on biases."""
    import argparse

    import keras

    if not hasattr(keras.optimizers, "Muon"):
        pytest.skip(f"keras.optimizers.Muon needs Keras >= 3.10; this is Keras {keras.__version__}")
    from experiments import models, runner

    args = argparse.Namespace(lr_schedule="constant", baseline_lr_schedule=None, epochs=1,
                              weight_decay=0.0)
    model = runner.make_model("muon", 1e-3, lambda: models.build("cnn", (8, 8, 1), 10), args,
                              steps_per_epoch=1, show_table=False)
    opt = model.optimizer
    assert isinstance(opt, keras.optimizers.Muon)
    assert float(opt.learning_rate) == pytest.approx(1e-3)
    assert opt.weight_decay == pytest.approx(cli.MUON_WEIGHT_DECAY)
    assert opt.adam_weight_decay == pytest.approx(cli.MUON_WEIGHT_DECAY)
    adamw_step = {v.path: opt._should_use_adamw(v) for v in model.trainable_variables}
    assert adamw_step["dense1/kernel"] is False         # 2-D hidden kernel: the Muon step
    assert adamw_step["predictions/kernel"] is True     # output layer excluded
    assert adamw_step["conv1/kernel"] is True           # 4-D kernel: Keras' Muon uses AdamW
    assert not opt._use_weight_decay(model.get_layer("dense1").bias)
    assert opt._use_weight_decay(model.get_layer("dense1").kernel)


def test_muon_on_a_keras_without_it_says_so(monkeypatch):
    import keras

    monkeypatch.delattr(keras.optimizers, "Muon", raising=False)
    from experiments import mnist
    with pytest.raises(SystemExit, match=r"keras.optimizers.Muon \(Keras >= 3.10\)"):
        mnist.parse_args(["--optimizers", "thor,muon"])
    assert mnist.parse_args(["--optimizers", "thor,adam"]).optimizers == ["thor", "adam"]


def test_damping_split_and_max_block_age_flags_reach_the_thor_optimizer():
    import argparse

    from experiments import models, runner

    from experiments import mnist
    assert mnist.parse_args([]).damping_split is None
    # --damping-split is the inverse rule's option (the default rule refuses it).
    with pytest.raises(ValueError, match="`damping_split` is an option of the inverse rule"):
        runner.make_model("thor", 0.02, lambda: models.build("mlp", (8, 8, 1), 10),
                          mnist.parse_args(["--damping-split", "pi"]), steps_per_epoch=1,
                          show_table=False)
    args = mnist.parse_args(["--damping-split", "pi", "--update-rule", "inverse"])
    assert args.damping_split == "pi"
    model = runner.make_model("thor", 0.02, lambda: models.build("mlp", (8, 8, 1), 10), args,
                              steps_per_epoch=1, show_table=False)
    assert model.optimizer.damping_split == "pi"
    args = argparse.Namespace(**{**vars(args), "damping_split": None})
    model = runner.make_model("thor", 0.02, lambda: models.build("mlp", (8, 8, 1), 10), args,
                              steps_per_epoch=1, show_table=False)
    assert model.optimizer.damping_split == "sqrt"
    assert model.optimizer.max_block_age == 50  # the library's default
    # A value other than the default (50): the flag, not the default, sets it.
    args = mnist.parse_args(["--max-block-age", "7"])
    model = runner.make_model("thor", 0.02, lambda: models.build("mlp", (8, 8, 1), 10), args,
                              steps_per_epoch=1, show_table=False)
    assert model.optimizer.max_block_age == 7
    args = mnist.parse_args(["--max-block-age", "none"])
    model = runner.make_model("thor", 0.02, lambda: models.build("mlp", (8, 8, 1), 10), args,
                              steps_per_epoch=1, show_table=False)
    assert model.optimizer.max_block_age is None  # the trace rule alone
    with pytest.raises(SystemExit):
        mnist.parse_args(["--max-block-age", "0"])


def test_main_job_without_fashion_mnist_runs_digits_on_three_seeds(monkeypatch, capsys):
    """No local Fashion-MNIST and no download (the tests never download): digits, said in one
    line, with 3 seeds (medians) unless --seeds or --quick say otherwise."""
    from experiments import datasets

    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", "/nonexistent/fashion-mnist")
    monkeypatch.setattr(datasets, "KERAS_DATASETS_DIRS", ("/nonexistent/keras/datasets",))
    from experiments import mnist
    args = mnist.parse_args([])
    assert args.dataset == "digits" and args.seeds == [0, 1, 2]
    assert (args.epochs, args.batch_size) == (mnist.DIGITS_EPOCHS, mnist.DIGITS_BATCH)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "using digits" in lines[0] and "downloads are off" in lines[0]
    assert mnist.parse_args(["--seeds", "4"]).seeds == [4]
    assert mnist.parse_args(["--quick"]).seeds == [0]
    assert mnist.parse_args(["--dataset", "fashion_mnist"]).seeds == [0]


def test_the_main_jobs_default_thor_rate_is_what_wrap_gives_a_run_of_its_length():
    """Without --thor-lr the main job gives THOR the peak of wrap(model,
    learning_rate=WarmupCosine(T)): 3e-2 up to 256 steps (digits: 10 epochs of 23 steps), and
    3e-2·sqrt(256/T) beyond (Fashion-MNIST: 3 epochs of 469 steps, 1.28e-2)."""
    from experiments import mnist

    assert cli.default_thor_peak(230) == pytest.approx(0.03, rel=1e-12)
    assert cli.default_thor_peak(3 * 469) == pytest.approx(0.03 * math.sqrt(256 / 1407), rel=1e-12)
    assert cli.default_thor_peak(300) == pytest.approx(0.03 * math.sqrt(256 / 300), rel=1e-12)
    assert mnist.parse_args(["--dataset", "digits"]).thor_lr == [None]  # resolved in main
    assert mnist.parse_args(["--dataset", "digits", "--thor-lr", "0.01"]).thor_lr == [0.01]
