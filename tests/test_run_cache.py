"""The studies' run cache (experiments/run_cache.py): a run is stored once and read back by its
key, a later line replaces an earlier, a line cut short is skipped, a missing run is trained only
when allowed, and the rows it gives back are the suite's shape."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import run_cache as rc
from experiments import workloads as wl


def _rows(metrics):
    return [{"step": 10 * i, "seconds": float(i), "metric": m, "train_loss": 2 * m,
             "first_seconds": 0.5, "steady_seconds_per_step": 0.01, "load": 1.0}
            for i, m in enumerate(metrics)]


def _workload_and_data(train_rows=64):
    workload = dataclasses.replace(wl.WORKLOADS["tabular_mlp"], batch_size=16, epochs=3)
    data = wl.Data(np.zeros((train_rows, 4), "float32"), np.zeros(train_rows, "int32"),
                   None, None, "")
    return workload, data


def test_total_steps_counts_epochs_of_whole_batches():
    workload, data = _workload_and_data(70)            # 4 whole batches of 16 a pass
    assert rc.total_steps(workload, data) == 12
    assert rc.total_steps(dataclasses.replace(workload, single_pass=True), data) == 4


def test_a_stored_run_is_read_back_and_not_trained_again(tmp_path, monkeypatch):
    workload, data = _workload_and_data()
    trained = []

    def fake_train(w, d, optimizer, lr, seed, quick, evals, log):
        trained.append((optimizer, lr, seed))
        for row in _rows([0.9, 0.5, 0.25 + lr]):
            log(row)

    monkeypatch.setattr(rc, "train_one", fake_train)
    path = tmp_path / "runs.jsonl"
    cache = rc.RunCache(path, quick=True, evals=2)
    assert cache.final(workload, data, "adam", 0.01, 0) == pytest.approx(0.26)
    # 0.01 written another way is the same run: no training.
    assert cache.final(workload, data, "adam", 0.010000000001, 0) == pytest.approx(0.26)
    assert trained == [("adam", 0.01, 0)] and cache.trained == 1
    # A new process reads the file: still no training; a run cut short by a kill is skipped.
    with open(path, "a") as fh:
        fh.write('{"workload": "tabular_mlp", "steps"')
    again = rc.RunCache(path, quick=True, evals=2)
    assert again.final(workload, data, "adam", 0.01, 0) == pytest.approx(0.26)
    assert len(trained) == 1
    run = again.get(workload, data, "adam", 0.01, 0, "sweep")
    assert run["curve"] == [[0, 0.0, 0.9, 1.8], [10, 1.0, 0.5, 1.0], [20, 2.0, 0.26, 0.52]]
    assert (run["steps"], run["batch"], run["first_seconds"]) == (12, 16, 0.5)
    # Another evaluation count, seed or batch is another run.
    assert rc.RunCache(path, quick=True, evals=3).get(workload, data, "adam", 0.01, 0,
                                                      "sweep") is None
    assert again.get(workload, data, "adam", 0.01, 1, "sweep") is None
    wider = dataclasses.replace(workload, batch_size=32)
    assert again.get(wider, data, "adam", 0.01, 0, "sweep") is None
    # Not allowed to train: the missing run is named.
    frozen = rc.RunCache(path, quick=True, evals=2, train=False)
    with pytest.raises(rc.NotCached, match="sgd 0.1 seed 0"):
        frozen.final(workload, data, "sgd", 0.1, 0)


def test_a_later_line_replaces_an_earlier_and_rows_have_the_suite_shape(tmp_path):
    workload, data = _workload_and_data()
    path = tmp_path / "runs.jsonl"
    cache = rc.RunCache(path, quick=True, evals=2)
    cache.store(workload, data, "thor", 0.0, 0, "sweep", _rows([1.0, 0.8]), 3.0)
    cache.store(workload, data, "thor", 0.0, 0, "sweep", _rows([1.0, 0.7]), 4.0)
    cache.store(workload, data, rc.THOR_PEAK, 0.03, 0, "sweep", _rows([1.0, 0.6]), 5.0)
    assert len(path.read_text().splitlines()) == 3
    reread = rc.RunCache(path, quick=True, evals=2)
    assert reread.get(workload, data, "thor", 0.0, 0, "sweep")["final"] == 0.7
    assert reread.wall_seconds("tabular_mlp", 12) == (2, 9.0)
    rows = reread.rows("tabular_mlp", 12)
    assert len(rows) == 4 and reread.rows("tabular_mlp", 13) == []
    peak = [r for r in rows if r["optimizer"] == rc.THOR_PEAK]
    assert [(r["step"], r["metric"], r["lr"], r["batch"], r["phase"]) for r in peak] == [
        (0, 1.0, 0.03, 16, "sweep"), (10, 0.6, 0.03, 16, "sweep")]
    assert json.loads(path.read_text().splitlines()[-1])["wall_seconds"] == 5.0


def test_read_jsonl_and_append_line(tmp_path):
    path = tmp_path / "sub" / "x.jsonl"
    assert rc.read_jsonl(path) == [] and rc.read_jsonl(None) == []
    rc.append_line(path, {"a": 1})
    rc.append_line(path, {"a": 2})
    assert rc.read_jsonl(path) == [{"a": 1}, {"a": 2}]


def test_the_studies_thor_keeps_the_rule_their_runs_were_trained_with(tmp_path, monkeypatch):
    """The cached studies' THOR (its default peak, an explicit peak, an interleaved pair) trains
    with relative ε 1e-2, as their cached runs did, whatever the library's default is now."""
    import thor_tf
    from experiments import interleave, suite

    before = thor_tf.rules.Eigenbasis(relative_epsilon=1e-2)
    assert rc.study_rule() == before and thor_tf.rules.Eigenbasis() != before
    seen = []
    monkeypatch.setattr(suite, "train_run", lambda w, d, optimizer, lr, seed, args, log:
                        seen.append((optimizer, list(args.thor_option))))
    workload, data = _workload_and_data()
    rc.train_one(workload, data, "thor", 0.0, 0, True, 2, None)
    rc.train_one(workload, data, rc.THOR_PEAK, 0.02, 0, True, 2, None)
    assert seen == [("thor", [("update_rule", before)]),
                    ("thor", [("update_rule", before), ("peak", 0.02)])]

    def pair(w, d, baseline, rate, seed, evals, thor_options=(), quick=False):
        seen.append(list(thor_options))
        return [{**row, "optimizer": o} for o in ("thor", baseline) for row in _rows([0.5])]

    monkeypatch.setattr(interleave, "interleaved_rows", pair)
    rc.RunCache(tmp_path / "runs.jsonl", quick=True, evals=2).interleave(
        workload, data, "adam", 0.01, [0])
    assert seen[-1] == [("update_rule", before)]
