"""The horizon study (experiments/horizon.py): its lengths and grids, the record's schema from a
quick run, resuming from the run cache (a second run trains nothing; --report-only rebuilds the
record), and the steps and seconds to each length's target on a hand-made cache."""

import json

import pytest

from experiments import batch_scaling as bs
from experiments import horizon as hz
from experiments import workloads as wl


def test_lengthened_workload_keeps_the_batch_and_multiplies_epochs_or_steps():
    base = wl.WORKLOADS["tabular_mlp"]
    w4, d4 = hz.lengthened_workload("tabular_mlp", 4, quick=False)
    assert (w4.batch_size, w4.epochs, w4.baselines) == (base.batch_size, 4 * base.epochs,
                                                        base.baselines)
    assert bs.total_steps(w4, d4) == 4 * 220
    w, _ = hz.lengthened_workload("tabular_mlp", 1, quick=False, grids={"adam": (0.1,)})
    assert w.baselines == {"adam": (0.1,)}
    assert hz.centred_grid(0.03) == (0.01, 0.03, 0.09)
    # A workload outside the suite (breast cancer: 398 rows, batch 32, 12 epochs) lengthens
    # the same way, so the levers measure it by the same harness.
    w2, d2 = hz.lengthened_workload("cancer_ln_mlp", 2, quick=False)
    assert (w2.batch_size, w2.epochs) == (32, 24)
    assert bs.total_steps(w2, d2) == 2 * (398 // 32) * 12


def test_schedule_puts_short_lengths_and_tuning_first():
    plan = hz.schedule(["a", "b"], [1, 4, 16])
    assert plan[:4] == [("tune", 1, "a"), ("tune", 1, "b"), ("tune", 4, "a"), ("tune", 4, "b")]
    assert plan[4:8] == [("seeds", 1, "a"), ("seeds", 1, "b"), ("seeds", 4, "a"),
                         ("seeds", 4, "b")]
    assert plan[8:] == [("tune", 16, "a"), ("tune", 16, "b"), ("seeds", 16, "a"),
                        ("seeds", 16, "b")]


def _no_training(*args, **kwargs):
    raise AssertionError("a run the cache holds was trained again")


def test_quick_run_writes_the_record_and_resumes_from_its_cache(tmp_path, monkeypatch):
    out = tmp_path / "hz"
    argv = ["--quick", "--workloads", "tabular_mlp", "--evals", "2", "--out", str(out)]
    record = hz.main(argv)
    lines = (out / hz.CACHE).read_text().splitlines()
    assert record["trained"] == len(lines) > 0
    w = record["workloads"]["tabular_mlp"]
    assert set(w["lengths"]) == {"1", "2"}
    assert w["lengths"]["2"]["steps"] == 2 * w["lengths"]["1"]["steps"]
    for cell in w["lengths"].values():
        best = cell["best_baseline"]
        for name in ("thor", "thor_best", best):
            assert {"rate", "final", "steps_to_target", "examples_to_target",
                    "seconds_to_target"} <= set(cell[name])
        assert cell["target"] == cell[best]["final"]        # one seed: its final
        assert cell["thor"]["seconds_paired"] and cell[best]["seconds_paired"]
    # The 2x grid is centred on the 1x best (quick: adam at one rate), widened at an end.
    adam1 = w["lengths"]["1"]["adam"]["rate"]
    assert {f"{r:g}" for r in hz.centred_grid(adam1)} <= set(w["lengths"]["2"]["adam"]["grid"])
    for png in ("horizon_steps.png", "horizon_seconds.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "horizon.json").read_text())["workloads"] == json.loads(
        json.dumps(record["workloads"]))
    # A second run with the same cache trains nothing and gives the same record.
    monkeypatch.setattr("experiments.run_cache.train_one", _no_training)
    monkeypatch.setattr("experiments.interleave.interleaved_rows", _no_training)
    again = hz.main(argv)
    assert again["trained"] == 0 and (out / hz.CACHE).read_text().splitlines() == lines
    assert again["workloads"] == record["workloads"]
    # --report-only rebuilds it from the cache alone.
    (out / "horizon.json").unlink()
    rebuilt = hz.main(argv + ["--report-only"])
    assert rebuilt["workloads"] == record["workloads"]
    assert (out / "horizon.json").exists()


def _run(workload, steps, optimizer, rate, seed, phase, curve, **extra):
    """One cache line: ``curve`` is ``[(step, seconds, metric)]`` after step 0."""
    points = [[0, 0.0, 5.0, None]] + [[s, t, m, m] for s, t, m in curve]
    return {"workload": workload, "multiple": 1, "steps": steps, "batch": 32,
            "optimizer": optimizer, "rate": rate, "seed": seed, "phase": phase, "quick": True,
            "evals": 4, "final": points[-1][2], "curve": points, "first_seconds": 1.0,
            "steady_seconds_per_step": 0.01, "load": 0.0, "wall_seconds": 10.0, **extra}


def test_steps_and_seconds_to_the_target_on_a_hand_made_cache(tmp_path, monkeypatch):
    """tabular_mlp --quick at 1x: 55 steps, evaluations at 14, 28, 41, 55 (4 evals); a loss.
    Tuning (seed 0): THOR's default (peak 3e-2) beats its peaks 1e-2 and 9e-2; adam (grid 1e-2
    alone) is the best baseline. Seeds 0, 1, 2 interleaved."""
    monkeypatch.setattr(bs, "default_peak", lambda steps: 0.03)
    name, steps = "tabular_mlp", 55
    assert bs.total_steps(*hz.lengthened_workload(name, 1, quick=True)) == steps
    grid = [14, 28, 41, 55]

    def curve(metrics, seconds):
        return list(zip(grid, seconds, metrics))

    runs = [
        _run(name, steps, "thor", 0.0, 0, "sweep", curve([1.0, 0.5, 0.3, 0.2], [1, 2, 3, 4])),
        _run(name, steps, bs.THOR_PEAK, 0.01, 0, "sweep", curve([2, 1, 0.9, 0.8], [1, 2, 3, 4])),
        _run(name, steps, bs.THOR_PEAK, 0.09, 0, "sweep", curve([2, 1, 0.9, 0.7], [1, 2, 3, 4])),
        _run(name, steps, "adam", 0.01, 0, "sweep", curve([1.5, 0.9, 0.6, 0.4], [1, 2, 3, 4])),
    ]
    # Interleaved pairs: adam's finals 0.40, 0.50, 0.45 -> target (median) 0.45.
    thor = {0: ([1.0, 0.5, 0.3, 0.2], [2, 4, 6, 8]), 1: ([1.0, 0.6, 0.44, 0.3], [2, 4, 6, 8]),
            2: ([0.9, 0.9, 0.8, 0.7], [2, 4, 6, 8])}
    adam = {0: ([1.5, 0.9, 0.6, 0.4], [1, 2, 3, 4]), 1: ([1.5, 0.9, 0.7, 0.5], [1, 2, 3, 4]),
            2: ([1.5, 0.9, 0.45, 0.45], [1, 2, 3, 4])}
    for seed in (0, 1, 2):
        runs.append(_run(name, steps, "thor", 0.0, seed, "interleaved", curve(*thor[seed]),
                         pair=["adam", 0.01]))
        runs.append(_run(name, steps, "adam", 0.01, seed, "interleaved", curve(*adam[seed]),
                         pair=["adam", 0.01]))
    out = tmp_path / "hz"
    out.mkdir()
    (out / hz.CACHE).write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr("experiments.run_cache.train_one", _no_training)
    monkeypatch.setattr("experiments.interleave.interleaved_rows", _no_training)
    record = hz.main(["--quick", "--workloads", name, "--multiples", "1", "--seeds", "0,1,2",
                      "--evals", "4", "--out", str(out)])
    cell = record["workloads"][name]["lengths"]["1"]
    assert cell["best_baseline"] == "adam" and cell["target"] == pytest.approx(0.45)
    t, a = cell["thor"], cell["adam"]
    # THOR reaches 0.45 at step 41 on seeds 0 (0.3, 6 s) and 1 (0.44, 6 s), never on seed 2.
    assert t["steps_by_seed"] == [41, 41, None] and t["steps_to_target"] == 41
    assert t["seconds_by_seed"] == [6, 6, None] and t["seconds_to_target"] == 6
    assert t["examples_to_target"] == 41 * 32 and t["final"] == pytest.approx(0.3)
    # adam: 55 (seed 0, 4 s), never (seed 1), 41 (seed 2, 3 s): medians 55 steps, 4 s.
    assert a["steps_by_seed"] == [55, None, 41] and a["steps_to_target"] == 55
    assert a["seconds_to_target"] == 4
    assert cell["steps_ratio"] == pytest.approx(41 / 55)
    # Paired seconds: seed 0 6/4; seed 1 only THOR gets there; seed 2 THOR never: median 1.5.
    ps = cell["paired_seconds"]
    assert ps["per_seed"] == {0: pytest.approx(1.5), 1: None, 2: None}
    assert ps["only_thor_seeds"] == [1]
    assert cell["seconds_ratio"] == pytest.approx(1.5)
    assert cell["thor_best"]["rate"] == 0.03 and cell["thor_ahead_in_final"]
    assert record["trained"] == 0
    # README's line and docs/horizon.md's table follow the record.
    from experiments import report

    line = report.horizon_line(record)
    assert "tabular MLP (train MSE): 1× 0.75× (1.50× the seconds)" in line
    block = report.horizon_block(record)
    assert "| tabular MLP (train MSE) | 1× (55) | Adam 0.01 | 0.45 | 0.3 / 0.3 / 0.45 | " \
           "41 / 55 | 0.75×, 1.50× | 0.03 (0.75) | 3, 3 |" in block
    assert report.horizon_line(None) == "" and "No runs recorded yet" in report.horizon_block(None)
    assert "thor_current" not in cell          # no levers' runs of the current default yet

    # The current default's runs from the levers' cache (relative ε 0.1, trained alone): it
    # reaches 0.45 at 28 (seed 0), 41 (seed 1), never (seed 2): median 41 of adam's 55.
    lever, options = hz.CURRENT_DEFAULT_LEVER
    assert options == {"rule": {"relative_epsilon": 0.1}}
    now = {0: [0.9, 0.4, 0.3, 0.25], 1: [1.0, 0.6, 0.42, 0.35], 2: [1.0, 0.8, 0.7, 0.6]}
    other = {**_run(name, steps, "thor", 0.0, 0, "x", curve([0.1] * 4, [1, 2, 3, 4])),
             "lever": "beta2", "options": {"rule": {"beta_2": 0.99}}}   # not the default
    levers = [other] + [{**_run(name, steps, "thor", 0.0, seed, "x", curve(m, [1, 2, 3, 4])),
                         "lever": lever, "options": options} for seed, m in now.items()]
    (out / hz.LEVERS_CACHE).write_text("".join(json.dumps(r) + "\n" for r in levers))
    record = hz.main(["--quick", "--workloads", name, "--multiples", "1", "--seeds", "0,1,2",
                      "--evals", "4", "--out", str(out), "--report-only"])
    now = record["workloads"][name]["lengths"]["1"]["thor_current"]
    assert now["steps_by_seed"] == [28, 41, None] and now["steps_to_target"] == 41
    assert now["steps_ratio"] == pytest.approx(41 / 55) and now["final"] == pytest.approx(0.35)
    assert now["ahead_in_final"]
    line = report.horizon_line(record)
    assert "tabular MLP (train MSE): 1× 0.75×;" in line or line.endswith(
        "tabular MLP (train MSE): 1× 0.75×.")
    assert "| tabular MLP (train MSE) | 1× (55) | 0.45 | 0.35 / 0.3 / 0.45 | 41 / 55 | " \
           "0.75× (0.75×) | – | 28, 41, never |" in report.horizon_block(record)

    # Interleaved pairs of the current default with adam on seeds 0 and 1 (--current-pairs):
    # their THOR runs replace the levers' there. Seed 0: THOR 0.45 at 28 (6 s), adam at 55
    # (4 s): 1.5; seed 1: THOR at 28 (2 s), adam at 28 (4 s): 0.5. Seed 2: the levers' run.
    pairs = {0: ([0.9, 0.4, 0.3, 0.25], [3, 6, 9, 12], [1.5, 0.9, 0.6, 0.44], [1, 2, 3, 4]),
             1: ([1.0, 0.44, 0.4, 0.3], [1, 2, 3, 4], [1.5, 0.45, 0.4, 0.4], [2, 4, 6, 8])}
    with open(out / hz.CACHE, "a") as fh:
        for seed, (tm, ts, am, at) in pairs.items():
            for line in (_run(name, steps, "thor", 0.0, seed, hz.CURRENT_PHASE, curve(tm, ts),
                              pair=["adam", 0.01], rule={"relative_epsilon": 0.1}),
                         _run(name, steps, "adam", 0.01, seed, hz.CURRENT_PHASE, curve(am, at),
                              pair=["adam", 0.01])):
                fh.write(json.dumps(line) + "\n")
    record = hz.main(["--quick", "--workloads", name, "--multiples", "1", "--seeds", "0,1,2",
                      "--evals", "4", "--out", str(out), "--report-only"])
    cell = record["workloads"][name]["lengths"]["1"]
    now = cell["thor_current"]
    assert now["steps_by_seed"] == [28, 28, None] and now["steps_to_target"] == 28
    assert now["steps_ratio"] == pytest.approx(28 / 55) and now["paired_seeds"] == [0, 1]
    assert now["paired_seconds"]["per_seed"] == {0: pytest.approx(1.5), 1: pytest.approx(0.5)}
    assert now["seconds_ratio"] == pytest.approx(1.0)
    # The study's own THOR (relative ε 1e-2) and its pairs are untouched.
    assert cell["thor"]["steps_by_seed"] == [41, 41, None]
    assert cell["seconds_ratio"] == pytest.approx(1.5)
    assert "tabular MLP (train MSE): 1× 0.51× (1.00× the seconds)" in report.horizon_line(record)
    assert "| 0.51× (0.75×) | 1.00× | 28, 28, never |" in report.horizon_block(record)


def test_current_pairs_train_the_default_rule_under_their_own_phase(tmp_path, monkeypatch):
    """``RunCache.interleave`` with a rule: THOR's options carry it, both runs are stored under
    the given phase, and a held pair is not trained again."""
    from experiments.run_cache import RunCache

    calls = []

    def fake_rows(workload, data, baseline, rate, seed, evals, thor_options, quick):
        calls.append(dict(thor_options)["update_rule"])
        return [{"optimizer": o, "step": s, "seconds": s / 10, "metric": 1.0 / (s + 1),
                 "train_loss": 1.0} for o in ("thor", baseline) for s in (0, 10)]

    monkeypatch.setattr("experiments.interleave.interleaved_rows", fake_rows)
    workload, data = hz.lengthened_workload("tabular_mlp", 1, quick=True)
    cache = RunCache(tmp_path / "c.jsonl", quick=True, evals=4)
    for _ in range(2):
        cache.interleave(workload, data, "adam", 0.01, [0], rule={"relative_epsilon": 0.1},
                         phase=hz.CURRENT_PHASE)
    assert len(calls) == 1 and calls[0].relative_epsilon == pytest.approx(0.1)
    runs = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [(r["optimizer"], r["phase"], r.get("rule")) for r in runs] == [
        ("thor", hz.CURRENT_PHASE, {"relative_epsilon": 0.1}),
        ("adam", hz.CURRENT_PHASE, None)]
    cache.interleave(workload, data, "adam", 0.01, [0])          # the studies' rule: a new pair
    assert len(calls) == 2 and calls[1].relative_epsilon == pytest.approx(1e-2)


def test_every_baseline_gets_thors_steps_to_its_own_median_final():
    """``versus_each``: per baseline its median final over its seeds is the target; THOR's median
    steps to it over the baseline's own. A loss (lower is better), evaluations at 10, 20, 30."""
    workload = wl.WORKLOADS["tabular_mlp"]

    def rows(optimizer, per_seed):
        return [{"workload": workload.name, "batch": 32, "phase": "sweep", "optimizer": optimizer,
                 "lr": 0.01, "seed": seed, "step": step, "seconds": step / 10, "metric": metric,
                 "train_loss": metric, "first_seconds": 1.0, "steady_seconds_per_step": 0.01,
                 "load": 0.0}
                for seed, metrics in per_seed.items()
                for step, metric in zip((0, 10, 20, 30), (5.0,) + metrics)]

    thor = rows("thor", {0: (0.6, 0.4, 0.3), 1: (0.7, 0.5, 0.35), 2: (0.9, 0.8, 0.7)})
    entry = {"thor": (thor, 0.03), "thor_best": (thor, 0.03),
             # adam: finals 0.5, 0.45, 0.6 -> its target 0.5; it gets there at 30, 20, never.
             "adam": (rows("adam", {0: (0.9, 0.7, 0.5), 1: (0.8, 0.45, 0.45),
                                    2: (0.9, 0.8, 0.6)}), 0.01),
             # muon on seed 0 only: final 0.35, reached at 30.
             "muon": (rows("muon", {0: (0.9, 0.6, 0.35)}), 0.02)}
    vs = hz.versus_each(workload, entry, 32)
    assert set(vs) == {"adam", "muon"}
    # THOR to 0.5: step 20 (0.4), 20 (0.5), never -> median 20; adam: 30, 20, never -> 30.
    assert vs["adam"]["target"] == pytest.approx(0.5) and vs["adam"]["seeds"] == [0, 1, 2]
    assert (vs["adam"]["thor_steps"], vs["adam"]["steps"]) == (20, 30)
    assert vs["adam"]["steps_ratio"] == pytest.approx(2 / 3)
    # THOR to 0.35: 30 (0.3), 30 (0.35), never -> 30; muon: 30.
    assert vs["muon"]["seeds"] == [0] and vs["muon"]["target"] == pytest.approx(0.35)
    assert vs["muon"]["steps_ratio"] == pytest.approx(1.0)
