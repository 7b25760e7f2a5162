"""THOR at its defaults against first-order optimizers at their best, on a suite of workloads.

    python experiments/suite.py                 # every workload, 3 seeds (about an hour, 2 cores)
    python experiments/suite.py --quick         # tiny sizes, 1 seed: a smoke run (CI)
    python experiments/suite.py --workloads digits_cnn,autoencoder --seeds 0

Workloads (``experiments/workloads.py``): digits CNN, Fashion-MNIST CNN, ResNet-20, ViT, the deep
autoencoder of Martens & Grosse 2015, a tabular MLP (diabetes regression) and a char GPT. A
workload whose data is not on the machine is skipped with a line saying how to get it.

What each optimizer is:

* ``thor``: what a user gets: ``thor_tf.wrap(model, learning_rate=
  thor_tf.schedules.WarmupCosine(total_steps))`` and ``compile(loss=...)``; every other option is
  thor_tf's default. The same on every workload: no per-workload rate or damping.
  (``--thor-option NAME=VALUE`` changes one option, to measure candidates for the defaults; the
  results table says when one was given.)
* ``sgd`` (momentum 0.9), ``adam``, ``adamw`` (decoupled weight decay 0.004, Keras' default; the
  GPT's 0.1), ``muon`` (Keras' Muon; the head gets its AdamW step): their standard schedule,
  linear warmup over 5 % of the steps then cosine decay to 0 (the GPT: to lr/10, nanoGPT's
  recipe), over each workload's learning-rate grid (``workloads.py``); the best rate is the one
  with the best median final metric over the seeds (a warning says when it is at an end of the
  grid).

Fairness: for a seed, every run starts from the same weights (``keras.utils.set_random_seed``
before the model is built) and sees the same batches in the same order (one permutation per epoch
from the seed; the last partial batch of an epoch is dropped so every step is a full batch). The
test metric is measured at step 0 and at ``--evals`` evenly spaced steps (evaluation is not
timed); seconds are training seconds (``fit``), the first graph tracing included.

Seconds (``experiments/timing.py``, docs/timing.md): for a workload and seed every run trains back
to back in this process, THOR first on the 1st, 3rd, ... seed and last on the others; each run's
first segment (tracing) and steady seconds per step are kept apart, and the share of the CPU
other processes used during it (``load``). THOR's seconds ratio is given only when those loads
left THOR's and the best baseline's runs about the same CPU on every seed, else "not comparable"
with the reason in the notes.

Reported per workload: each optimizer's median final metric (at its best rate), and the steps and
seconds to the **target**, the best baseline's median final metric: the first evaluation at or
past it, median over seeds (a seed that never gets there counts as never; the median is "never"
when half or more do). Ratios THOR / best baseline. Outputs in ``--out`` (default
``runs/suite``): ``metrics.csv`` (every evaluation of every run, with the run's
``first_seconds``, ``steady_seconds_per_step`` and ``load`` so far), ``suite.json``, ``suite.md``
(the table, also printed) and ``suite.png`` (median curves, one panel per workload).
``--combine DIR...`` joins the ``metrics.csv`` of runs made in separate processes (older ones,
without the timing columns, join with their seconds "not comparable").
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import tables, timing, workloads as wl  # noqa: E402
from experiments.baselines import NAMES as BASELINES  # noqa: E402
from experiments.tables import fmt  # noqa: E402

FIELDS = ("workload", "optimizer", "lr", "seed", "step", "seconds", "metric",
          "train_loss") + timing.CSV_COLUMNS
COLORS = {"thor": "tab:red", "sgd": "tab:green", "adam": "tab:blue", "adamw": "tab:cyan",
          "muon": "tab:orange"}


# --------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------

def baseline_schedule(lr, total_steps, workload):
    """Linear warmup to ``lr`` over 5 % of the steps, then cosine to ``floor_fraction·lr``."""
    from experiments import baselines

    return baselines.warmup_cosine(lr, total_steps, floor_fraction=workload.floor_fraction)


def baseline_optimizer(name, lr, total_steps, workload, model):
    """Baseline ``name`` at peak ``lr`` on the workload's recipe (``baselines.first_order``:
    its decay, betas, clip and Muon's head) under :func:`baseline_schedule`."""
    from experiments import baselines

    return baselines.first_order(name, baseline_schedule(lr, total_steps, workload), model,
                                 workload.weight_decay, workload.betas, workload.clipnorm,
                                 workload.head)


def compiled_model(optimizer, lr, workload, data, quick, total_steps, thor_options,
                   verbose=False):
    """Build (the caller has seeded) and compile the model for ``optimizer`` (``verbose``: THOR's
    registration table)."""
    import thor_tf

    model = workload.build(data, quick)
    if optimizer == "thor":
        options = dict(thor_options)
        # --thor-option peak=X: the schedule's peak (default: the update rule's rate).
        peak = options.pop("peak", None)
        # --thor-option floor_fraction=F: the cosine ends at F times the peak (default 0), as
        # the baselines' ``workload.floor_fraction``; given as the schedule's absolute floor at
        # the unscaled peak, so a long run's ``reference_steps`` scaling lowers both alike.
        fraction = options.pop("floor_fraction", 0.0)
        # --thor-option decay_fraction=F: the cosine spans the run's last F, the rate held at
        # its peak from the warmup's end until then (warmup, stable, decay; default: cosine
        # after warmup).
        decay_fraction = options.pop("decay_fraction", None)
        floor = 0.0
        if fraction:
            rule = thor_tf.rules.resolve(options.get("update_rule") or thor_tf.rules.DEFAULT_RULE)
            floor = fraction * (rule.default_learning_rate if peak is None else peak)
        model = thor_tf.wrap(model, learning_rate=thor_tf.schedules.WarmupCosine(
            total_steps, peak, floor=floor, decay_fraction=decay_fraction), verbose=verbose,
            **options)
        model.compile(loss=workload.loss(), metrics=list(workload.metrics))
        return model
    model.compile(optimizer=baseline_optimizer(optimizer, lr, total_steps, workload, model),
                  loss=workload.loss(), metrics=list(workload.metrics))
    return model


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------

def batch_order(n, batch_size, epochs, seed, single_pass):
    """Row indices of every step, ``[steps, batch_size]``: one permutation per epoch from
    ``seed`` (the partial last batch dropped), or the rows in order for a single-pass workload."""
    import numpy as np

    if single_pass:
        steps = n // batch_size
        return np.arange(steps * batch_size).reshape(steps, batch_size)
    rng = np.random.default_rng([seed, 2024])
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise SystemExit(f"error: batch size {batch_size} exceeds the {n} training examples")
    return np.concatenate([rng.permutation(n)[:per_epoch * batch_size].reshape(per_epoch,
                                                                             batch_size)
                           for _ in range(epochs)])


def eval_steps(total, evals):
    """``evals`` evaluation points, evenly spaced, ending at ``total`` (0 not included)."""
    count = min(evals, total)
    return sorted({max(1, round(total * (i + 1) / count)) for i in range(count)})


class SegmentedRun:
    """One (workload, optimizer, lr, seed) on the suite's recipe, trained segment by segment
    (:func:`train_run` runs one through ``train.train_in_segments``; ``interleave.py`` alternates
    two on one host with :meth:`train`).

    Built on the current Keras seed (the caller seeds): ``compiled_model`` for ``total`` steps.
    :meth:`train` fits one segment (the rows ``idx`` of the training set, one Keras ``fit`` epoch,
    timed by ``timing.fit_segment``); :meth:`evaluate` appends one row (``FIELDS``) to ``rows``,
    untimed. ``log(row)`` receives each row; ``on_evaluate(model, row)`` and ``callbacks`` (Keras
    callbacks given to every segment, their work inside the timed segments) are hooks for
    diagnostics (``anatomy.py``). ``show_table``: THOR's registration table; ``progress``: a
    line per evaluation (:meth:`progress_line`)."""

    def __init__(self, workload, data, optimizer, lr, seed, quick, total, thor_options=(),
                 log=None, callbacks=(), on_evaluate=None, show_table=False, progress=False):
        self.workload, self.data, self.optimizer = workload, data, optimizer
        self.lr, self.seed, self.total = float(lr), int(seed), total
        self.model = compiled_model(optimizer, lr, workload, data, quick, total,
                                    thor_options if optimizer == "thor" else (), show_table)
        self.progress = progress
        if getattr(self.model.optimizer, "use_ema", False):
            # One run in segments, as one fit: Keras' fit ends by overwriting the weights with
            # their moving average (``finalize_variable_values``), which after every segment
            # would restart training from the average; :meth:`evaluate` looks at it instead.
            self.model.optimizer.finalize_variable_values = lambda variables: None
        self.clock, self.rows = timing.RunClock(), []
        self.log, self.callbacks, self.on_evaluate = log, callbacks, on_evaluate

    def evaluate(self, step, train_loss):
        """Evaluate on the workload's split; the row (also appended, logged and hooked)."""
        w, d = self.workload, self.data
        x, y = (d.x_train, d.y_train) if w.eval_split == "train" else (d.x_test, d.y_test)
        with averaged_weights(self.model):
            result = self.model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)
        row = {"workload": w.name, "optimizer": self.optimizer, "lr": self.lr,
               "seed": self.seed, "step": step, "seconds": round(self.clock.seconds, 4),
               "metric": float(result[w.metric]), "train_loss": train_loss,
               **self.clock.fields()}
        self.rows.append(row)
        if self.progress:
            print(self.progress_line(row), flush=True)
        if self.log is not None:
            self.log(row)
        if self.on_evaluate is not None:
            self.on_evaluate(self.model, row)
        return row

    def train(self, index, idx):
        """Fit segment ``index`` on training rows ``idx`` (flat); its mean training loss."""
        x = wl.take(self.data.x_train, idx)
        _, loss = timing.fit_segment(self.model, self.clock, index, x, self.data.y_train[idx],
                                     self.workload.batch_size, callbacks=self.callbacks)
        return loss

    def tag(self):
        lr = "" if self.optimizer == "thor" else f" lr={self.lr:g}"
        return f"[{self.workload.name} {self.optimizer}{lr} seed={self.seed}]"

    def progress_line(self, row):
        """``[workload optimizer lr seed] step s/total  metric  train_loss  seconds``, and THOR's
        refreshes (and skipped steps, if any) so far."""
        loss = row["train_loss"]
        return (f"{self.tag()} step {row['step']}/{self.total}  {self.workload.metric} "
                f"{row['metric']:.4f}  train_loss "
                f"{'–' if loss is None else format(loss, '.4f')}  {row['seconds']:.1f}s"
                f"{self._thor_status()}")

    def _thor_status(self):
        """THOR's block refreshes so far (summed over layers) and its skipped steps, if any, as
        the lines print them ("" for a baseline)."""
        if self.optimizer != "thor":
            return ""
        thor = self.model.thor
        skipped = thor.counters()["nonfinite_steps"]
        # Many skipped steps mean the run diverged: said in capitals.
        return (f"  refreshes {sum(s['refreshes'] for s in thor.layer_stats())}"
                + (f"  NON-FINITE STEPS SKIPPED {skipped}" if skipped else ""))

    def summary_line(self):
        """``[workload optimizer lr seed] steps  metric  seconds (first, load)  refreshes``."""
        load, clock = self.clock.load, self.clock
        return (f"{self.tag()} {self.total} steps  "
                f"{self.workload.metric} {self.rows[-1]['metric']:.4f}  {clock.seconds:.1f}s "
                f"(first {clock.first_seconds:.1f}s, load {'?' if load is None else f'{load:.0%}'})"
                f"{self._thor_status()}")


@contextlib.contextmanager
def averaged_weights(model):
    """The optimizer's moving average of the trainable weights (Keras' ``use_ema``) in their
    place for the duration, what a ``fit`` ending there leaves; the trained values back after.
    Without ``use_ema`` (or before the first step) nothing changes."""
    optimizer = model.optimizer
    averages = getattr(optimizer, "_model_variables_moving_average", None) or []
    if not (getattr(optimizer, "use_ema", False) and averages and int(optimizer.iterations)):
        yield
        return
    variables = optimizer._trainable_variables  # the averages' order (Keras' build)
    trained = [v.numpy() for v in variables]
    for variable, average in zip(variables, averages):
        variable.assign(average)
    try:
        yield
    finally:
        for variable, value in zip(variables, trained):
            variable.assign(value)


def segment_plan(workload, data, seed, evals):
    """``(order, [(index, rows), ...])``: the run's batch order (:func:`batch_order`) and, per
    segment between two of ``evals`` evaluations, its index and the flat training rows."""
    order = batch_order(data.num_train, workload.batch_size, workload.epochs, seed,
                        workload.single_pass)
    plan, done = [], 0
    for index, stop in enumerate(eval_steps(len(order), evals)):
        plan.append((index, stop, order[done:stop].reshape(-1)))
        done = stop
    return order, plan


def train_run(workload, data, optimizer, lr, seed, args, log, callbacks=(), on_evaluate=None,
              show_table=False, progress=False):
    """Train one (workload, optimizer, lr, seed) through the suite's segments
    (:class:`SegmentedRun`); one row per evaluation to ``log``; the rows."""
    from experiments import train

    train.fresh_session(seed)
    order, plan = segment_plan(workload, data, seed, args.evals)
    run = SegmentedRun(workload, data, optimizer, lr, seed, args.quick, len(order),
                       args.thor_option, log, on_evaluate=on_evaluate, show_table=show_table,
                       progress=progress)
    segments = ((stop, wl.take(data.x_train, idx), data.y_train[idx]) for _, stop, idx in plan)
    train.train_in_segments(run.model, run.clock, segments, workload.batch_size,
                            lambda step, loss, _: run.evaluate(step, loss), callbacks=callbacks)
    print(run.summary_line(), flush=True)
    return run.rows


def run_configs(grids, optimizers=None):
    """``[("thor", 0.0), (baseline, rate), ...]`` from the baselines' ``grids``, restricted to
    ``optimizers`` when given."""
    plan = [("thor", 0.0)] + [(b, lr) for b, grid in grids.items() for lr in grid]
    return [(n, lr) for n, lr in plan if not optimizers or n in optimizers]


def run_plan(workload, data, plan, args, log, progress=False, seeds=None, first_index=0):
    """Every ``(optimizer, rate)`` of ``plan`` on every seed of ``seeds`` (default
    ``args.seeds``), the runs of a seed back to back with THOR first on every other seed
    (``timing.run_order``; ``first_index``: the first seed's place in that alternation); with
    ``progress`` a line per evaluation and THOR's registration table on its first run."""
    seeds = args.seeds if seeds is None else seeds
    steps = (data.num_train // workload.batch_size) * (
        1 if workload.single_pass else workload.epochs)
    print(f"[{workload.name}] {workload.title}: {data.source}; {steps} steps of batch "
          f"{workload.batch_size}; {len(plan)} configuration(s) x {len(seeds)} seed(s)",
          flush=True)
    shown = False
    for index, seed in enumerate(seeds, start=first_index):
        if len(seeds) > 1 and len(plan) > 1:
            print(f"[{workload.name}] seed {seed}: {timing.order_text(index)}", flush=True)
        for optimizer, lr in timing.run_order(plan, index):
            show = progress and optimizer == "thor" and not shown
            shown = shown or show
            train_run(workload, data, optimizer, lr, seed, args, log, show_table=show,
                      progress=progress)


def run_tuned(workload, data, plan, args, log, progress=False):
    """``plan`` on the first of ``args.seeds``; on the others only THOR and the best baseline
    at its best rate there (the grids on every seed would cost hours on the LM). The rows."""
    rows = []

    def keep(row):
        rows.append(row)
        log(row)

    run_plan(workload, data, plan, args, keep, progress, seeds=args.seeds[:1])
    if len(args.seeds) > 1:
        tuned = summarize_workload(workload, rows)
        leader = tuned.get("best_baseline")
        rate = tuned["optimizers"][leader]["lr"] if leader else None
        rest = [(n, lr) for n, lr in plan if n == "thor" or (n == leader and lr == rate)]
        if leader:
            print(f"[{workload.name}] the best baseline on seed {args.seeds[0]}: {leader} "
                  f"{rate:g}", flush=True)
        run_plan(workload, data, rest, args, keep, progress, seeds=args.seeds[1:], first_index=1)
    return rows


@contextlib.contextmanager
def metrics_log(path):
    """``(log, rows)``: ``log(row)`` writes a row of :data:`FIELDS` to the CSV ``path`` (header
    first, flushed per row: a killed run keeps its rows) and appends it to ``rows``."""
    rows = []
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()

        def log(row):
            writer.writerow(row)
            fh.flush()
            rows.append(row)

        yield log, rows


def drive(workload, data, args, out, name, script, tuned=False, **fields):
    """A driver's whole run (``mnist.py``, ``lm.py``, ``finetune.py``): ``workload``'s plan (THOR
    and the baselines' grids; ``tuned``: :func:`run_tuned`) with a line per evaluation,
    ``metrics.csv``, then the record ``NAME.json`` (:func:`experiments.record.stamp` of the
    commit it starts from, the run's settings, ``fields``, the environment and the workload's
    summary), ``NAME.md`` and ``NAME.png`` in ``out``; the summary."""
    from experiments.record import stamp
    from experiments.record import environment

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The commit the run starts from (the tree may change while it trains).
    started, stamped = time.perf_counter(), stamp(getattr(args, "argv", None), script)
    with metrics_log(out / "metrics.csv") as (log, rows):
        plan = run_configs(workload.baselines, getattr(args, "optimizers", None))
        (run_tuned if tuned else run_plan)(workload, data, plan, args, log, progress=True)
    print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    summary = summarize_workload(workload, rows)
    text = markdown([summary], args.thor_option)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({
        **stamped, "quick": args.quick, "seeds": args.seeds,
        "evals": args.evals, **fields, "thor_options": args.thor_option,
        "environment": environment(), "workload": summary}, indent=1, default=float))
    plot([summary], {summary["workload"]: rows}, out / f"{name}.png")
    print("\n" + text)
    print(f"wrote metrics.csv, {name}.json, {name}.md and {name}.png in {out}")
    return summary


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def _better(workload, a, b):
    """Whether metric ``a`` is at least as good as ``b`` (NaN never is)."""
    if a is None or math.isnan(a):
        return False
    return a >= b if workload.higher_is_better else a <= b


def _median(values):
    """Median with None = never (sorted last); None when the median is never or no values."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (v is None, v if v is not None else 0))
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    a, b = ordered[mid - 1], ordered[mid]
    return None if a is None or b is None else (a + b) / 2


def _final_median(workload, runs):
    finals = [r[-1]["metric"] for r in runs]
    finals = [(-math.inf if workload.higher_is_better else math.inf) if math.isnan(v) else v
              for v in finals]
    return statistics.median(finals)


def reach(workload, rows, target):
    """``(step, seconds)`` of the first evaluation at or past ``target``, else ``(None, None)``."""
    for row in rows:
        if row["step"] > 0 and _better(workload, row["metric"], target):
            return row["step"], row["seconds"]
    return None, None


def summarize_workload(workload, rows):
    """The workload's summary dict from its metric rows (any number of seeds and rates)."""
    runs = {}
    for row in rows:
        runs.setdefault((row["optimizer"], row["lr"]), {}).setdefault(row["seed"], []).append(row)
    for per_seed in runs.values():
        for seed_rows in per_seed.values():
            seed_rows.sort(key=lambda r: r["step"])
    configs = {}
    for (name, lr), per_seed in runs.items():
        configs.setdefault(name, []).append((lr, _final_median(workload, per_seed.values())))
    sign = 1 if workload.higher_is_better else -1
    best = {}
    warnings = []
    for name, scored in configs.items():
        scored.sort()
        lr, final = max(scored, key=lambda t: sign * t[1])
        best[name] = {"lr": lr, "final": final, "grid": [s[0] for s in scored],
                      "grid_finals": [s[1] for s in scored]}
        if name != "thor" and len(scored) > 1 and lr in (scored[0][0], scored[-1][0]):
            warnings.append(f"{workload.name}: {name}'s best rate {lr:g} is at an end of its "
                            f"grid {[s[0] for s in scored]}")
    baselines = [n for n in best if n != "thor"]
    if not baselines:
        return {"workload": workload.name, "optimizers": best, "warnings": warnings}
    leader = max(baselines, key=lambda n: sign * best[n]["final"])
    target = best[leader]["final"]
    for name, info in best.items():
        per_seed = runs[(name, info["lr"])]
        hits = {seed: reach(workload, seed_rows, target) for seed, seed_rows in per_seed.items()}
        info["seeds"] = sorted(per_seed)
        info["finals"] = [per_seed[s][-1]["metric"] for s in sorted(per_seed)]
        info["steps_to_target"] = [hits[s][0] for s in sorted(per_seed)]
        info["seconds_to_target"] = [hits[s][1] for s in sorted(per_seed)]
        info["median_steps"] = _median(info["steps_to_target"])
        info["median_seconds"] = _median(info["seconds_to_target"])
        info["total_steps"] = per_seed[info["seeds"][0]][-1]["step"]
        info["total_seconds"] = statistics.median(r[-1]["seconds"] for r in per_seed.values())
        # The run's first segment (tracing) and steady seconds, and its load: its last row's.
        for key in timing.CSV_COLUMNS:
            info[key] = [per_seed[s][-1].get(key) for s in info["seeds"]]
        info["median_first_seconds"] = timing.median(info["first_seconds"])
        info["median_steady_seconds_per_step"] = timing.median(info["steady_seconds_per_step"])
    summary = {"workload": workload.name, "title": workload.title, "metric": workload.metric,
               "split": workload.eval_split,
               "higher_is_better": workload.higher_is_better, "target": target,
               "best_baseline": leader, "optimizers": best, "warnings": warnings}
    if "thor" in best:
        t, b = best["thor"], best[leader]
        summary["steps_ratio"] = _ratio(t["median_steps"], b["median_steps"])
        # Seconds only when both sides ran under comparable load (timing.compare).
        timed = timing.compare(
            dict(zip(t["seeds"], t["load"])), dict(zip(b["seeds"], b["load"])),
            {"to_target": (t["median_seconds"], b["median_seconds"]),
             "first": (t["median_first_seconds"], b["median_first_seconds"]),
             "steady_step": (t["median_steady_seconds_per_step"],
                             b["median_steady_seconds_per_step"])}, leader)
        summary["seconds_ratio"] = timed["ratios"]["to_target"]
        summary["timing"] = timed
        if not timed["comparable"]:
            warnings.append(f"{workload.name}: seconds {timing.NOT_COMPARABLE}: "
                            f"{timed['reason']}")
        summary["thor_at_least_as_good"] = bool(_better(workload, t["final"], target))
    return summary


def _ratio(a, b):
    return None if a is None or not b else a / b


def markdown(summaries, thor_options):
    rows = []
    for s in summaries:
        if "target" not in s:
            continue
        metric = s["metric"]
        for i, (name, info) in enumerate(sorted(s["optimizers"].items(),
                                                key=lambda kv: kv[0] != "thor")):
            label = name if name == "thor" else f"{name} ({info['lr']:g})"
            if name == s["best_baseline"]:
                label = f"**{label}**"
            spec = ".2%" if metric == "accuracy" else ".4f"
            ratios = ""
            if name == "thor":
                seconds = (timing.ratio_text(s["timing"], "to_target") if "timing" in s
                           else fmt(s.get("seconds_ratio"), ".2f", "never"))
                ratios = (f"{fmt(s.get('steps_ratio'), '.2f', 'never')}"
                          f"{'' if s.get('steps_ratio') is None else 'x'}, {seconds}")
            steady = info.get("median_steady_seconds_per_step")
            load = timing.median(info.get("load") or [])
            split = (f"{fmt(info.get('median_first_seconds'), '.1f', '–')}, "
                     f"{fmt(None if steady is None else 1000 * steady, '.1f', '–')}, "
                     f"{fmt(load, '.0%', '?')}")
            label_metric = metric if s.get("split", "test") == "test" else f"{s['split']} {metric}"
            first = (f"{s['workload']} ({label_metric}, target {format(s['target'], spec)})"
                     if i == 0 else "")
            rows.append((first, label, format(info["final"], spec),
                         f"{fmt(info['median_steps'], '.0f')} / {info['total_steps']}",
                         f"{fmt(info['median_seconds'], '.1f')} / {info['total_seconds']:.1f}",
                         split, ratios))
    notes = [w for s in summaries for w in s.get("warnings", [])]
    text = "\n".join(tables.md_table(
        ("workload", "optimizer (best rate)", "median final", "steps to target",
         "seconds to target", "first segment s, steady ms/step, load",
         "THOR/best: steps, seconds"), rows))
    if thor_options:
        text += f"\n\nTHOR options changed from thor_tf's defaults: {thor_options}"
    if notes:
        text += "\n\n" + "\n".join(f"- {w}" for w in notes)
    return text + "\n"


def plot(summaries, rows_by_workload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summaries if "target" in s]
    if not shown:
        return None
    cols = min(4, len(shown))
    nrows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, s in zip(axes.flat, shown):
        rows = rows_by_workload[s["workload"]]
        for name, info in sorted(s["optimizers"].items()):
            curves = {}
            for r in rows:
                if r["optimizer"] == name and r["lr"] == info["lr"]:
                    curves.setdefault(r["step"], []).append(r["metric"])
            steps = sorted(curves)
            label = name if name == "thor" else f"{name} {info['lr']:g}"
            ax.plot(steps, [statistics.median(curves[k]) for k in steps], label=label,
                    lw=2.2 if name == "thor" else 1.2, color=COLORS.get(name))
        ax.axhline(s["target"], color="gray", ls=":", lw=1)
        ax.set_title(s["workload"], fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{s.get('split', 'test')} {s['metric']}")
        finals = [info["final"] for info in s["optimizers"].values()]
        if s["metric"] == "accuracy":
            ax.set_ylim(max(0.0, min(finals) - 0.1), min(1.0, max(finals) + 0.02))
        else:
            ax.set_ylim(min(finals) * 0.9, max(finals) * 1.6)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle("THOR (defaults) vs first-order baselines at their best rate, median over "
                 "seeds; dotted: target", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(workload_names, rows, args, sources, out):
    by_workload = {}
    for row in rows:
        by_workload.setdefault(row["workload"], []).append(row)
    summaries = [summarize_workload(wl.ALL_WORKLOADS[n].sized(args.quick), by_workload[n])
                 for n in workload_names if n in by_workload]
    text = markdown(summaries, args.thor_option)
    (out / "suite.md").write_text(text)
    from experiments.record import environment

    from experiments.record import stamp

    (out / "suite.json").write_text(json.dumps({
        **stamp(getattr(args, "argv", None)), "quick": args.quick, "seeds": args.seeds, "evals": args.evals,
        "thor_options": args.thor_option, "data": sources, "environment": environment(),
        "workloads": summaries}, indent=1, default=float))
    plot(summaries, by_workload, out / "suite.png")
    print("\n" + text)
    print(f"wrote {out / 'metrics.csv'}, suite.json, suite.md and suite.png in {out}")
    return summaries


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _names(text):
    names = [n for n in str(text).replace(" ", "").split(",") if n]
    bad = [n for n in names if n not in wl.ALL_WORKLOADS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"--workloads takes a comma list from {', '.join(wl.WORKLOADS)} (the suite) or "
            f"{', '.join(wl.OUTSIDE)} (outside it); got {text!r}")
    return names


def _optimizer_names(text):
    names = [n for n in str(text).replace(" ", "").split(",") if n]
    bad = [n for n in names if n not in ("thor",) + BASELINES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"--optimizers takes a comma list from thor, {', '.join(BASELINES)}; got {text!r}")
    return names


def parse_args(argv=None):
    from experiments.cli import parse_ints, parse_thor_option

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workloads", type=_names, default=list(wl.WORKLOADS),
                        help=f"comma list (default the suite's: {','.join(wl.WORKLOADS)}; "
                             f"also outside it: {','.join(wl.OUTSIDE)})")
    parser.add_argument("--optimizers", type=_optimizer_names, default=None,
                        help="restrict to these (thor and the workloads' baselines by default)")
    parser.add_argument("--seeds", type=parse_ints, default=None,
                        help="comma list (default 0,1,2; --quick: 0)")
    parser.add_argument("--evals", type=int, default=None,
                        help="evaluations per run after step 0 (default 10)")
    parser.add_argument("--lr-grid", action="append", default=[], metavar="NAME=LR,...",
                        help="replace a baseline's grid on every selected workload, e.g. "
                             "adam=3e-2,1e-1 (repeatable)")
    parser.add_argument("--thor-option", type=parse_thor_option, action="append", default=[],
                        metavar="NAME=VALUE", help="a thor_tf.wrap option other than its default "
                                                   "(to measure candidates; repeatable)")
    parser.add_argument("--out", default="runs/suite", help="output directory (runs/suite)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seed 0 (CI)")
    parser.add_argument("--no-download", action="store_true",
                        help="never fetch data (the char GPT's corpus is fetched once with pip)")
    parser.add_argument("--combine", nargs="+", metavar="DIR", default=None,
                        help="join the metrics.csv of earlier runs (same --quick) and report")
    args = parser.parse_args(argv)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.evals is None:
        args.evals = 10
    if args.evals < 1:
        raise SystemExit("error: --evals must be >= 1")
    args.thor_option = dict(args.thor_option)
    from experiments.cli import parse_lr_grid

    try:
        args.lr_grid = parse_lr_grid(args.lr_grid, {})
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    args.argv = argv  # for the record's command (experiments.record)
    return args


def _read_rows(path):
    """The rows of a ``metrics.csv``; the timing columns of an older one (before
    ``timing.CSV_COLUMNS``) read as None, so its seconds are "not comparable"."""
    from experiments.tables import read_rows

    return read_rows(path, text=("workload", "optimizer"), ints=("seed", "step"),
                     columns=FIELDS)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        rows, sources = [], {}
        for directory in args.combine:
            rows += _read_rows(Path(directory) / "metrics.csv")
            meta = Path(directory) / "suite.json"
            if meta.exists():
                sources.update(json.loads(meta.read_text()).get("data", {}))
        with open(out / "metrics.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        names = [n for n in wl.ALL_WORKLOADS if any(r["workload"] == n for r in rows)]
        return write_outputs(names, rows, args, sources, out)

    wl.ALLOW_DOWNLOAD = not args.no_download
    started, sources = time.perf_counter(), {}
    with metrics_log(out / "metrics.csv") as (log, rows):
        for name in args.workloads:
            workload = wl.ALL_WORKLOADS[name].sized(args.quick)
            try:
                data = workload.load(args.quick)
            except wl.Unavailable as err:
                print(f"[{name}] skipped: {err}", flush=True)
                continue
            sources[name] = data.source
            grids = {b: args.lr_grid.get(b, grid) for b, grid in workload.baselines.items()}
            run_plan(workload, data, run_configs(grids, args.optimizers), args, log)
    print(f"suite: {time.perf_counter() - started:.0f} s", flush=True)
    return write_outputs(args.workloads, rows, args, sources, out)


if __name__ == "__main__":
    main()
