"""Tests for the drivers' shared parts (grids, medians) and the main job
(``experiments/mnist.py``): its --quick run trains THOR and the baselines for real (digits,
tiny) through ``main(argv)``, what ``python experiments/mnist.py`` runs, and checks the files
it writes (in this process: a subprocess would cost TensorFlow's import again, ~6 s of CI's
CPU; tests/test_entry_points.py runs each script's argument parsing as its command line does).
"""

import csv
import json
import math

import pytest

from experiments import cli


# --------------------------------------------------------------------------- the main job

def test_main_job_quick_writes_the_suites_record_of_its_runs(tmp_path, capsys):
    """The main job, quick (digits, 2 epochs of 64: 44 steps, 4 evaluations): THOR, SGD and
    Keras' Muon (Keras >= 3.10) through the suite's harness. metrics.csv holds every evaluation
    of every run (step 0 and 4 more); main_job.json is the suite's summary of the workload (the
    target is the better baseline's median final accuracy, which it reaches; THOR's steps and
    seconds to it); a line per evaluation and THOR's registration table are printed; the README
    row reads the record."""
    import keras

    from experiments import mnist, report, suite

    names = ["thor", "sgd", "muon"] if hasattr(keras.optimizers, "Muon") else ["thor", "sgd"]
    out = tmp_path / "mnist"
    mnist.main(["--quick", "--optimizers", ",".join(names), "--out", str(out)])
    stdout = capsys.readouterr().out
    with open(out / "metrics.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == suite.FIELDS
        rows = list(reader)
    assert {r["optimizer"] for r in rows} == set(names)
    for name in names:
        steps = [int(r["step"]) for r in rows if r["optimizer"] == name]
        assert steps == [0, 11, 22, 33, 44], (name, steps)
    assert all(0.0 <= float(r["metric"]) <= 1.0 for r in rows)
    record = json.loads((out / "main_job.json").read_text())
    for key in ("commit", "command", "seeds", "evals", "epochs", "batch_size", "dataset",
                "environment", "workload"):
        assert key in record, key
    summary = record["workload"]
    assert summary["metric"] == "accuracy" and set(summary["optimizers"]) == set(names)
    leader = summary["best_baseline"]
    finals = {n: summary["optimizers"][n]["final"] for n in names[1:]}
    assert leader == max(finals, key=finals.get) and summary["target"] == finals[leader]
    assert summary["optimizers"][leader]["median_steps"] is not None
    assert summary["optimizers"]["thor"]["total_steps"] == 44
    assert summary["optimizers"]["sgd"]["lr"] == mnist.QUICK_LR_GRID["sgd"][0]
    if "muon" in names:
        assert summary["optimizers"]["muon"]["final"] > 0.5
    table = (out / "main_job.md").read_text()
    assert f"| main_job (accuracy, target {100 * summary['target']:.2f}%) | thor |" in table
    assert (out / "main_job.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "thor_tf: 4 layers with Kronecker blocks" in stdout
    assert "[main_job thor seed=0] step 44/44  accuracy" in stdout
    assert "[main_job sgd lr=0.1 seed=0] step 22/44" in stdout
    row = report.main_job_row({**record, "_path": "r.json"}, "main job")
    assert row["steps"] == 44 and row["seeds"] == 1 and row["thor"].endswith("%")


def test_main_job_runs_the_suites_cnn_recipe_at_its_own_sizes():
    """The main job is the suite's CNN workload (model, loss, metric, the baselines' recipe) at
    its own epochs, batch, data and grids: Fashion-MNIST 3 epochs of 128 with Adam and Muon at
    3e-3, 1e-2 and 3e-2; digits 10 epochs of 64 over the suite's bracketing grids."""
    from experiments import datasets, mnist, workloads as wl

    args = mnist.parse_args(["--optimizers", "thor,adam,adamw", "--dataset", "fashion_mnist"])
    assert (args.epochs, args.batch_size, args.seeds, args.evals) == (3, 128, [0], 10)
    assert args.lr_grid["adam"] == mnist.LR_GRID["adam"] == (3e-3, 1e-2, 3e-2)
    assert not args.tune_first_seed
    args = mnist.parse_args(["--dataset", "digits", "--lr-grid", "adam=0.05"])
    assert (args.epochs, args.batch_size) == (mnist.DIGITS_EPOCHS, mnist.DIGITS_BATCH) == (10, 64)
    assert args.lr_grid["adam"] == (0.05,) and args.lr_grid["muon"] == (3e-3, 1e-2, 3e-2)
    assert mnist.parse_args(["--dataset", "digits", "--epochs", "2"]).epochs == 2
    ds = datasets.load_dataset("digits", verbose=False, seed=0)
    workload, data = mnist.main_job_workload(
        mnist.parse_args(["--dataset", "digits", "--optimizers", "thor,adam"]), ds)
    base = wl.WORKLOADS["digits_cnn"]
    assert (workload.loss, workload.metric, workload.weight_decay) == (
        base.loss, base.metric, base.weight_decay)
    assert workload.baselines == {"adam": (1e-2, 3e-2, 0.1)} and data.num_train == ds.num_train
    assert (workload.epochs, workload.batch_size) == (10, 64)
    with pytest.raises(SystemExit):
        mnist.parse_args(["--optimizers", "thor,kfac"])
    with pytest.raises(SystemExit, match="--lr-grid"):
        mnist.parse_args(["--dataset", "digits", "--lr-grid", "thor=0.1"])
    with pytest.raises(SystemExit, match="--evals must be >= 1"):
        mnist.parse_args(["--dataset", "digits", "--evals", "0"])


def test_muon_on_a_keras_without_it_says_so(monkeypatch):
    import keras

    monkeypatch.delattr(keras.optimizers, "Muon", raising=False)
    from experiments import mnist
    with pytest.raises(SystemExit, match=r"keras.optimizers.Muon \(Keras >= 3.10\)"):
        mnist.parse_args(["--optimizers", "thor,muon", "--dataset", "digits"])
    assert mnist.parse_args(["--optimizers", "thor,adam", "--dataset", "digits"]).optimizers == [
        "thor", "adam"]


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


def test_default_thor_peak_is_what_wrap_gives_a_run_of_its_length():
    """``cli.default_thor_peak(T)`` (the studies' THOR peak) is the peak of wrap(model,
    learning_rate=WarmupCosine(T)): 3e-2 up to 256 steps (digits: 10 epochs of 23 steps), and
    3e-2·sqrt(256/T) beyond (Fashion-MNIST: 3 epochs of 469 steps, 1.28e-2)."""
    assert cli.default_thor_peak(230) == pytest.approx(0.03, rel=1e-12)
    assert cli.default_thor_peak(3 * 469) == pytest.approx(0.03 * math.sqrt(256 / 1407), rel=1e-12)
    assert cli.default_thor_peak(300) == pytest.approx(0.03 * math.sqrt(256 / 300), rel=1e-12)
