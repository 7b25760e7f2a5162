"""The levers study (experiments/levers.py): its paired statistics against hand-computed numbers,
the verdict's rules, and the quick mode end to end (a THOR default run and the target read from a
horizon cache, the lever trained, the record's and the cache's schema, resuming)."""

import json
import math

import pytest

from experiments import batch_scaling as bs
from experiments import horizon as hz
from experiments import levers as lv


def test_paired_statistics_match_hand_computed_numbers():
    # Accuracy (higher is better): differences 0.01, -0.01, 0.02.
    p = lv.paired([0.80, 0.82, 0.84], [0.81, 0.81, 0.86], higher_is_better=True)
    d = p["difference"]
    assert d["per_seed"] == pytest.approx([0.01, -0.01, 0.02])
    assert d["median"] == pytest.approx(0.01)
    assert d["mean"] == pytest.approx(0.02 / 3)
    # sd: deviations 1/300, -5/300, 4/300; (1 + 25 + 16) / 300² / 2 = 21 / 90000
    assert d["sd"] == pytest.approx(math.sqrt(21 / 90000))
    assert (p["pairs"], p["improved"], p["worse"]) == (3, 2, 1)
    assert p["default"]["median"] == pytest.approx(0.82)
    assert p["lever"]["mean"] == pytest.approx(2.48 / 3)
    # A loss (lower is better): a negative difference improves.
    q = lv.paired([2.0, 1.9], [1.8, 1.95], higher_is_better=False)
    assert q["difference"]["per_seed"] == pytest.approx([-0.2, 0.05])
    assert (q["improved"], q["worse"]) == (1, 1)
    # Steps with "never" (None): only seeds where both reach the target are paired.
    s = lv.paired([100, None, 60], [80, 90, None], higher_is_better=False)
    assert s["difference"]["per_seed"] == [-20, None, None]
    assert (s["pairs"], s["improved"]) == (1, 1)
    assert s["default"]["median"] == 80 and s["lever"]["median"] == 85
    assert s["difference"]["sd"] is None


def test_steps_to_target_is_the_first_evaluation_at_or_past_it():
    curve = [[0, 0.0, 0.9, None], [10, 1.0, 0.5, 1.0], [20, 2.0, 0.4, 0.9], [30, 3.0, 0.3, 0.8]]
    assert lv.steps_to(curve, 0.4, higher_is_better=False) == 20
    assert lv.steps_to(curve, 0.1, higher_is_better=False) is None
    assert lv.steps_to(curve, 0.95, higher_is_better=True) is None   # step 0 does not count
    assert lv.steps_to(curve, None, higher_is_better=True) is None


def _cell(diffs, higher=True, multiple="4"):
    default = [0.8] * len(diffs)
    return {"higher_is_better": higher,
            "final": lv.paired(default, [a + d for a, d in zip(default, diffs)], higher)}


def test_verdict_needs_every_seed_on_every_workload_and_no_loss_at_1x():
    good = _cell([0.01, 0.02, 0.005])
    assert lv.holds(good) and not lv.holds(_cell([0.01, 0.02]))       # two seeds are too few
    assert not lv.holds(_cell([0.01, -0.001, 0.02]))
    # loses: mean worse by more than its standard error
    assert lv.loses(_cell([-0.01, -0.012, -0.011]))
    assert not lv.loses(_cell([-0.01, 0.012, 0.0]))
    assert not lv.verdict({"a": {"4": good}})["adopt"]                  # one workload only
    assert not lv.verdict({"a": {"4": good}, "b": {"4": good}})["adopt"]  # 1x check missing
    both = {"a": {"4": good, "1": _cell([0.0, 0.001, -0.001])},
            "b": {"4": good, "1": _cell([0.002, 0.0, 0.001])}}
    assert lv.verdict(both)["adopt"]
    both["b"]["1"] = _cell([-0.01, -0.012, -0.011])
    v = lv.verdict(both)
    assert not v["adopt"] and "loses the 1x run of b" in v["why"]


def test_plan_puts_seed_0_of_every_lever_first_and_the_default_after_them():
    order = lv.plan(["x", "y"], ["a", "b"], [4], [0, 1])
    assert order[:6] == [(0, 4, "a", "x"), (0, 4, "b", "x"), (0, 4, "a", "y"),
                         (0, 4, "b", "y"), (0, 4, "a", lv.DEFAULT), (0, 4, "b", lv.DEFAULT)]
    assert {s for s, *_ in order[6:]} == {1}


def test_a_lever_on_the_current_default_is_paired_with_that_defaults_runs():
    from types import SimpleNamespace

    assert lv.AGAINST["beta1_low"] == lv.AGAINST["beta1_rate"] == lv.AGAINST["beta1_cool"] == \
        "releps_big"
    spec = lv.LEVERS["beta1_low"][1]("char_gpt")
    assert spec == {"rule": {"relative_epsilon": 0.1, "beta_1": 0.8}}
    assert lv.LEVERS["beta1_rate"][1]("vit") == {
        "rule": {"relative_epsilon": 0.1, "beta_1": 0.8, "beta_1_end": 0.95}}
    assert lv.AGAINST["neuron_out"] == lv.AGAINST["neuron_long"] == "releps_big"
    assert lv.LEVERS["neuron_long"][1]("resnet20") == {
        "rule": {"relative_epsilon": 0.1, "neuron_norm": "long"}}
    curve = lambda losses: [[0, 0.0, 3.0, None]] + [[10 * (i + 1), 1.0, x, None]
                                                     for i, x in enumerate(losses)]
    held = {("releps_big", 0): {"final": 1.70, "curve": curve([1.9, 1.70])},
            ("releps_big", 1): {"final": 1.72, "curve": curve([1.8, 1.72])},
            ("beta1_low", 0): {"final": 1.68, "curve": curve([1.75, 1.68])},
            ("beta1_low", 1): {"final": 1.73, "curve": curve([1.85, 1.73])}}

    class Held:
        def target(self, workload, steps):
            return 1.76, {"optimizer": "muon", "rate": 3e-3, "seed": 0}

        def default_run(self, name, steps, seed):
            raise AssertionError("a lever on the current default is not paired with the study's")

        def lever_run(self, name, steps, lever, spec_, seed):
            want = lv.LEVERS[lever][1](name)
            return held.get((lever, seed)) if spec_ == want else None

    workload = SimpleNamespace(name="char_gpt", higher_is_better=False, metric="loss")
    c = lv.cell(Held(), workload, 20, 4, "beta1_low", spec, [0, 1, 2])
    assert c["against"] == "releps_big" and c["seeds"] == [0, 1]
    assert c["default_sources"] == ["levers (releps_big)"] * 2
    assert c["final"]["difference"]["per_seed"] == pytest.approx([-0.02, 0.01])
    assert (c["final"]["improved"], c["final"]["worse"]) == (1, 1)
    # Steps to 1.76: the reference at 20 on both seeds; the lever at 10, then 20.
    assert c["steps_to_target"]["difference"]["per_seed"] == [-10, 0]
    # Its plan trains (or finds) the reference lever's runs, not the study default's.
    assert lv.plan(["beta1_low"], ["char_gpt"], [4], [0]) == [
        (0, 4, "char_gpt", "beta1_low"), (0, 4, "char_gpt", "releps_big")]


def test_lever_specs_build_wrap_options():
    import thor_tf

    assert lv.wrap_options({"weight_decay": 0.1, "weight_decay_exclude": ["bias"]}) == [
        ("update_rule", thor_tf.rules.Eigenbasis(relative_epsilon=1e-2)),
        ("weight_decay", 0.1), ("weight_decay_exclude", ("bias",))]
    (name, rule), = lv.wrap_options({"rule": {"beta_2": 0.99}})
    assert name == "update_rule" and isinstance(rule, thor_tf.rules.Eigenbasis)
    # On the rule the levers were measured against (relative ε 1e-2, the default before
    # 2026-11-30), whatever the library's default is now: cached runs stay what they were.
    assert rule.beta_2 == 0.99 and rule.relative_epsilon == 1e-2
    assert thor_tf.rules.Eigenbasis().relative_epsilon == 0.1
    (name, rule), = lv.wrap_options({})
    assert name == "update_rule" and rule == thor_tf.rules.Eigenbasis(relative_epsilon=1e-2)
    (name, rule), = lv.wrap_options({"rule": {"relative_epsilon": 0.1}})
    assert rule == thor_tf.rules.Eigenbasis()
    for lever, (_, options) in lv.LEVERS.items():
        json.dumps(options("char_gpt"))                      # the cache keys on the spec


def test_floor_fraction_ends_the_schedule_at_a_fraction_of_the_peak():
    import keras

    from experiments import suite, workloads as wl

    workload = wl.WORKLOADS["tabular_mlp"].sized(True)
    data = workload.load(True)
    keras.utils.set_random_seed(0)
    for peak, steps in ((None, 1000), (0.02, 100)):
        options = [("floor_fraction", 0.1)] + ([] if peak is None else [("peak", peak)])
        opt = suite.compiled_model("thor", 0.0, workload, data, True, steps, options).optimizer
        schedule = opt._learning_rate
        top = schedule.effective_peak
        assert top == pytest.approx(bs.default_peak(steps) if peak is None else peak)
        assert float(schedule(steps)) == pytest.approx(0.1 * top, rel=1e-5)


def test_decay_fraction_holds_the_peak_until_the_runs_last_share():
    import keras

    from experiments import suite, workloads as wl

    workload = wl.WORKLOADS["tabular_mlp"].sized(True)
    data = workload.load(True)
    keras.utils.set_random_seed(0)
    steps = 1000
    options = lv.wrap_options(lv.LEVERS["wsd"][1]("tabular_mlp"))
    schedule = suite.compiled_model("thor", 0.0, workload, data, True, steps,
                                    options).optimizer._learning_rate
    top = bs.default_peak(steps)
    assert schedule.effective_peak == pytest.approx(top)
    # Warmup over 50 steps, the peak until step 800, then half a cosine to 0 at 1,000.
    for step, expected in ((49, top), (50, top), (799, top), (900, top / 2), (1000, 0.0)):
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9)


def _no_training(*args, **kwargs):
    raise AssertionError("a run the cache holds was trained again")


def test_quick_mode_end_to_end(tmp_path, monkeypatch):
    workload, data = hz.lengthened_workload("tabular_mlp", 1, quick=True)
    steps = bs.total_steps(workload, data)
    evals = 4
    # A horizon cache holding the baselines' seed-0 tuning (the target: the best, adam's) and
    # THOR's default on seed 0 (reused, not trained again).
    default_curve = [[0, 0.0, 30.0, None], [steps // 2, 1.0, 0.9, 1.0], [steps, 2.0, 0.5, 0.6]]
    rows = [
        {"workload": "tabular_mlp", "steps": steps, "optimizer": "adam", "rate": 0.01,
         "seed": 0, "phase": "sweep", "quick": True, "evals": evals, "final": 0.7},
        {"workload": "tabular_mlp", "steps": steps, "optimizer": "sgd", "rate": 0.01,
         "seed": 0, "phase": "sweep", "quick": True, "evals": evals, "final": 0.9},
        {"workload": "tabular_mlp", "steps": steps, "optimizer": "thor", "rate": 0.0,
         "seed": 0, "phase": "sweep", "quick": True, "evals": evals, "final": 0.5,
         "curve": default_curve, "wall_seconds": 2.0},
    ]
    horizon = tmp_path / "horizon_runs.jsonl"
    horizon.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "lv"
    argv = ["--quick", "--evals", str(evals), "--out", str(out), "--horizon-cache",
            str(horizon)]
    record = lv.main(argv)
    assert record["trained"] == 1                       # the lever; the default was reused
    (line,) = (out / lv.CACHE).read_text().splitlines()
    run = json.loads(line)
    assert {"workload", "multiple", "steps", "lever", "options", "seed", "quick", "evals",
            "final", "curve", "wall_seconds"} <= set(run)
    assert (run["lever"], run["options"], run["steps"]) == (
        lv.QUICK_LEVER, {"floor_fraction": 0.1}, steps)
    assert [len(point) for point in run["curve"]] == [4] * (evals + 1)
    assert run["curve"][-1][0] == steps and run["final"] == run["curve"][-1][2]

    c = record["levers"][lv.QUICK_LEVER]["workloads"]["tabular_mlp"]["1"]
    assert (c["seeds"], c["steps"], c["target"]) == ([0], steps, 0.7)
    assert c["target_from"] == {"optimizer": "adam", "rate": 0.01, "seed": 0}
    assert c["default_sources"] == ["horizon (sweep)"]
    assert c["final"]["default"]["per_seed"] == [0.5]
    assert c["final"]["lever"]["per_seed"] == [run["final"]]
    assert c["final"]["difference"]["per_seed"] == [pytest.approx(run["final"] - 0.5)]
    assert c["steps_to_target"]["default"]["per_seed"] == [steps]      # 0.9, then 0.5 <= 0.7
    assert c["steps_to_target"]["lever"]["per_seed"] == [
        lv.steps_to(run["curve"], 0.7, higher_is_better=False)]
    assert record["levers"][lv.QUICK_LEVER]["verdict"]["adopt"] is False
    assert json.loads((out / "levers.json").read_text())["levers"] == json.loads(
        json.dumps(record["levers"]))
    assert (out / "levers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tabular_mlp 1×" in (out / "levers.md").read_text()

    # Resumes: a second run (and --report-only) trains nothing and gives the same cells.
    from experiments import suite

    monkeypatch.setattr(suite, "train_run", _no_training)
    again = lv.main(argv)
    assert again["trained"] == 0 and again["levers"] == record["levers"]
    assert lv.main(argv + ["--report-only"])["levers"] == record["levers"]
