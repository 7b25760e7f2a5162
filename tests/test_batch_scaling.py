"""The batch-scaling study's harness (experiments/batch_scaling.py): its budgets, grid widening and
edge flag, the critical-batch fit against a hand-made curve, and a quick run that gives the same
rows when a run is trained again and writes the record in the issue's shape."""

import json
import math

import pytest

from experiments import batch_scaling as bs
from experiments import workloads as wl


def test_budget_shrinks_with_the_square_root_of_the_batch():
    assert [bs.budget_steps(600, m) for m in (1, 4, 16)] == [600, 300, 150]
    assert bs.budget_steps(1, 16) == 1


def test_scaled_workload_keeps_the_suite_at_one_and_scales_batch_epochs_and_grids():
    base = wl.WORKLOADS["tabular_mlp"]
    w1, d1 = bs.scaled_workload("tabular_mlp", 1, quick=False)
    assert (w1.batch_size, w1.epochs, w1.baselines) == (base.batch_size, base.epochs,
                                                        base.baselines)
    w4, d4 = bs.scaled_workload("tabular_mlp", 4, quick=False)
    assert w4.batch_size == 4 * base.batch_size
    # 353 examples: 11 steps per epoch at 32, 2 at 128; S_4 = 220 / 2 = 110 steps = 55 epochs.
    assert bs.total_steps(w1, d1) == 220 and w4.epochs == 55 and bs.total_steps(w4, d4) == 110
    assert w4.baselines["adam"] == tuple(bs._round_rate(2 * r) for r in base.baselines["adam"])


class _FakeSweep:
    """``final`` from a function of the rate (no training), recording what was asked."""

    def __init__(self, score):
        self.score, self.asked = score, []

    def final(self, workload, data, optimizer, lr, seed):
        self.asked.append((optimizer, lr))
        return self.score(optimizer, lr)


def test_fresh_windows_give_the_char_gpt_a_longer_single_pass(monkeypatch):
    """A larger batch or a longer run of the char GPT reads fresh windows of the corpus (seed 0's
    sequence, as the suite's), ``steps`` batches of ``batch``; here a synthetic corpus."""
    import numpy as np

    from experiments import text

    ids = (np.arange(5000) % 23).astype("int32")
    corpus = text.CharCorpus("hand", "hand", [chr(97 + i) for i in range(23)], ids[:4500],
                             ids[4500:])
    monkeypatch.setattr(text, "load_text", lambda **kwargs: corpus)
    block = wl.GPT_SIZES[True]["block"]
    data = wl.Data(np.zeros((4, block), "int32"), np.zeros((4, block), "int32"), None, None, "")
    fresh = bs._fresh_windows(data, True, steps=7, batch=3)
    assert fresh.x_train.shape == fresh.y_train.shape == (21, block)
    x, _ = text.train_batches(ids[:4500], 0, 7, 3, block)
    np.testing.assert_array_equal(fresh.x_train, x)
    np.testing.assert_array_equal(fresh.y_train[:, :-1], fresh.x_train[:, 1:])


def test_tune_widens_a_grid_at_its_end_and_flags_a_best_still_there(monkeypatch):
    import dataclasses

    workload = dataclasses.replace(wl.WORKLOADS["tabular_mlp"],
                                   baselines={"adam": (0.01, 0.03, 0.1), "sgd": (0.01, 0.1, 1.0)})
    monkeypatch.setattr(bs, "total_steps", lambda w, d: 100)
    monkeypatch.setattr(bs, "default_peak", lambda steps: 0.03)

    def score(optimizer, lr):        # a loss (lower is better)
        if optimizer == "adam":
            return -lr                   # always better higher: widened twice, still at the end
        if optimizer == "sgd":
            return (math.log(lr) - math.log(0.1)) ** 2   # best inside the grid: no widening
        if optimizer == "thor":
            return 1.0                   # THOR's default (peak 0.03)
        return 0.5 if lr == pytest.approx(0.01) else 2.0   # thor_peak: 0.01 best, then 0.0033

    sweep = _FakeSweep(score)
    tuned = bs.tune(sweep, workload, None, seed=0)
    adam = tuned["adam"]
    assert list(adam["grid"]) == ["0.01", "0.03", "0.1", "0.3", "0.9"]
    assert adam["best"] == pytest.approx(0.9) and adam["at_edge"]
    assert tuned["sgd"]["best"] == 0.1 and not tuned["sgd"]["at_edge"]
    assert len([a for a in sweep.asked if a[0] == "sgd"]) == 3
    peak = tuned[bs.THOR_PEAK]
    assert peak["default_peak"] == 0.03 and peak["best"] == pytest.approx(0.01)
    assert list(peak["grid"]) == ["0.0033", "0.01", "0.03", "0.09"]   # widened once below
    assert not peak["at_edge"]
    # The best baseline: the lowest seed-0 loss (adam's -0.9 against sgd's 0).
    assert bs.leader(workload, tuned) == ("adam", pytest.approx(0.9))


def test_critical_batch_recovers_a_known_curve_and_the_halving_batch():
    s_min, b_crit = 40.0, 300.0
    points = {b: s_min * (1 + b_crit / b) for b in (64, 256, 1024)}
    fitted, fitted_min = bs.critical_batch(points)
    assert fitted == pytest.approx(b_crit) and fitted_min == pytest.approx(s_min)
    # Perfect scaling in the range: no floor to the steps.
    assert bs.critical_batch({64: 160, 256: 40, 1024: 10})[0] == math.inf
    assert bs.critical_batch({64: 100, 256: None}) == (None, None)
    # Halving: 4x the batch at least halves the steps (a ratio of 2 per 4x).
    assert bs.halving_batch({64: 100, 256: 50, 1024: 30}) == 256
    assert bs.halving_batch({64: 100, 256: 40, 1024: 20}) == 1024
    assert bs.halving_batch({64: 100, 256: None, 1024: 20}) == 64
    assert bs.halving_batch({64: None, 256: 10}) is None


def test_quick_run_is_reproducible_and_writes_the_record(tmp_path):
    out = tmp_path / "bs"
    argv = ["--quick", "--workloads", "tabular_mlp", "--evals", "2", "--out", str(out)]
    record = bs.main(argv)
    lines = (out / bs.CACHE).read_text().splitlines()
    runs = [json.loads(line) for line in lines]
    # Train one run again (drop its line: the study resumes by training what is missing).
    dropped = next(i for i, r in enumerate(runs) if r["optimizer"] == "adam"
                   and r["phase"] == "sweep" and r["batch"] == 64)
    (out / bs.CACHE).write_text("".join(line + "\n" for i, line in enumerate(lines)
                                        if i != dropped))
    again = bs.main(argv)
    retrained = [json.loads(line) for line in (out / bs.CACHE).read_text().splitlines()][-1]
    assert len(retrained["curve"]) == 3
    assert [c[2] for c in retrained["curve"]] == [c[2] for c in runs[dropped]["curve"]]
    # The same record, seconds aside (the retrained run's clock is its own).
    for b, cell in again["workloads"]["tabular_mlp"]["batches"].items():
        first = record["workloads"]["tabular_mlp"]["batches"][b]
        assert cell["best_baseline"] == first["best_baseline"]
        for name in ("thor", "thor_best", cell["best_baseline"]):
            for key in ("rate", "final", "steps_to_target", "finals", "steps_by_seed"):
                assert cell[name][key] == first[name][key], (b, name, key)
    # The interleaved pair trains the same trajectories as the sweep's runs.
    thor = {r["phase"]: [c[2] for c in r["curve"]] for r in runs
            if r["optimizer"] == "thor" and r["batch"] == 32 and r["seed"] == 0}
    assert thor["sweep"] == thor["interleaved"] and len(thor["sweep"]) == 3
    w = json.loads((out / "batch_scaling.json").read_text())["workloads"]["tabular_mlp"]
    assert set(w["batches"]) == {"32", "64"}
    for cell in w["batches"].values():
        for name in ("thor", "thor_best", cell["best_baseline"]):
            assert {"rate", "final", "steps_to_target", "examples_to_target",
                    "seconds_to_target"} <= set(cell[name])
            steps = cell[name]["steps_to_target"]
            assert steps is None or cell[name]["examples_to_target"] == steps * int(
                next(b for b, c in w["batches"].items() if c is cell))
    assert w["target"] == w["batches"]["32"][w["target_from"]]["final"]
    for png in ("batch_scaling_steps.png", "batch_scaling_seconds.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steps_at_interpolates_log_log_and_extrapolates_by_the_fit():
    points = {64: 400.0, 256: 100.0, 1024: 50.0}
    assert bs.steps_at(points, 256, (None, None)) == (100.0, False)
    steps, extra = bs.steps_at(points, 128, (None, None))   # halfway in log: sqrt(400 * 100)
    assert steps == pytest.approx(200.0) and not extra
    # Beyond: the fit's shape anchored at the last point; without a finite fit, held.
    steps, extra = bs.steps_at(points, 2048, (1024.0, 25.0))
    assert extra and steps == pytest.approx(50.0 * (1 + 1024 / 2048) / (1 + 1024 / 1024))
    assert bs.steps_at(points, 2048, (math.inf, None)) == (50.0, True)
    assert bs.steps_at({64: 400.0, 256: None}, 128, (None, None)) == (None, False)


def test_ring_allreduce_and_the_projection_on_a_hand_made_record():
    net = {"bandwidth": 1e9, "latency": 1e-5}
    assert bs.ring_allreduce_seconds(8e6, 1, net) == 0.0
    assert bs.ring_allreduce_seconds(8e6, 4, net) == pytest.approx(6e-5 + 1.5 * 8e-3)

    def cell(thor_steps, base_steps):
        return {"best_baseline": "adam",
                "thor": {"steps_to_target": thor_steps, "steady_seconds_per_step": 0.02,
                         "first_seconds": 1.0},
                "adam": {"steps_to_target": base_steps, "steady_seconds_per_step": 0.01,
                         "first_seconds": 0.5}}

    record = {"workloads": {"w": {
        "base_batch": 32, "batches": {"32": cell(100, 200), "128": cell(30, 100),
                                      "512": cell(10, None)},
        "scaling": {"thor": {"critical_batch": math.inf, "min_steps": None},
                    "best_baseline": {"critical_batch": None, "min_steps": None}}}}}
    p = bs.project(record, {"w": (1000, 5000)}, frequency=10, replicas=(1, 4, 16), network=net)
    rows = {r["replicas"]: r for r in p["workloads"]["w"]["rows"]}
    assert rows[1]["thor"]["seconds"] == pytest.approx(100 * 0.02 + 1.0)
    assert rows[1]["baseline"]["seconds"] == pytest.approx(200 * 0.01 + 0.5)
    comm = bs.ring_allreduce_seconds(4000, 4, net)
    thor_step = 0.02 + comm + bs.ring_allreduce_seconds(20000, 4, net) / 10
    assert rows[4]["thor"]["seconds"] == pytest.approx(30 * thor_step + 1.0)
    assert rows[4]["ratio"] == pytest.approx(rows[4]["thor"]["seconds"]
                                             / (100 * (0.01 + comm) + 0.5))
    assert rows[16]["ratio"] is None and rows[16]["only_thor"]     # the baseline never
    assert p["workloads"]["w"]["largest_lead"] == 4


@pytest.mark.parametrize("seconds,median,decided_by", [
    # (THOR, baseline) seconds to the target per seed; None: never got there.
    ({0: (6, 4), 1: (3, None), 2: (None, 2)}, 1.5, "ratio"),       # 0, 1.5, inf -> 1.5
    ({0: (6, 4), 1: (None, 2), 2: (None, None)}, None, "only_baseline"),  # 1.5, inf -> inf
    ({0: (3, None), 1: (6, 4), 2: (None, None)}, 1.5, "ratio"),     # 0, 1.5 -> the higher
    ({0: (6, 4), 1: (2, 4), 2: (None, None)}, 1.0, "ratio"),        # 1.5, 0.5 -> the mean
    ({0: (3, None), 1: (5, None), 2: (6, 4)}, None, "only_thor"),   # 0, 0, 1.5 -> 0
    ({0: (None, None)}, None, None)])
def test_paired_seconds_median_counts_the_pairs_one_side_never_finished(monkeypatch, seconds,
                                                                        median, decided_by):
    """The median of the pairs' seconds ratios counts a pair only the baseline finished as
    infinite (THOR losing it is not left out) and one only THOR finished as 0; of an even count
    the mean of the middle two unless one is 0 or infinite (then the higher); not a ratio when
    the median is 0 or infinite."""
    rows = [{"workload": "w", "batch": 8, "phase": "interleaved", "optimizer": opt, "seed": s,
             "step": 1, "seconds": sec}
            for s, pair in seconds.items() for opt, sec in zip(("thor", "adam"), pair)]
    monkeypatch.setattr(bs.suite, "reach", lambda workload, runs, target: (None,
                                                                           runs[0]["seconds"]))
    got = bs.paired_seconds(None, rows, "w", 8, "adam", 0.5)
    assert got["decided_by"] == decided_by
    assert got["median"] == (None if median is None else pytest.approx(median))
    assert got["only_thor_seeds"] == [s for s, (t, b) in seconds.items()
                                      if t is not None and b is None]
