"""Finished runs as JSON lines: the one cache of the studies (batch scaling, horizon, levers).

A study trains a run once. Each finished run is one line of its file: what identifies it (the
workload, its steps and batch, the optimizer and rate or THOR's options, the seed, the phase,
``quick`` and the evaluation count) and what it gave (:func:`run_outcome`: the final metric,
the evaluation curve, the clock). A rerun reads the file back and trains only what is missing,
so a killed study loses at most the run in progress; a later line replaces an earlier one with
the same key, and a line cut short by a kill is skipped.

:class:`RunCache` is the cache of a tuning study (``batch_scaling.py``, ``horizon.py``): a
baseline at a rate, THOR at its default or at an explicit peak (:data:`THOR_PEAK`), trained
alone ("sweep") or as an interleaved pair with a baseline ("interleaved").
:class:`JsonlRuns` is what any study's cache shares (``levers.py`` keys its runs by THOR's
options).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

#: THOR at an explicit peak: the suite's "thor" with ``--thor-option peak=<rate>``; its runs
#: are stored under this name with the peak as their rate.
THOR_PEAK = "thor_peak"

#: The eigenbasis rule's options THOR trains with in the studies over this cache (the horizon
#: and batch-scaling studies, the levers): the default as it was when their runs were trained
#: (``relative_epsilon`` 1e-2, the default before 2026-11-30), so that a run read back from a
#: cache and one trained now are the same configuration. The default since then (0.1) is the
#: levers' ``releps_big`` (docs/levers.md), whose runs give its figures at the studies'
#: lengths (docs/horizon.md).
#: β₁ is pinned at the value those runs had, so a later default does not change what a cached
#: run means either (the levers' ``beta1_*`` set their own).
STUDY_RULE = {"relative_epsilon": 1e-2, "beta_1": 0.9}


def study_rule(**options):
    """The studies' eigenbasis rule (:data:`STUDY_RULE`) with ``options`` changed."""
    import thor_tf

    return thor_tf.rules.Eigenbasis(**{**STUDY_RULE, **options})


def study_thor_options(*options, rule=None):
    """``[(name, value)]`` wrap options of the studies' THOR: :func:`study_rule` (with the
    options ``rule`` changed) and ``options``."""
    return [("update_rule", study_rule(**(rule or {}))), *options]


class NotCached(LookupError):
    """A run the record needs is not in the cache (``--report-only`` trains nothing)."""


def read_jsonl(path):
    """The runs of the JSON-lines file ``path`` in file order (none when it does not exist);
    a line that does not parse (blank, or being written by a running study) is skipped."""
    runs = []
    if path is not None and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return runs


def append_line(path, run):
    """Append ``run`` to the JSON-lines file ``path`` (created with its directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(run, separators=(",", ":")) + "\n")


def run_outcome(rows, wall):
    """A finished run's stored fields from its evaluation rows (``suite.train_run``'s) and its
    wall seconds: the final metric, the curve ``[step, seconds, metric, train_loss]``, the clock's
    first-call and steady seconds and load, the wall seconds and the date."""
    last = rows[-1]
    return {"final": last["metric"],
            "curve": [[r["step"], r["seconds"], r["metric"], r["train_loss"]] for r in rows],
            "first_seconds": last.get("first_seconds"),
            "steady_seconds_per_step": last.get("steady_seconds_per_step"),
            "load": last.get("load"), "wall_seconds": round(wall, 1),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def rate_key(rate):
    """A rate as a key: six significant digits, so 0.0033 and 0.00330000001 are one run."""
    return f"{float(rate):.6g}"


def total_steps(workload, data):
    """The steps of one run of ``workload`` on ``data``: one pass of the char GPT's batches,
    else the epochs' batches."""
    return (data.num_train // workload.batch_size) * (1 if workload.single_pass
                                                      else workload.epochs)


def train_one(workload, data, optimizer, lr, seed, quick, evals, log):
    """One run of the suite's recipe (``suite.train_run``), its rows to ``log``: a baseline at
    ``lr``, THOR at the studies' rule (:data:`STUDY_RULE`) and its default peak (``"thor"``,
    ``lr`` unused) or the explicit peak ``lr`` (:data:`THOR_PEAK`, its rows named so)."""
    from experiments import suite

    peak = optimizer == THOR_PEAK
    args = argparse.Namespace(quick=quick, evals=evals,
                              thor_option=study_thor_options(*([("peak", lr)] if peak else [])))
    suite.train_run(workload, data, "thor" if peak else optimizer, lr, seed, args,
                    lambda row: log({**row, "optimizer": optimizer} if peak else row))


def curve_rows(run):
    """A stored run's evaluation curve as the suite's rows (``workload``, ``seed``, ``step``,
    ``seconds``, ``metric``, ``train_loss`` and the run's clock)."""
    return [{"workload": run["workload"], "seed": run["seed"], "step": step,
             "seconds": seconds, "metric": metric, "train_loss": loss,
             "first_seconds": run.get("first_seconds"),
             "steady_seconds_per_step": run.get("steady_seconds_per_step"),
             "load": run.get("load")} for step, seconds, metric, loss in run["curve"]]


class JsonlRuns:
    """Finished runs kept in the JSON-lines file ``path``, keyed by :meth:`key_of` (a subclass
    defines it); ``quick`` and ``evals`` are the study's, ``train`` False when a missing run
    must not be trained (``--report-only``)."""

    def __init__(self, path, quick, evals, train=True):
        self.path, self.quick, self.evals, self.train = Path(path), quick, evals, train
        self.runs = {self.key_of(run): run for run in read_jsonl(self.path)}
        self.trained = 0

    @staticmethod
    def key_of(run):
        raise NotImplementedError

    def add(self, run):
        """Keep ``run`` and append it to the file."""
        self.runs[self.key_of(run)] = run
        append_line(self.path, run)
        self.trained += 1
        return run

    def of(self, name, steps):
        """This study's runs (its ``quick`` and ``evals``) of workload ``name`` at ``steps``."""
        return [r for r in self.runs.values() if (r["workload"], r["steps"], r["quick"],
                                                  r["evals"]) == (name, steps, self.quick,
                                                                  self.evals)]

    def wall_seconds(self, name, steps):
        """``(runs, wall seconds)`` of workload ``name`` at ``steps``."""
        runs = self.of(name, steps)
        return len(runs), sum(r.get("wall_seconds") or 0.0 for r in runs)


class RunCache(JsonlRuns):
    """A tuning study's runs (module docstring); a run it holds is read back, a missing one
    trained (or :class:`NotCached` when ``train`` is False). ``final`` and ``interleave`` are
    what ``batch_scaling.tune`` / ``run_seeds`` and the studies call."""

    def __init__(self, path, quick, evals, train=True):
        super().__init__(path, quick, evals, train)
        #: ``{(workload name, steps): multiple}`` (the study sets it; stored with a run).
        self.multiple = {}

    @staticmethod
    def key_of(run):
        return (run["workload"], run["steps"], run["batch"], run["optimizer"],
                rate_key(run["rate"]), run["seed"], run["phase"], run["quick"], run["evals"])

    def get(self, workload, data, optimizer, lr, seed, phase):
        return self.runs.get((workload.name, total_steps(workload, data), workload.batch_size,
                              optimizer, rate_key(lr), seed, phase, self.quick, self.evals))

    def _missing(self, workload, data, what):
        if not self.train:
            raise NotCached(f"{workload.name} at {total_steps(workload, data)} steps of batch "
                            f"{workload.batch_size}: {what}")

    def store(self, workload, data, optimizer, lr, seed, phase, rows, wall, **extra):
        steps = total_steps(workload, data)
        return self.add({"workload": workload.name,
                         "multiple": self.multiple.get((workload.name, steps)),
                         "steps": steps, "batch": workload.batch_size, "optimizer": optimizer,
                         "rate": float(lr), "seed": int(seed), "phase": phase,
                         "quick": self.quick, "evals": self.evals, **run_outcome(rows, wall),
                         **extra})

    def final(self, workload, data, optimizer, lr, seed):
        """The final metric of a tuning ("sweep") run, trained when missing."""
        run = self.get(workload, data, optimizer, lr, seed, "sweep")
        if run is None:
            self._missing(workload, data, f"{optimizer} {lr:g} seed {seed}")
            rows, started = [], time.perf_counter()
            train_one(workload, data, optimizer, lr, seed, self.quick, self.evals, rows.append)
            run = self.store(workload, data, optimizer, lr, seed, "sweep", rows,
                             time.perf_counter() - started)
        return run["final"]

    def interleave(self, workload, data, baseline, rate, seeds, rule=None,
                   phase="interleaved"):
        """THOR (the studies' rule with ``rule``'s options changed, its default peak) and
        ``baseline`` at ``rate``, each seed an interleaved pair (``interleave.interleaved_rows``),
        stored under ``phase`` when the pair ends (THOR's line with its ``rule``); held pairs
        skipped. A pair at another rule must have its own ``phase``: the summaries read
        "interleaved" as the studies' rule."""
        from experiments.interleave import interleaved_rows

        for seed in seeds:
            if (self.get(workload, data, "thor", 0.0, seed, phase)
                    and self.get(workload, data, baseline, rate, seed, phase)):
                continue
            self._missing(workload, data, f"{phase} pair thor / {baseline} seed {seed}")
            started = time.perf_counter()
            rows = interleaved_rows(workload, data, baseline, rate, seed, self.evals,
                                    thor_options=study_thor_options(rule=rule),
                                    quick=self.quick)
            wall = (time.perf_counter() - started) / 2
            for optimizer, lr in (("thor", 0.0), (baseline, rate)):
                extra = {"rule": rule} if rule and optimizer == "thor" else {}
                self.store(workload, data, optimizer, lr, seed, phase,
                           [r for r in rows if r["optimizer"] == optimizer], wall,
                           pair=[baseline, float(rate)], **extra)

    def rows(self, name=None, steps=None):
        """The suite-shaped evaluation rows (what the studies' summaries read: ``workload``,
        ``batch``, ``phase``, ``optimizer``, ``lr``, ``seed``, ``step``, ``seconds``,
        ``metric``, ``train_loss`` and the clock) of this study's runs, of workload ``name``
        at ``steps`` when given."""
        out = []
        for run in self.runs.values():
            if (run["quick"], run["evals"]) != (self.quick, self.evals) or (
                    name is not None and run["workload"] != name) or (
                    steps is not None and run["steps"] != steps):
                continue
            out += [{**row, "batch": run["batch"], "phase": run["phase"],
                     "optimizer": run["optimizer"], "lr": run["rate"]}
                    for row in curve_rows(run)]
        return out
