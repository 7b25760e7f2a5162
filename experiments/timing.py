"""Honest seconds: the timing harness of the comparison scripts (``suite.py`` and the
main job over it, ``lm.py``, ``finetune.py``).

The rules (docs/timing.md):

* **Same conditions.** For each workload and seed the optimizers run back to back in one process,
  in alternating order across seeds (:func:`run_order`): the 1st, 3rd, ... seed of ``--seeds``
  runs the plan as listed (THOR first), the 2nd, 4th, ... reversed (the baselines first), so a
  drift of the machine's speed during a run falls on both sides.
* **Split seconds.** A run trains in segments, one Keras ``fit`` epoch each (an epoch, or the
  steps between two evaluations). The first segment holds the graph tracing and compilation:
  ``first_seconds``; the others give ``steady_seconds_per_step`` (:class:`RunClock`).
* **Load.** Each segment measures the share of the machine's CPU time that *other* processes used
  while it trained (:class:`LoadMeter`); a run's ``load`` is that share over all its segments
  (0: the machine was ours; 0.5 on 2 cores: one core was busy elsewhere).
* **Refusal.** A run that gets a share ``1 − load`` of the CPU runs about ``1 / (1 − load)``
  times slower than on an idle machine (a CPU-bound process using every core). THOR's seconds are
  compared with a baseline's only when, on every seed, the two runs' shares differ by at most the
  factor :data:`MAX_SHARE_RATIO` (1.10: the load may explain at most a 10 % difference in
  seconds); otherwise they are reported "not comparable", with the seed and both loads
  (:func:`compare`). A run without a recorded load (a CSV from before this harness) is never
  comparable.

Pure Python except :func:`fit_segment` and :meth:`RunClock.callback` (Keras, imported when called).
"""

from __future__ import annotations

import os
import statistics
import time

#: Largest ratio of the CPU shares left to THOR's and the baseline's runs (``1 − load``) at which
#: their seconds are still compared: the load can then explain at most a 10 % difference.
MAX_SHARE_RATIO = 1.10

#: The CSV columns every script adds (the run so far, at each row; empty before training).
CSV_COLUMNS = ("first_seconds", "steady_seconds_per_step", "load")

NOT_COMPARABLE = "not comparable"


# --------------------------------------------------------------------------------------------
# The order of the runs
# --------------------------------------------------------------------------------------------

def run_order(plan, seed_index):
    """The runs of one seed in the order they train: ``plan`` as listed (THOR first) for the
    1st, 3rd, ... seed of the list (``seed_index`` 0, 2, ...), reversed (the baselines first)
    for the 2nd, 4th, ..."""
    plan = list(plan)
    return plan if seed_index % 2 == 0 else plan[::-1]


def order_text(seed_index):
    return "THOR first" if seed_index % 2 == 0 else "baselines first"


# --------------------------------------------------------------------------------------------
# Machine load
# --------------------------------------------------------------------------------------------

def read_proc_stat(path="/proc/stat"):
    """``(busy, total)`` CPU seconds of the whole machine since boot (Linux ``/proc/stat``: busy
    is everything but idle and iowait; guest time is inside user time), or None elsewhere."""
    try:
        with open(path) as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (sum(values) - idle) / tick, sum(values) / tick


def _loadavg():
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


class LoadMeter:
    """The CPU time other processes used between :meth:`start` and :meth:`stop`.

    From ``/proc/stat``: the machine's busy CPU seconds minus this process's own (all its threads,
    ``time.process_time``), against the machine's CPU seconds in the interval. Where there is no
    ``/proc/stat``: the 1-minute load average minus this process's own use, against the number of
    CPUs (a lagging estimate). The readers are arguments so that tests can feed numbers.
    """

    def __init__(self, read_stat=read_proc_stat, process_time=time.process_time,
                 wall=time.perf_counter, loadavg=_loadavg, cpus=None):
        self._read_stat, self._process_time, self._wall = read_stat, process_time, wall
        self._loadavg = loadavg
        self._cpus = cpus or os.cpu_count() or 1
        self._start = None

    def start(self):
        self._start = (self._read_stat(), self._process_time(), self._wall())

    def stop(self):
        """``(other, capacity)``: CPU seconds other processes used and the machine's CPU seconds
        since :meth:`start`; None when unknown."""
        if self._start is None:
            return None
        stat0, own0, wall0 = self._start
        stat1, own1, wall1 = self._read_stat(), self._process_time(), self._wall()
        self._start = None
        own = max(own1 - own0, 0.0)
        if stat0 is not None and stat1 is not None:
            busy, total = stat1[0] - stat0[0], stat1[1] - stat0[1]
            if total > 0:
                return min(max(busy - own, 0.0), total), total
            return None
        wall = wall1 - wall0
        average = self._loadavg()
        if average is None or wall <= 0:
            return None
        capacity = self._cpus * wall
        return min(max(average - own / wall, 0.0) * wall, capacity), capacity


# --------------------------------------------------------------------------------------------
# One run's seconds
# --------------------------------------------------------------------------------------------

class RunClock:
    """Training seconds and load of one run, segment by segment (one ``fit`` epoch each)."""

    def __init__(self, meter=None):
        self._meter = meter if meter is not None else LoadMeter()
        self.segments = []   # {"seconds", "steps", "other", "capacity"} per segment
        self._t0 = None

    def start(self):
        self._meter.start()
        self._t0 = time.perf_counter()

    def stop(self, steps):
        """End the segment started by :meth:`start` (``steps`` training steps); its seconds."""
        seconds = time.perf_counter() - self._t0
        self.add(seconds, steps, self._meter.stop())
        return seconds

    def add(self, seconds, steps, load_sample=None):
        """Record a segment: ``seconds`` of training for ``steps`` steps; ``load_sample``: what
        :meth:`LoadMeter.stop` returned (None: unknown)."""
        other, capacity = load_sample if load_sample is not None else (None, None)
        self.segments.append({"seconds": float(seconds), "steps": int(steps), "other": other,
                              "capacity": capacity})

    @property
    def seconds(self):
        return sum(s["seconds"] for s in self.segments)

    @property
    def first_seconds(self):
        """The first segment's seconds: graph tracing and compilation, and its steps."""
        return self.segments[0]["seconds"] if self.segments else None

    @property
    def steady_seconds_per_step(self):
        """Seconds per step over the segments after the first (None before there is one)."""
        rest = self.segments[1:]
        steps = sum(s["steps"] for s in rest)
        return sum(s["seconds"] for s in rest) / steps if steps else None

    @property
    def load(self):
        """The share of the machine's CPU time other processes used while this run trained
        (0..1), or None when a segment's is unknown."""
        if not self.segments or any(s["capacity"] is None for s in self.segments):
            return None
        capacity = sum(s["capacity"] for s in self.segments)
        return sum(s["other"] for s in self.segments) / capacity if capacity > 0 else None

    def fields(self):
        """The :data:`CSV_COLUMNS` of a row written now (the run so far)."""
        return {"first_seconds": _round(self.first_seconds, 4),
                "steady_seconds_per_step": _round(self.steady_seconds_per_step, 6),
                "load": _round(self.load, 4)}

    def summary(self):
        """The fields, and the first segment's seconds beyond its steps at the steady rate (an
        estimate of tracing and compilation)."""
        out = self.fields()
        steady = self.steady_seconds_per_step
        out["first_overhead_seconds"] = (
            _round(self.first_seconds - self.segments[0]["steps"] * steady, 4)
            if steady is not None else None)
        return out

    def callback(self, steps):
        """A Keras callback timing one ``fit`` epoch (on_epoch_begin to on_epoch_end) of
        ``steps`` steps into this clock; it keeps that epoch's ``seconds`` and ``logs``."""
        import keras

        clock = self

        class SegmentTimer(keras.callbacks.Callback):
            seconds, logs = 0.0, {}

            def on_epoch_begin(self, epoch, logs=None):
                clock.start()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds = clock.stop(steps)
                self.logs = dict(logs or {})

        return SegmentTimer()


def _round(value, digits):
    return None if value is None else round(float(value), digits)


def fit_segment(model, clock, index, x, y, batch_size, verbose=False, callbacks=()):
    """Train ``model`` one segment: Keras ``fit`` epoch ``index`` over ``x``, ``y`` in order
    (``x`` an array or a dict of arrays), timed into ``clock``; ``callbacks``: more Keras
    callbacks for the ``fit`` (after the timer, so their own work inside the epoch is timed).
    Returns ``(its training seconds, its train loss)``."""
    first = next(iter(x.values())) if isinstance(x, dict) else x
    steps = -(-len(first) // batch_size)
    timer = clock.callback(steps)
    model.fit(x, y, batch_size=batch_size, epochs=index + 1, initial_epoch=index, shuffle=False,
              verbose=1 if verbose else 0, callbacks=[timer, *callbacks])
    return timer.seconds, float(timer.logs.get("loss", float("nan")))


def segments(steps, every):
    """``[(first step, number of steps), ...]`` between evaluations."""
    return [(s, min(every, steps - s)) for s in range(0, steps, every)]


# --------------------------------------------------------------------------------------------
# THOR against a baseline
# --------------------------------------------------------------------------------------------

def share_ratio(load_a, load_b):
    """How many times more CPU one run had than the other (``(1 − load)`` of each, larger over
    smaller; inf when one had none)."""
    a, b = 1.0 - load_a, 1.0 - load_b
    if min(a, b) <= 0:
        return float("inf")
    return max(a, b) / min(a, b)


def pair_comparable(load_a, load_b, limit=MAX_SHARE_RATIO):
    """Whether two runs' seconds may be compared: both loads known and their CPU shares within
    ``limit`` of each other."""
    return load_a is not None and load_b is not None and share_ratio(load_a, load_b) <= limit


def compare(thor_loads, baseline_loads, measures, baseline="the baseline",
            limit=MAX_SHARE_RATIO):
    """THOR's seconds over a baseline's, or "not comparable" and why.

    Args:
      thor_loads, baseline_loads: ``{seed: load}`` of each side's runs (the share of the CPU time
        other processes used during the run, 0..1; None unknown).
      measures: ``{name: (THOR's seconds, the baseline's seconds)}`` (e.g. medians over the seeds
        of the seconds to the target, of the first segment, of a steady step); None: never
        reached or unknown.
      baseline: its name, for the reason.
      limit: :data:`MAX_SHARE_RATIO`.

    Returns:
      ``{"comparable", "reason", "ratios": {name: THOR / baseline or None}, "loads": {seed:
      [THOR's, the baseline's]}, "limit"}``. Not comparable: every ratio None and ``reason``
      names the first seed that fails (no seed in common, a load not recorded, or CPU shares
      more than ``limit`` apart).
    """
    seeds = sorted(set(thor_loads) & set(baseline_loads))
    loads = {seed: [thor_loads[seed], baseline_loads[seed]] for seed in seeds}
    reason = None
    if not seeds:
        reason = f"no seed was run by both THOR and {baseline}"
    for seed in seeds:
        a, b = loads[seed]
        if a is None or b is None:
            reason = (f"seed {seed}: no machine load recorded for "
                      f"{'THOR' if a is None else baseline}'s run (a CSV from before the timing "
                      f"harness?)")
            break
        if not pair_comparable(a, b, limit):
            reason = (f"seed {seed}: other processes used {a:.0%} of the CPU during THOR's run "
                      f"and {b:.0%} during {baseline}'s: the CPU left to them differs "
                      f"{share_ratio(a, b):.2f}x (limit {limit:.2f}x)")
            break
    ratios = {name: (None if reason is not None else _ratio(t, b))
              for name, (t, b) in measures.items()}
    return {"comparable": reason is None, "reason": reason, "ratios": ratios, "loads": loads,
            "limit": limit}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def ratio_text(result, name, spec=".2f"):
    """One ratio of a :func:`compare` result for a table: ``"0.83x"``, ``"never"`` (a side never
    reached it) or ``"not comparable"``."""
    if not result["comparable"]:
        return NOT_COMPARABLE
    value = result["ratios"].get(name)
    return "never" if value is None else f"{format(value, spec)}x"


def loads_text(result):
    """``"load THOR / baseline: 3 % / 4 % (seed 0), ..."`` for a note."""
    parts = [f"{_pct(a)} / {_pct(b)} (seed {seed})" for seed, (a, b) in result["loads"].items()]
    return "load THOR / baseline: " + (", ".join(parts) if parts else "none")


def _pct(value):
    return "?" if value is None else f"{value:.0%}"


def median(values):
    """Median of the known values (None when there are none)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def train_step_seconds(model):
    """A list that receives the seconds of each Python call of ``model.train_step``: Keras runs
    ``train_step`` only while tracing its train function, so each entry is a trace (the first:
    the whole step's graph being built)."""
    original = model.train_step
    spent = []

    def timed(data):
        start = time.perf_counter()
        out = original(data)
        spent.append(time.perf_counter() - start)
        return out

    object.__setattr__(model, "train_step", timed)
    return spent


def functions_in(fn, seen=None):
    """The ``tf.function`` objects reachable from ``fn`` through closures (Keras keeps its
    traced step inside the closures of ``model.train_function``)."""
    import tensorflow as tf

    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    found = []
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        found.append(fn)
        fn = getattr(fn, "_python_function", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value):
            found += functions_in(value, seen)
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None:
        found += functions_in(wrapped, seen)
    return found
