"""Formulas of the measurement scripts: factor drift (trace vs shape) and the preconditioning
FLOP count, against hand computations."""

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_factor_drift_separates_scale_from_shape():
    fd = _load("factor_drift")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4))
    a0 = x.T @ x / 50
    # A pure rescaling moves the trace, not the shape.
    trace, shape = fd.drift(3.0 * a0, a0)
    assert trace == pytest.approx(2.0) and shape == pytest.approx(0.0, abs=1e-12)
    # A rotation keeps the trace and moves the shape: ‖QᵀA₀Q/t − A₀/t‖ / ‖A₀/t‖.
    q = np.linalg.qr(rng.normal(size=(4, 4)))[0]
    turned = q.T @ a0 @ q
    trace, shape = fd.drift(turned, a0)
    expected = np.linalg.norm(turned - a0) / np.linalg.norm(a0)
    assert trace == pytest.approx(0.0, abs=1e-12) and shape == pytest.approx(expected)
    # A diagonal factor stored as a vector (Embedding's A): normalized by its sum.
    trace, shape = fd.drift(np.array([1.0, 3.0]), np.array([1.0, 1.0]))
    assert trace == pytest.approx(1.0)
    assert shape == pytest.approx(np.linalg.norm([0.25 - 0.5, 0.75 - 0.5]) / np.linalg.norm([0.5, 0.5]))


def test_precondition_flop_count_is_the_two_block_matmuls():
    import tensorflow as tf

    bp = _load("bench_precondition")

    class Layer:
        def __init__(self, nb_a, d_a, nb_g, d_g):
            self.A_inv = tf.zeros([nb_a, d_a, d_a])
            self.G_inv = tf.zeros([nb_g, d_g, d_g])

    class State:
        layers = [Layer(25, 128, 1, 128), Layer(1, 10, 1, 32)]

    class Engine:
        blocks = [object(), object()]
        state = State()

    core, flops, operands = bp.core_products(Engine())
    # dense1-like: A side 25·128²·128 MACs, G side 25·128·128² MACs; conv1-like: 10²·32 + 10·32².
    expected = 2 * (25 * 128 * 128 * 128 + 25 * 128 * 128 * 128) + 2 * (10 * 10 * 32 + 10 * 32 * 32)
    assert flops == expected
    out = core()
    assert [tuple(o.shape) for o in out] == [(3200, 1, 128), (10, 1, 32)]


def test_bench_lm_step_amortized_step_and_ratios():
    bench = _load("bench_lm_step")
    # 9 plain steps of 100 ms and one cadence step of 300 ms per interval of 10.
    assert bench.amortized(100.0, 300.0, 10) == pytest.approx(120.0)
    rounds = {
        "adamw": [{"median_ms": 50.0, "mean_ms": 51.0}, {"median_ms": 60.0, "mean_ms": 61.0},
                  {"median_ms": 55.0, "mean_ms": 56.0}],
        "muon": [{"median_ms": 80.0, "mean_ms": 80.0}] * 3,
        "thor": [{"median_ms": 100.0, "mean_ms": 120.0, "plain_ms": 100.0, "cadence_ms": 300.0},
                 {"median_ms": 110.0, "mean_ms": 130.0, "plain_ms": 110.0, "cadence_ms": None},
                 {"median_ms": 90.0, "mean_ms": 110.0, "plain_ms": 90.0, "cadence_ms": 500.0}],
        "thor_refresh_all": [{"median_ms": 400.0, "mean_ms": 400.0}] * 3,
    }
    summary, ratios = bench.summarize(rounds, frequency=10)
    thor = summary["thor"]
    # Medians over rounds (a round without a cadence point does not count for cadence_ms).
    assert thor["plain_ms"] == 100.0 and thor["cadence_ms"] == 400.0 and thor["mean_ms"] == 120.0
    assert thor["amortized_ms"] == pytest.approx(130.0)                # 100 + 300 / 10
    assert thor["refresh_all_amortized_ms"] == pytest.approx(130.0)    # 100 + (400 − 100) / 10
    assert summary["adamw"]["median_ms"] == 55.0
    assert ratios["thor_vs_adamw"]["amortized_ms"] == pytest.approx(130.0 / 55.0)
    assert ratios["thor_vs_muon"]["plain_ms"] == pytest.approx(100.0 / 80.0)
    assert ratios["thor_vs_muon"]["refresh_all_ms"] == pytest.approx(5.0)
    # Round by round: THOR plain 100/50, 110/60, 90/55 -> median 1.833...
    assert ratios["thor_vs_adamw"]["paired"]["plain_ms"] == pytest.approx(110.0 / 60.0)
    assert ratios["thor_vs_adamw"]["paired"]["refresh_all_ms"] == pytest.approx(400.0 / 55.0)
    # An adaptive cadence has no fixed f: no amortized formula, the measured mean stays.
    summary, _ = bench.summarize(rounds, frequency="adaptive")
    assert summary["thor"]["amortized_ms"] is None and summary["thor"]["mean_ms"] == 120.0


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


def test_plot_peak_horizon_reads_each_runs_last_epoch_and_marks_the_default(tmp_path):
    """The peak-horizon figure: each (optimizer, lr, seed)'s last epoch is its final, a later file
    replaces an earlier one's run, the best baseline rate is the best median, and the default's
    peak at 1,407 steps is 3e-2·sqrt(256/1407)."""
    import json

    plot = _load("plot_peak_horizon")
    header = "optimizer,lr,seed,epoch,test_acc\n"
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    first.write_text(header + "thor,0.01,0,1,0.80\nthor,0.01,0,3,0.92\nthor,0.01,0,2,0.90\n"
                     "muon,0.003,0,3,0.91\nmuon,0.01,0,3,0.89\nthor,0.03,0,3,0.5\n")
    second.write_text(header + "thor,0.03,0,3,0.905\nthor,0.03,1,3,0.915\n")
    runs = plot.finals([str(first), str(second)])
    assert runs[("thor", 0.01)] == {0: 0.92}
    assert runs[("thor", 0.03)] == {0: 0.905, 1: 0.915}
    out = tmp_path / "fig"
    plot.main(["--main-job", str(first), str(second), "--out", str(out),
               "--best", "LM=2000:0.01"])
    report = json.loads((tmp_path / "fig.json").read_text())
    assert report["default"]["at_main_job_length"] == pytest.approx(0.03 * np.sqrt(256 / 1407))
    assert report["baselines"]["muon"]["lr"] == 0.003
    assert [row["median"] for row in report["thor"]] == pytest.approx([0.92, 0.91])
    assert report["best_peaks"][0]["default_peak"] == pytest.approx(0.03 * np.sqrt(256 / 2000))
    assert (tmp_path / "fig.png").stat().st_size > 10_000


def test_bench_ns_xla_quick_compares_the_same_iteration(tmp_path):
    """The Newton–Schulz XLA benchmark: both paths compute the same orthogonalization (to float32
    round-off) and the JSON holds a CPU-time ratio per shape."""
    import json

    bench = _load("bench_ns_xla")
    out = tmp_path / "ns.json"
    bench.main(["--quick", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["dims"] for r in rows] == [[12, 64, 256], [6, 65, 64]]
    for row in rows:
        assert row["max_abs_difference"] < 1e-5
        assert row["xla_over_graph_cpu"] == pytest.approx(
            row["xla"]["cpu_ms"] / row["graph"]["cpu_ms"], rel=1e-2)


def test_bench_ns_spectral_reads_the_rules_buckets_and_compares_both_methods(tmp_path):
    """The spectral-vs-iterate benchmark: the buckets are the rule's own (the tabular MLP's three
    layers), both methods land within float32 round-off of the float64 iteration (singular values
    from 1e-3: the iteration's own float32 error is ~1e-5 of the largest entry there), and the
    JSON's per-step sums are the buckets' sums."""
    import json

    bench = _load("bench_ns_spectral")
    out = tmp_path / "ns.json"
    bench.main(["--workloads", "tabular_mlp", "--repeats", "1", "--out", str(out)])
    (entry,) = json.loads(out.read_text())["workloads"]
    # Each of the three a bucket of one, unpadded and in its own orientation: [11, 64] (10
    # features and the bias, 64 units), the tall [65, 64] and the head's [65, 1].
    assert sorted(b["dims"] for b in entry["buckets"]) == [[1, 11, 64], [1, 65, 1], [1, 65, 64]]
    for method in ("iterate", "spectral"):
        for bucket in entry["buckets"]:
            assert bucket[method]["max_difference"] < 1e-4
        assert entry[method + "_cpu_ms_per_step"] == pytest.approx(
            sum(b[method]["cpu_ms"] for b in entry["buckets"]), abs=2e-3)


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


def test_bench_cadence_share_ratios_and_quick_run(tmp_path):
    """The cadence-share benchmark: THOR's median step away from its cadence points and its mean
    step over the baseline's, from known per-step times (steps 1..20, cadence at 10 and 20, the
    first 4 skipped); the suite's chosen baselines; its quick mode writes JSON and a PNG."""
    import json

    bench = _load("bench_cadence_share")
    # steps 1-4 (skipped) 100 ms; of steps 5..20 the 14 plain ones 7 x 4 then 7 x 6 ms, the
    # cadence points 10 and 20 25 and 45 ms: the plain median is 5 (6 with the cadence points in)
    plain = [s for s in range(5, 21) if s % 10]
    thor = [100.0] * 20
    for n, step in enumerate(plain):
        thor[step - 1] = 4.0 if n < 7 else 6.0
    thor[9], thor[19] = 25.0, 45.0
    base = [100.0] * 4 + [4.0] * 15 + [6.0]
    r = bench.ratios(thor, base, [2 * t for t in thor], [2 * b for b in base])
    assert r["thor_noncadence_median_ms"] == 5.0 and r["thor_cadence_mean_ms"] == 35.0
    assert r["base_median_ms"] == 4.0 and r["noncadence_ratio"] == pytest.approx(5.0 / 4.0)
    # steps 5..20: 7 of 4 ms, 7 of 6 ms and the two cadence points; the baseline 15 x 4 and one 6
    assert r["amortized_ratio"] == pytest.approx(((7 * 4 + 7 * 6 + 70) / 16) / ((15 * 4 + 6) / 16))
    assert r["cpu_amortized_ratio"] == pytest.approx(r["amortized_ratio"])
    chosen = bench.best_baselines(os.path.join(ROOT, "docs", "results", "suite_grid.json"))
    assert chosen["tabular_mlp"][0] in ("sgd", "adam", "adamw", "muon")
    for bad in (["--workloads", "mnist_gan"], ["--steps", "3"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad + ["--out", str(tmp_path / "x.json")])
    out = tmp_path / "share.json"
    bench.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())["results"]["tabular_mlp"]
    assert len(result["repeats"]) == 2 and (tmp_path / "share.png").exists()
    for run in result["repeats"]:
        assert run["noncadence_ratio"] == pytest.approx(
            run["thor_noncadence_median_ms"] / run["base_median_ms"])
        assert run["thor_cadence_mean_ms"] > 0


def test_bench_interleaved_pairs_seeds_and_trains_as_the_suite(tmp_path):
    """The interleaved benchmark: segment order alternates by segment and seed; the per-seed
    ratios of seconds to the target and their median (a seed where one side never got there has
    none); bad arguments are refused naming them; its quick run writes JSON and a PNG, and
    THOR's evaluations there are those of the suite's own run of the same seed (training
    interleaved with the baseline's changes no value)."""
    import argparse
    import json

    bench = _load("bench_interleaved")
    assert [bench.segment_order(i, 0) for i in range(3)] == [(0, 1), (1, 0), (0, 1)]
    assert bench.segment_order(0, 1) == (1, 0)
    summary = {"best_baseline": "muon", "optimizers": {
        "thor": {"seeds": [0, 1, 2], "seconds_to_target": [2.0, None, 3.0]},
        "muon": {"seeds": [0, 1, 2], "seconds_to_target": [4.0, 5.0, None]}}}
    assert bench.paired(summary) == ([0.5, None, None], 0.5)
    summary["optimizers"]["muon"]["seconds_to_target"] = [4.0, 5.0, 2.0]
    summary["optimizers"]["thor"]["seconds_to_target"] = [2.0, 6.0, 3.0]
    assert bench.paired(summary) == ([0.5, 1.2, 1.5], 1.2)
    for bad in (["--workloads", "mnist_gan"], ["--seeds", "a"], ["--evals", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad + ["--out", str(tmp_path / "x.json")])
    out = tmp_path / "interleaved.json"
    bench.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())["results"]["tabular_mlp"]
    assert (tmp_path / "interleaved.png").exists()
    thor_rows = [r for r in result["rows"] if r["optimizer"] == "thor"]
    base_rows = [r for r in result["rows"] if r["optimizer"] == result["baseline"]]
    assert [r["step"] for r in thor_rows] == [r["step"] for r in base_rows]
    assert len(thor_rows) == 5 and all(b["seconds"] > a["seconds"]
                                       for a, b in zip(thor_rows[1:], thor_rows[2:]))

    from thor_tf_experiments import suite, workloads

    workload = workloads.WORKLOADS["tabular_mlp"].sized(True)
    args = argparse.Namespace(quick=True, evals=4, thor_option={})
    alone = suite.train_run(workload, workload.load(True), "thor", 0.0, 0, args, lambda row: None)
    np.testing.assert_allclose([r["metric"] for r in thor_rows], [r["metric"] for r in alone],
                               rtol=1e-6)
    # --thor-option reaches THOR's wrap (and only THOR's): the suite's run with the option.
    split = tmp_path / "split.json"
    bench.main(["--quick", "--thor-option", "split_dim=4", "--out", str(split)])
    record = json.loads(split.read_text())
    assert record["thor_options"] == {"split_dim": 4}
    rows = record["results"]["tabular_mlp"]["rows"]
    args = argparse.Namespace(quick=True, evals=4, thor_option=[("split_dim", 4)])
    alone = suite.train_run(workload, workload.load(True), "thor", 0.0, 0, args, lambda row: None)
    split_rows = [r["metric"] for r in rows if r["optimizer"] == "thor"]
    np.testing.assert_allclose(split_rows, [r["metric"] for r in alone], rtol=1e-6)
    assert split_rows[-1] != thor_rows[-1]["metric"]
    np.testing.assert_allclose([r["metric"] for r in rows if r["optimizer"] != "thor"],
                               [r["metric"] for r in base_rows], rtol=1e-6)
