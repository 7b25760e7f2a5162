"""experiments/timing.py, the timing harness of the comparison scripts: the order of the runs,
a run's first and steady seconds, the machine load it records, and when THOR's seconds are
compared with a baseline's. Pure Python, fed with numbers: no timing is asserted."""

import math

import pytest

from experiments import timing


# --------------------------------------------------------------------------------- order

def test_runs_alternate_thor_first_and_baselines_first_across_seeds():
    plan = [("thor", 0.0), ("adam", 1e-2), ("adam", 3e-2), ("muon", 1e-2)]
    orders = [timing.run_order(plan, i) for i in range(4)]
    assert orders[0] == plan and orders[2] == plan            # 1st, 3rd seed: THOR first
    assert orders[1] == plan[::-1] and orders[3] == plan[::-1]  # 2nd, 4th: baselines first
    assert orders[1][-1] == ("thor", 0.0)
    assert timing.order_text(0) == "THOR first" and timing.order_text(1) == "baselines first"
    assert timing.run_order(iter(plan), 1) == plan[::-1]      # any iterable


def test_segments_between_evaluations():
    assert timing.segments(60, 20) == [(0, 20), (20, 20), (40, 20)]
    assert timing.segments(50, 20) == [(0, 20), (20, 20), (40, 10)]


# --------------------------------------------------------------------------------- load

class FakeMachine:
    """/proc/stat's (busy, total) CPU seconds, this process's CPU seconds and the wall clock,
    advanced by hand."""

    def __init__(self):
        self.busy = self.total = self.own = self.wall = 0.0

    def advance(self, wall, cpus, own, others):
        self.wall += wall
        self.total += wall * cpus
        self.own += own
        self.busy += own + others

    def meter(self, **kwargs):
        return timing.LoadMeter(read_stat=lambda: (self.busy, self.total),
                                process_time=lambda: self.own, wall=lambda: self.wall, **kwargs)


def test_load_is_the_cpu_share_other_processes_used():
    machine = FakeMachine()
    meter = machine.meter()
    meter.start()
    machine.advance(wall=10.0, cpus=2, own=12.0, others=5.0)   # 20 CPU seconds in all
    other, capacity = meter.stop()
    assert (other, capacity) == (5.0, 20.0)
    assert meter.stop() is None                               # no interval started
    meter.start()
    machine.advance(wall=1.0, cpus=2, own=2.0, others=0.0)
    machine.own += 0.5          # the process counted more than the machine saw (clock skew)
    assert meter.stop() == (0.0, 2.0)                         # clipped at 0, never negative


def test_load_without_proc_stat_uses_the_load_average():
    clock = {"own": 0.0, "wall": 0.0}
    meter = timing.LoadMeter(read_stat=lambda: None, process_time=lambda: clock["own"],
                             wall=lambda: clock["wall"], loadavg=lambda: 2.5, cpus=4)
    meter.start()
    clock.update(own=15.0, wall=10.0)  # this process: 1.5 cores of the 2.5 the load average counts
    other, capacity = meter.stop()
    assert capacity == 40.0 and other == pytest.approx(10.0)  # 1 core of 4 elsewhere: 25 %
    unknown = timing.LoadMeter(read_stat=lambda: None, loadavg=lambda: None)
    unknown.start()
    assert unknown.stop() is None


def test_read_proc_stat(tmp_path):
    path = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text("cpu  100 0 50 800 50 0 0 0 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    busy, total = timing.read_proc_stat(str(path))
    tick = __import__("os").sysconf("SC_CLK_TCK")
    assert busy == pytest.approx(150 / tick) and total == pytest.approx(1000 / tick)
    assert timing.read_proc_stat(str(tmp_path / "missing")) is None


# --------------------------------------------------------------------------------- a run

def test_run_clock_splits_the_first_segment_and_weighs_the_load():
    clock = timing.RunClock(meter=object())
    assert clock.fields() == {"first_seconds": None, "steady_seconds_per_step": None,
                              "load": None}
    clock.add(5.0, 10, (2.0, 10.0))     # tracing + 10 steps, 20 % load
    assert clock.fields() == {"first_seconds": 5.0, "steady_seconds_per_step": None,
                              "load": 0.2}
    clock.add(1.0, 10, (0.0, 2.0))
    clock.add(2.0, 30, (2.0, 4.0))
    assert clock.seconds == 8.0 and clock.first_seconds == 5.0
    assert clock.steady_seconds_per_step == pytest.approx(3.0 / 40)
    assert clock.load == pytest.approx(4.0 / 16.0)            # CPU seconds, not segments, weigh
    summary = clock.summary()
    assert summary["first_overhead_seconds"] == pytest.approx(5.0 - 10 * 3.0 / 40)
    clock.add(1.0, 10, None)                                   # a segment's load unknown
    assert clock.load is None and clock.fields()["load"] is None


# --------------------------------------------------------------------------------- comparing

def test_seconds_are_compared_when_the_loads_leave_both_the_same_cpu():
    result = timing.compare({0: 0.02, 1: 0.10}, {0: 0.05, 1: 0.05},
                            {"to_target": (30.0, 40.0), "steady_step": (0.012, 0.010),
                             "first": (None, 3.0)}, "adam")
    assert result["comparable"] and result["reason"] is None
    assert result["ratios"] == {"to_target": pytest.approx(0.75),
                                "steady_step": pytest.approx(1.2), "first": None}
    assert result["loads"] == {0: [0.02, 0.05], 1: [0.10, 0.05]}
    assert timing.ratio_text(result, "to_target") == "0.75x"
    assert timing.ratio_text(result, "first") == "never"
    assert "10% / 5% (seed 1)" in timing.loads_text(result)


def test_seconds_under_different_loads_are_refused_naming_the_seed():
    result = timing.compare({0: 0.02, 1: 0.50}, {0: 0.03, 1: 0.04},
                            {"to_target": (30.0, 40.0)}, "muon")
    assert not result["comparable"] and result["ratios"] == {"to_target": None}
    assert result["reason"].startswith("seed 1: other processes used 50% of the CPU during "
                                       "THOR's run and 4% during muon's")
    assert "1.92x (limit 1.10x)" in result["reason"]
    assert timing.ratio_text(result, "to_target") == timing.NOT_COMPARABLE


def test_the_limit_is_on_the_cpu_share_left_to_each_run():
    # 1 − 0.0 = 1.0 against 1 − 0.09 = 0.91: 1.0989x, within 1.10x; 0.12: 1.136x, not.
    assert timing.pair_comparable(0.0, 0.09) and timing.pair_comparable(0.09, 0.0)
    assert not timing.pair_comparable(0.0, 0.12)
    # The same absolute difference weighs more on a busy machine: 0.60 vs 0.66 is 1.18x.
    assert not timing.pair_comparable(0.60, 0.66)
    assert timing.share_ratio(0.5, 1.0) == math.inf and not timing.pair_comparable(0.5, 1.0)
    assert timing.pair_comparable(0.2, 0.3, limit=1.2) and not timing.pair_comparable(None, 0.1)


def test_missing_loads_and_seeds_are_not_comparable():
    result = timing.compare({0: None}, {0: 0.1}, {"to_target": (1.0, 2.0)}, "adam")
    assert not result["comparable"]
    assert "no machine load recorded for THOR's run" in result["reason"]
    result = timing.compare({0: 0.1}, {1: 0.1}, {"to_target": (1.0, 2.0)}, "adam")
    assert not result["comparable"] and "no seed was run by both" in result["reason"]


def test_median_of_known_values():
    assert timing.median([3.0, None, 1.0]) == 2.0 and timing.median([None]) is None
