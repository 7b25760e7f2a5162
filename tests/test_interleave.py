"""experiments.interleave: THOR and the best baseline trained in one process, segment by
segment in turn (scripts/bench_interleaved.py's record, docs/results/suite.json)."""

from pathlib import Path

import numpy as np
import pytest

from experiments import interleave

ROOT = Path(__file__).resolve().parents[1]


def test_interleaved_pairs_seeds_and_trains_as_the_suite(tmp_path):
    """The interleaved benchmark: segment order alternates by segment and seed; the per-seed
    ratios of seconds to the target and their median (a seed where one side never got there has
    none); bad arguments are refused naming them; its quick run writes JSON and a PNG, and
    THOR's evaluations there are those of the suite's own run of the same seed (training
    interleaved with the baseline's changes no value)."""
    import argparse
    import json

    bench = interleave
    chosen = bench.best_baselines(ROOT / "docs" / "results" / "suite_grid.json")
    assert set(chosen) >= {"tabular_mlp", "fashion_cnn"}
    assert all(opt in ("sgd", "adam", "adamw", "muon") and rate > 0 for opt, rate in chosen.values())
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
    written = json.loads(out.read_text())
    # The record says what made it: the command regenerates it through the script.
    assert written["command"] == f"python scripts/bench_interleaved.py --quick --out {out}"
    assert written["machine"] and written["date"] and "commit" in written
    result = written["results"]["tabular_mlp"]
    assert (tmp_path / "interleaved.png").exists()
    thor_rows = [r for r in result["rows"] if r["optimizer"] == "thor"]
    base_rows = [r for r in result["rows"] if r["optimizer"] == result["baseline"]]
    assert [r["step"] for r in thor_rows] == [r["step"] for r in base_rows]
    assert len(thor_rows) == 5 and all(b["seconds"] > a["seconds"]
                                       for a, b in zip(thor_rows[1:], thor_rows[2:]))

    from experiments import suite, workloads

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
