"""The entry points in scripts/: their formulas against hand computations, and their quick runs
(a broken entry point is found at once)."""

import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    """The entry point ``scripts/<name>.py`` as the module ``scripts.<name>``."""
    return importlib.import_module(f"scripts.{name}")


def test_bench_first_fit_medians_and_ratios():
    bf = _load("bench_first_fit")
    runs = []
    for opt, seconds, trace in (("sgd", [1.0, 3.0, 2.0], 0.5), ("adam", [1.5, 1.5, 9.0], 0.25),
                                ("thor", [3.0, 4.0, 5.0], 1.0)):
        for s in seconds:
            runs.append({"model": "digits", "optimizer": opt, "first_epoch_s": s,
                         "trace_python_s": trace, "train_step_traces": 1, "graph_nodes": 10,
                         "library_nodes": 30 if opt == "thor" else 0,
                         "library_functions": 2, "total_nodes": 40 if opt == "thor" else 10})
    summary = bf.summarize(runs, ["sgd", "adam", "thor"])["digits"]
    rows = summary["optimizers"]
    # Medians: SGD 2.0, Adam 1.5 (the best baseline), THOR 4.0.
    assert summary["best_baseline"] == "adam"
    assert rows["thor"]["first_epoch_s"] == 4.0 and rows["thor"]["runs"] == 3
    assert rows["thor"]["vs_sgd"] == pytest.approx(2.0)
    assert rows["thor"]["vs_best_baseline"] == pytest.approx(4.0 / 1.5)
    assert rows["adam"]["vs_sgd"] == pytest.approx(0.75)
    assert rows["thor"]["trace_python_vs_sgd"] == pytest.approx(2.0)
    assert rows["thor"]["nodes_vs_sgd"] == pytest.approx(4.0)


def test_bench_first_fit_runs_the_main_jobs_first_epoch_in_fresh_processes(tmp_path):
    """Its smallest run: one fresh process each for THOR and Adam on the main job's digits run.
    The record holds both, with THOR's first epoch over Adam's (the run's best baseline), one
    trace of THOR's step, and the command that made it."""
    import json

    bf = _load("bench_first_fit")
    out = tmp_path / "first_fit.json"
    bf.main(["--models", "digits", "--optimizers", "thor,adam", "--repeats", "1",
             "--out", str(out)])
    record = json.loads(out.read_text())
    entry = record["summary"]["digits"]
    rows = entry["optimizers"]
    assert set(rows) == {"thor", "adam"} and entry["best_baseline"] == "adam"
    assert rows["thor"]["first_epoch_s"] > 0 and rows["thor"]["train_step_traces"] == 1
    assert rows["thor"]["vs_best_baseline"] == pytest.approx(
        rows["thor"]["first_epoch_s"] / rows["adam"]["first_epoch_s"])
    assert "bench_first_fit.py" in record["command"] and record["commit"]


def test_bench_resnet50_step_ratios_and_quick_run(tmp_path):
    """The ResNet-50 step benchmark: medians over repeats and ratios to each reference from
    known numbers; its quick mode (a small CNN, SGD and both THOR variants) writes them."""
    import json

    bench = _load("bench_resnet50_step")
    runs = [{"variant": v, "wall_ms": w, "cpu_ms": c}
            for v, w, c in (("sgd", 10.0, 20.0), ("sgd", 30.0, 40.0), ("sgd", 20.0, 30.0),
                            ("thor", 60.0, 90.0), ("thor", 50.0, 60.0), ("thor", 40.0, 120.0))]
    summary = bench.summarize(runs, ["sgd", "thor"])
    assert summary["sgd"]["cpu_ms"] == 30.0 and summary["thor"]["cpu_ms"] == 90.0
    assert summary["thor"]["cpu_vs_sgd"] == 3.0 and summary["thor"]["wall_vs_sgd"] == 2.5
    assert "cpu_vs_adam" not in summary["thor"]
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--variants", "sgd,lbfgs", "--out", str(tmp_path / "x.json")])
    out = tmp_path / "step.json"
    bench.main(["--quick", "--variants", "sgd,thor,thor_conv_adam", "--out", str(out)])
    result = json.loads(out.read_text())
    assert sorted(result["summary"]) == ["sgd", "thor", "thor_conv_adam"]
    assert len(result["runs"]) == 3
    sgd_cpu = result["summary"]["sgd"]["cpu_ms"]
    for row in result["summary"].values():
        assert row["cpu_ms"] > 0
        assert row["cpu_vs_sgd"] == pytest.approx(row["cpu_ms"] / sgd_cpu, abs=2e-3)
