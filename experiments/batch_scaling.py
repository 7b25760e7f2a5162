"""Where second-order pays: steps and seconds to a target against the batch size.

    python experiments/batch_scaling.py --record docs/results/batch_scaling.json  # ~2 h, 2 cores
    python experiments/batch_scaling.py --workloads char_gpt --multiples 1,4
    python experiments/batch_scaling.py --quick               # tiny sizes, seed 0 (CI)
    python experiments/batch_scaling.py --report-only         # rebuild JSON, table, plots

The suite's workloads (``workloads.py``) at batch sizes ``m·B`` for each multiple ``m`` of
``--multiples`` (default 1, 4, 16; ``B`` the suite's batch). Each run follows the suite's
recipe (``suite.train_run``: the same initial weights and batch order for a seed, the baselines'
warmup + cosine, THOR's ``WarmupCosine``), with a budget that shrinks slower than the steps a
bigger batch needs under perfect scaling:

* **Budget.** ``S_m = S_1 / sqrt(m)`` steps (``S_1`` the suite's run), so ``sqrt(m)`` times the
  suite's examples: the image workloads as whole epochs (the nearest count of them), the char GPT
  as one pass of ``S_m`` fresh batches of random windows (at ``m = 1`` the suite's own batches).
  The schedules span the run.
* **Rates re-tuned at each batch** on seed 0: each baseline over the suite's grid times
  ``sqrt(m)`` (three rates a factor ~3 apart), widened by one rate at an end its best landed on
  (at most :data:`MAX_WIDENINGS` times; a best still at an end is flagged); THOR at its default
  (``wrap``'s ``WarmupCosine(total_steps)``, peak None) and at explicit peaks a factor 3 either
  side of the default's, widened in the same way. The **best baseline** at a batch is the one
  with the best seed-0 final there.
* **Seeds.** For every seed (0 included), THOR at its default and the best baseline at its
  best rate train interleaved (below); THOR at its best peak, when that is not the default,
  trains on seeds 1, 2, ... too. The other baselines have seed 0 only.
* **Target** (per workload): the best baseline's median final metric at ``m = 1``. Per batch and
  optimizer: steps, examples and seconds to the target (the first evaluation at or past it;
  medians over seeds, "never" when half or more seeds never get there) and the final metric.
* **Critical batch** (McCandlish et al. 2018): ``S(b) = S_min (1 + B_crit / b)`` fitted to the
  batches that reached the target (least squares on ``1/b``); ``B_crit`` is where a step buys
  half of what it buys at small batch. A fit with ``S_min <= 0`` (scaling still perfect) gives
  "above the largest batch". Also the simpler **halving batch**: the largest batch up to which
  every 4x of batch at least halved the steps to the target.

Seconds to the target are those of the interleaved pairs: THOR (default) and the best baseline
built in one process on the same weights and batches and trained segment by segment in turn
(``interleave.py``, the pairing of ``scripts/bench_interleaved.py``), so both see the same host;
other runs' seconds (tuning runs, THOR's best peak) are back to back in one process as in the
suite, with the load recorded.

Outputs in ``--out`` (default ``runs/batch_scaling``): ``runs.jsonl`` (every finished run, one
line each with its evaluations: ``run_cache.RunCache``; a rerun trains only what is missing),
``batch_scaling.json`` (``{"workloads": {name: {"target", "batches": {b: {optimizer: {"rate",
"final", "steps_to_target", "examples_to_target", "seconds_to_target"}}}}}}`` and the tuning
detail),
``batch_scaling.md`` (the table) and three plots: steps to target against batch (log-log, with
the perfect-scaling line), seconds to target against batch, and the projection across R
data-parallel replicas (:func:`project`). ``--record PATH`` also writes the record and its plots
there (``docs/results/batch_scaling.json``: what ``python -m experiments.report`` reads).
Seconds are compared as THOR's over the baseline's per seed of an interleaved pair, then the
median (``paired_seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import interleave, suite, workloads as wl  # noqa: E402
from experiments.tables import fmt  # noqa: E402
from experiments.run_cache import THOR_PEAK, RunCache, total_steps  # noqa: E402

WORKLOADS = ("fashion_cnn", "resnet20", "char_gpt")
MULTIPLES = (1, 4, 16)
#: How many times a grid is widened by one rate at the end its best landed on.
MAX_WIDENINGS = 2
#: Factor between neighbouring rates of THOR's peak grid and of a widened baseline grid.
GRID_FACTOR = 3.0
#: The run cache in ``--out`` (``run_cache.RunCache``).
CACHE = "runs.jsonl"
#: The keys of a record's batch cell that are not optimizers.
CELL_KEYS = ("best_baseline", "paired_seconds")


# --------------------------------------------------------------------------------------------
# Workloads at a batch
# --------------------------------------------------------------------------------------------

def _round_rate(rate):
    """``rate`` to two significant digits (grids print and match as written)."""
    return float(f"{rate:.2g}")


def budget_steps(base_steps, multiple):
    """``S_m = S_1 / sqrt(m)``, at least 1."""
    return max(1, round(base_steps / math.sqrt(multiple)))


def scaled_workload(name, multiple, quick):
    """``(workload, data)`` of suite workload ``name`` at ``multiple`` times its batch, over the
    study's budget (module docstring). Raises ``workloads.Unavailable`` without the data."""
    base = wl.WORKLOADS[name].sized(quick)
    batch = base.batch_size * multiple
    grids = {b: tuple(_round_rate(r * math.sqrt(multiple)) for r in grid)
             for b, grid in base.baselines.items()}
    if base.single_pass:
        data = base.load(quick)
        base_steps = data.num_train // base.batch_size
        steps = budget_steps(base_steps, multiple)
        if multiple != 1:
            data = _fresh_windows(data, quick, steps, batch)
        workload = dataclasses.replace(base, batch_size=batch, baselines=grids)
        return workload, data
    data = base.load(quick)
    base_steps = (data.num_train // base.batch_size) * base.epochs
    per_epoch = data.num_train // batch
    if per_epoch < 1:
        raise ValueError(f"{name}: batch {batch} exceeds its {data.num_train} training examples")
    epochs = max(1, round(budget_steps(base_steps, multiple) / per_epoch))
    return dataclasses.replace(base, batch_size=batch, epochs=epochs, baselines=grids), data


def _fresh_windows(data, quick, steps, batch):
    """The char GPT's data with ``steps`` batches of ``batch`` random windows (seed 0's
    sequence, as the suite's) in place of the suite's."""
    from experiments import text

    block = wl.GPT_SIZES[quick]["block"]
    corpus = text.load_text(download=wl.ALLOW_DOWNLOAD, verbose=False)
    x, y = text.train_batches(corpus.train, 0, steps, batch, block)
    return dataclasses.replace(data, x_train=x, y_train=y,
                               source=f"{corpus.name}: {steps} batches of {batch} x {block}")


def default_peak(steps):
    """The peak THOR's default ``WarmupCosine(steps)`` reaches after warmup."""
    from experiments.cli import default_thor_peak

    return default_thor_peak(steps)


# --------------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------------

def widened(grid, best, scored):
    """The next rate to try when ``best`` is at an end of ``grid`` (None when it is inside, or
    the grid holds a single rate)."""
    grid = sorted(grid)
    if len(grid) < 2 or len(scored) < len(grid):
        return None
    if best == grid[-1]:
        return _round_rate(grid[-1] * GRID_FACTOR)
    if best == grid[0]:
        return _round_rate(grid[0] / GRID_FACTOR)
    return None


def best_rate(workload, finals):
    """``(rate, final)`` with the best final of ``{rate: final}`` (NaN is worst)."""
    sign = 1 if workload.higher_is_better else -1

    def score(item):
        value = item[1]
        return -math.inf if value is None or math.isnan(value) else sign * value

    return max(sorted(finals.items()), key=score)


def _same(a, b):
    return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))


def tune(sweep, workload, data, seed):
    """Seed ``seed``'s grids at this batch: ``{optimizer: {"grid": {rate: final}, "best",
    "at_edge"}}``, THOR's explicit peaks under :data:`THOR_PEAK` and its default under "thor"."""
    result = {}
    grids = dict(workload.baselines)
    peak = default_peak(total_steps(workload, data))
    grids[THOR_PEAK] = (_round_rate(peak / GRID_FACTOR), _round_rate(peak * GRID_FACTOR))
    for optimizer, grid in grids.items():
        finals = {lr: sweep.final(workload, data, optimizer, lr, seed) for lr in grid}
        if optimizer == THOR_PEAK:
            finals[peak] = sweep.final(workload, data, "thor", 0.0, seed)
        for _ in range(MAX_WIDENINGS):
            best, _ = best_rate(workload, finals)
            extra = widened(list(finals), best, finals)
            if extra is None:
                break
            finals[extra] = sweep.final(workload, data, optimizer, extra, seed)
        best, final = best_rate(workload, finals)
        ordered = sorted(finals)
        result[optimizer] = {"grid": {f"{r:g}": finals[r] for r in ordered}, "best": best,
                             "best_final": final,
                             "at_edge": len(ordered) > 1 and best in (ordered[0], ordered[-1])}
    result[THOR_PEAK]["default_peak"] = peak
    return result


def leader(workload, tuned):
    """``(baseline, rate)``: the baseline with the best seed-0 final at this batch."""
    scored = {name: info["best_final"] for name, info in tuned.items() if name != THOR_PEAK}
    name, _ = best_rate(workload, scored)
    return name, tuned[name]["best"]


def run_seeds(sweep, workload, data, tuned, seeds):
    """THOR at its best peak on the seeds after the first, when that is not the default."""
    info = tuned[THOR_PEAK]
    if _same(info["best"], info["default_peak"]):
        return
    for seed in seeds:
        sweep.final(workload, data, THOR_PEAK, info["best"], seed)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def _median(values):
    return suite._median(values)


def _runs_by_seed(rows):
    out = {}
    for row in rows:
        out.setdefault(row["seed"], []).append(row)
    for seed_rows in out.values():
        seed_rows.sort(key=lambda r: r["step"])
    return out


def optimizer_summary(workload, batch, rows, target, rate):
    """Medians over seeds of one optimizer's runs at one batch and rate."""
    per_seed = _runs_by_seed(rows)
    finals, steps, seconds = [], [], []
    for seed in sorted(per_seed):
        seed_rows = per_seed[seed]
        finals.append(seed_rows[-1]["metric"])
        step, second = suite.reach(workload, seed_rows, target)
        steps.append(step)
        seconds.append(second)
    med_steps = _median(steps)
    steady, first = _steady(rows)
    return {"steady_seconds_per_step": steady, "first_seconds": first, "rate": rate, "final": statistics.median(finals), "steps_to_target": med_steps,
            "examples_to_target": None if med_steps is None else med_steps * batch,
            "seconds_to_target": _median(seconds), "seeds": sorted(per_seed),
            "finals": finals, "steps_by_seed": steps, "seconds_by_seed": seconds,
            "total_steps": per_seed[min(per_seed)][-1]["step"]}


def critical_batch(points):
    """McCandlish's ``B_crit`` from ``{batch: steps}`` (None steps dropped): least squares of
    ``S = a + c / b``; ``B_crit = c / a``. Returns ``(B_crit, S_min)``; ``(inf, None)`` when
    ``a <= 0`` (no slowdown in the range), ``(None, None)`` with fewer than two points."""
    pts = [(b, s) for b, s in points.items() if s is not None]
    if len(pts) < 2:
        return None, None
    xs = [1.0 / b for b, _ in pts]
    ys = [float(s) for _, s in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None, None
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - c * mx
    if a <= 0:
        return math.inf, None
    return max(c / a, 0.0), a


def halving_batch(points):
    """The largest batch up to which each step to the next batch (x4 here) at least halved the
    steps to the target (None when the smallest batch never reached it)."""
    batches = sorted(points)
    if not batches or points[batches[0]] is None:
        return None
    reached = batches[0]
    for small, big in zip(batches, batches[1:]):
        s_small, s_big = points[small], points[big]
        if s_big is None or s_big > s_small * (small / big) ** 0.5:
            break
        reached = big
    return reached


def _seed_rows(rows, workload_name, batch, optimizer, rate):
    """The rows of ``optimizer`` at ``rate`` (THOR's default: any), per seed the interleaved
    run's where there is one (the same trajectory; its seconds are the paired ones)."""
    picked = {}
    for phase in ("sweep", "interleaved"):
        for row in rows:
            if (row["workload"] == workload_name and row["batch"] == batch
                    and row["phase"] == phase and row["optimizer"] == optimizer
                    and (rate is None or _same(row["lr"], rate))):
                picked.setdefault(row["seed"], {}).setdefault(phase, []).append(row)
    return [r for by_phase in picked.values()
            for r in by_phase.get("interleaved", by_phase.get("sweep"))]


def paired_seconds(workload, rows, name, batch, baseline, target, phase="interleaved"):
    """Per seed, THOR's seconds to the target over the baseline's from the same interleaved
    pair (the rows of ``phase``; None where one never got there; the pair saw the same host,
    the seeds may not have), their median, and the seeds where only THOR got there.

    The median and ``decided_by``: :func:`experiments.interleave.pairs_median` (a pair only one
    side finished counts; before 2026-12-01 it was left out)."""
    pair = [r for r in rows if r["workload"] == name and r["batch"] == batch
            and r["phase"] == phase]
    thor = _runs_by_seed([r for r in pair if r["optimizer"] == "thor"])
    base = _runs_by_seed([r for r in pair if r["optimizer"] == baseline])
    ratios, only_thor, pairs = {}, [], []
    for seed in sorted(set(thor) & set(base)):
        t = suite.reach(workload, thor[seed], target)[1]
        b = suite.reach(workload, base[seed], target)[1]
        ratios[seed] = None if t is None or not b else t / b
        if t is not None and b is None:
            only_thor.append(seed)
        pairs.append((t, b))
    median, decided = interleave.pairs_median(pairs)
    return {"per_seed": ratios, "median": median, "decided_by": decided,
            "only_thor_seeds": only_thor}


def cell_runs(base, rows, batch, tuned):
    """``({optimizer: (rows, rate)}, best baseline)`` of one cell (a batch here, a length in
    ``horizon.py``): THOR at its default, THOR at its best peak (the default's rows when that
    is the best), every tuned baseline at its best rate; ``tuned`` as :func:`tune` gives."""
    name = base.name
    best, _ = leader(base, tuned)
    peak = tuned[THOR_PEAK]
    thor = _seed_rows(rows, name, batch, "thor", None)
    entry = {"thor": (thor, peak["default_peak"]),
             "thor_best": ((thor if _same(peak["best"], peak["default_peak"]) else
                            _seed_rows(rows, name, batch, THOR_PEAK, peak["best"])),
                           peak["best"])}
    for optimizer, info in tuned.items():
        if optimizer != THOR_PEAK:
            entry[optimizer] = (_seed_rows(rows, name, batch, optimizer, info["best"]),
                                info["best"])
    return entry, best


def median_final(entry, optimizer):
    """The median over seeds of ``optimizer``'s final metric in a :func:`cell_runs` entry."""
    return statistics.median(s[-1]["metric"]
                             for s in _runs_by_seed(entry[optimizer][0]).values())


def cell_summary(base, rows, batch, tuned, entry, best, target):
    """One cell of a record: per optimizer of ``entry`` its :func:`optimizer_summary` against
    ``target`` (with its grid and edge flag), the best baseline and the paired seconds."""
    cell = {}
    for optimizer, (opt_rows, rate) in entry.items():
        if not opt_rows:
            continue
        info = optimizer_summary(base, batch, opt_rows, target, rate)
        tune_key = THOR_PEAK if optimizer.startswith("thor") else optimizer
        info["grid"] = tuned[tune_key]["grid"]
        info["at_edge"] = tuned[tune_key]["at_edge"]
        info["seconds_paired"] = optimizer in ("thor", best)
        cell[optimizer] = info
    cell["best_baseline"] = best
    cell["paired_seconds"] = paired_seconds(base, rows, base.name, batch, best, target)
    return cell


def summarize(workload_names, sweep_rows, tuning, multiples, quick):
    """The record of the study: ``{"workloads": {name: {...}}}`` (module docstring)."""
    record = {}
    for name in workload_names:
        base = wl.WORKLOADS[name].sized(quick)
        if name not in tuning or not any(r["workload"] == name for r in sweep_rows):
            continue
        batches = sorted(int(b) for b in tuning[name])
        cells = {b: cell_runs(base, sweep_rows, b, tuning[name][str(b)]) for b in batches}
        entry, first_best = cells[batches[0]]
        target = median_final(entry, first_best)
        out_batches = {str(b): cell_summary(base, sweep_rows, b, tuning[name][str(b)], entry,
                                            best, target)
                       for b, (entry, best) in cells.items()}
        scaling = {}
        for optimizer in ("thor", "thor_best", "best_baseline"):
            points = {}
            for b_key, cell in out_batches.items():
                key = cell["best_baseline"] if optimizer == "best_baseline" else optimizer
                points[int(b_key)] = cell.get(key, {}).get("steps_to_target")
            b_crit, s_min = critical_batch(points)
            scaling[optimizer] = {"critical_batch": b_crit, "min_steps": s_min,
                                  "halving_batch": halving_batch(points)}
        record[name] = {"title": base.title, "metric": base.metric,
                        "higher_is_better": base.higher_is_better, "target": target,
                        "target_from": first_best, "base_batch": batches[0],
                        "multiples": list(multiples), "batches": out_batches,
                        "scaling": scaling}
    return {"workloads": record}


# --------------------------------------------------------------------------------------------
# Across workers: a projection from the measured curve and step
# --------------------------------------------------------------------------------------------

#: The network of the projection: a ring all-reduce over machines like this one, 10 Gb/s
#: Ethernet (β, bytes/s) with 30 µs per hop (α).
NETWORK = {"bandwidth": 10e9 / 8, "latency": 30e-6}
REPLICAS = (1, 2, 4, 8, 16, 32, 64)


def steps_at(points, batch, fit):
    """Steps to the target at ``batch`` from the measured ``{batch: steps}`` (None: never):
    log-log interpolation inside the measured range; beyond it the fitted ``S_min (1 + B_crit /
    b)`` when there is a finite fit, else the largest measured batch's steps. Returns ``(steps,
    extrapolated)``; steps None when a neighbouring measured batch never reached the target."""
    known = sorted(points)
    if batch in points:
        return points[batch], False
    if batch <= known[0]:
        return points[known[0]], batch < known[0]
    for lo, hi in zip(known, known[1:]):
        if lo <= batch <= hi:
            if points[lo] is None or points[hi] is None:
                return (points[lo] if batch == lo else None), False
            t = math.log(batch / lo) / math.log(hi / lo)
            return math.exp((1 - t) * math.log(points[lo]) + t * math.log(points[hi])), False
    last = points[known[-1]]
    if last is None:
        return None, True
    b_crit, s_min = fit
    if s_min is not None and b_crit not in (None, math.inf):
        # The fit through the measured points, anchored at the last one (no jump at it).
        return last * (1 + b_crit / batch) / (1 + b_crit / known[-1]), True
    return last, True


def ring_allreduce_seconds(nbytes, replicas, network=NETWORK):
    """α-β ring all-reduce: ``2(R−1)α + 2(R−1)/R · bytes/β`` (0 on one replica)."""
    if replicas <= 1:
        return 0.0
    return (2 * (replicas - 1) * network["latency"]
            + 2 * (replicas - 1) / replicas * nbytes / network["bandwidth"])


def exchanged_floats(name, quick=False):
    """``(gradient floats per step, factor floats per cadence point)`` of the workload's model
    under THOR's defaults (docs/distributed.md: the gradients every step; the factor blocks at a
    cadence point where some layer refreshes)."""
    import keras
    import thor_tf
    from thor_tf.split.plan import split_size

    base = wl.WORKLOADS[name].sized(quick)
    keras.backend.clear_session()
    model = base.build(base.load(quick), quick)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    wrapped = thor_tf.wrap(model, verbose=False)
    plan = thor_tf.config.ThorConfig().split_dim   # the default rule's default split
    factors = 0
    for block in wrapped.thor.blocks:
        for dim in (block.a_dim, block.g_dim):
            size = min(split_size(plan, dim), dim)
            factors += math.ceil(dim / size) * size * size
    return params + 1, factors + 1


def project(record, floats, frequency=10, replicas=REPLICAS, network=NETWORK):
    """Seconds to the target for ``R`` data-parallel replicas at the suite's batch per replica
    (weak scaling: global batch ``R·B``), THOR at its defaults against the best baseline at
    ``B``: ``steps(R·B) × (step(B) + all-reduce) + first call``, the steps from the measured
    curve (:func:`steps_at`), the step and first call as measured at ``B`` in the interleaved
    pairs, the all-reduce by :func:`ring_allreduce_seconds` (THOR also sends its factors at
    every ``frequency``-th step: an upper bound, most cadence points refresh few layers).
    ``floats``: ``{workload: (gradient floats, factor floats)}``."""
    out = {}
    for name, w in record["workloads"].items():
        base = w["batches"][str(w["base_batch"])]
        rows = []
        curves = {"thor": {int(b): c["thor"]["steps_to_target"]
                           for b, c in w["batches"].items()},
                  "baseline": {int(b): c[c["best_baseline"]]["steps_to_target"]
                               for b, c in w["batches"].items()}}
        fits = {"thor": w["scaling"]["thor"], "baseline": w["scaling"]["best_baseline"]}
        grads, factors = floats[name]
        for r in replicas:
            row = {"replicas": r, "global_batch": r * w["base_batch"]}
            for key, info in (("thor", base["thor"]), ("baseline", base[base["best_baseline"]])):
                step = info.get("steady_seconds_per_step")
                first = info.get("first_seconds")
                steps, extrapolated = steps_at(curves[key], r * w["base_batch"],
                                               (fits[key]["critical_batch"],
                                                fits[key]["min_steps"]))
                comm = ring_allreduce_seconds(4 * grads, r, network)
                if key == "thor":
                    comm += ring_allreduce_seconds(4 * factors, r, network) / frequency
                row[key] = {"steps": steps, "extrapolated": extrapolated,
                            "step_seconds": None if step is None else step + comm,
                            "seconds": (None if steps is None or step is None
                                        else steps * (step + comm) + (first or 0.0))}
            t, b = row["thor"]["seconds"], row["baseline"]["seconds"]
            row["ratio"] = None if t is None or not b else t / b
            row["only_thor"] = t is not None and b is None    # the baseline never gets there
            rows.append(row)
        finite = [r for r in rows if r["ratio"] is not None and not r["thor"]["extrapolated"]]
        out[name] = {"rows": rows, "baseline": base["best_baseline"],
                     "largest_lead": (min(finite, key=lambda r: r["ratio"])["replicas"]
                                      if finite else None)}
    return {"network": network, "frequency": frequency, "workloads": out}


def _steady(rows):
    """Median steady seconds per step and first-call seconds of the rows' runs (their last
    rows)."""
    last = [r for r in _runs_by_seed(rows).values()]
    steady = [s[-1].get("steady_seconds_per_step") for s in last]
    first = [s[-1].get("first_seconds") for s in last]
    steady = [v for v in steady if v not in (None, "")]
    first = [v for v in first if v not in (None, "")]
    return (statistics.median(steady) if steady else None,
            statistics.median(first) if first else None)


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------

def optimizers_of(cell):
    """The optimizer entries of a record's cell: THOR's two, then the baselines by name."""
    names = sorted(k for k, v in cell.items() if isinstance(v, dict) and "final" in v
                   and not k.startswith("thor"))
    return [o for o in ["thor", "thor_best"] + names if o in cell]


#: A pairs' median that is not a ratio, in words (``paired_seconds``'s ``decided_by``).
MEDIAN_WORDS = {"only_thor": "only THOR", "only_baseline": "never (the baseline only)"}


def cell_lines(key, cell):
    """Markdown rows of one cell (``key``: its batch or length): per optimizer its rate (flagged
    at a grid end), seeds, final, steps, examples and paired seconds to the target, then THOR's
    seconds over the best baseline's per seed of the interleaved pairs."""
    lines = []
    for optimizer in optimizers_of(cell):
        info = cell[optimizer]
        label = {"thor": "THOR (default)", "thor_best": "THOR (best peak)"}.get(
            optimizer, optimizer + (" (best)" if optimizer == cell["best_baseline"] else ""))
        edge = " (grid end)" if info.get("at_edge") and optimizer != "thor" else ""
        seconds = (fmt(info["seconds_to_target"], ".1f")
                   if info.get("seconds_paired") else "–")
        lines.append(f"| {key} | {label} | {info['rate']:.3g}{edge} | "
                     f"{len(info['seeds'])} | {info['final']:.4f} | "
                     f"{fmt(info['steps_to_target'], 'g')} | "
                     f"{fmt(info['examples_to_target'], ',')} | {seconds} |")
    ps = cell.get("paired_seconds") or {}
    lines.append(f"| {key} | THOR / best, seconds per seed | | | | | | "
                 + ", ".join(fmt(v, ".2f", "–") for v in ps.get("per_seed", {}).values())
                 + "; median " + fmt(ps.get("median"), ".2f",
                                     MEDIAN_WORDS.get(ps.get("decided_by"), "n/a"))
                 + (f"; only THOR reached it on seed(s) {ps['only_thor_seeds']}"
                    if ps.get("only_thor_seeds") else "") + " |")
    return lines


def markdown(record):
    lines = []
    for name, w in record["workloads"].items():
        lines += [f"### {w['title']}", "",
                  f"Target: {w['metric']} {w['target']:.4g} (the best baseline's median final "
                  f"at batch {w['base_batch']}, {w['target_from']}).", "",
                  "| batch | optimizer | rate | seeds | final | steps to target | examples | "
                  "seconds to target (interleaved pair) |", "|---|---|---|---|---|---|---|---|"]
        for b_key, cell in w["batches"].items():
            lines += cell_lines(b_key, cell)
        scaling = w["scaling"]
        proj = record.get("projection", {}).get("workloads", {}).get(name)
        if proj:
            lines += ["", "Projected seconds to the target, THOR / " + proj["baseline"] + ", R "
                      "replicas at batch " + str(w["base_batch"]) + " each: " + ", ".join(
                          f"R={r['replicas']}: "
                          f"{fmt(r['ratio'], '.2f', 'THOR only' if r['only_thor'] else 'n/a')}"
                          + ("*" if r["thor"]["extrapolated"] or r["baseline"]["extrapolated"]
                             else "") for r in proj["rows"]) + " (* beyond the measured batches)"]
        lines += ["", "Critical batch (fit of S = S_min (1 + B_crit / b)) / halving batch: "
                  + "; ".join(f"{k}: {fmt(v['critical_batch'], '.0f', 'n/a')} / "
                              f"{fmt(v['halving_batch'], 'g', 'n/a')}"
                              for k, v in scaling.items()), ""]
    return "\n".join(lines) + "\n"


def plot_projection(projection, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for index, (name, p) in enumerate(projection["workloads"].items()):
        rows = [r for r in p["rows"] if r["ratio"] is not None]
        ax.plot([r["replicas"] for r in rows], [r["ratio"] for r in rows], marker="o",
                label=f"{name} (vs {p['baseline']})")
        extra = [r for r in rows if r["thor"]["extrapolated"] or r["baseline"]["extrapolated"]]
        ax.scatter([r["replicas"] for r in extra], [r["ratio"] for r in extra], s=60,
                   facecolors="none", edgecolors="k")
        only = [r["replicas"] for r in p["rows"] if r.get("only_thor")]
        ax.scatter(only, [-0.04 * index] * len(only), marker="v", s=40,
                   color=ax.lines[-1].get_color() if ax.lines else None,
                   label=f"{name}: only THOR reaches the target (near 0)" if only else None)
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (suite batch each)")
    ax.set_ylabel("THOR / best baseline, seconds to target")
    ax.set_title("Projected (circled: beyond the measured batches)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(record, path_steps, path_seconds):
    """Steps (log-log, with the perfect-scaling line from the best baseline at B) and seconds to
    the target against the batch: THOR at its default and best peak, the best baseline at each
    batch (re-tuned there); a triangle at the top of the panel where one never reached it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["workloads"])
    lines = (("thor", "THOR (default)", "tab:red", "-"),
             ("thor_best", "THOR (best peak)", "tab:red", "--"),
             ("best_baseline", "best baseline (re-tuned)", "tab:blue", "-"))
    for key, path, label in (("steps_to_target", path_steps, "steps to target"),
                             ("seconds_to_target", path_seconds, "seconds to target")):
        fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.6 * max(1, len(names)), 3.8),
                                 squeeze=False)
        for ax, name in zip(axes[0], names):
            w = record["workloads"][name]
            batches = sorted(int(b) for b in w["batches"])
            values = {}
            for optimizer, _, _, _ in lines:
                for b in batches:
                    cell = w["batches"][str(b)]
                    info = cell.get(cell["best_baseline"] if optimizer == "best_baseline"
                                    else optimizer, {})
                    if key == "seconds_to_target" and not info.get("seconds_paired", True):
                        continue
                    values.setdefault(optimizer, {})[b] = info.get(key)
            top = max([v for per in values.values() for v in per.values() if v] or [1.0]) * 1.3
            for optimizer, text, color, style in lines:
                per = values.get(optimizer, {})
                xs = [b for b in batches if per.get(b) is not None]
                ax.plot(xs, [per[b] for b in xs], style, marker="o", color=color, label=text)
                never = [b for b in batches if b in per and per[b] is None]
                ax.scatter(never, [top] * len(never), marker="^", color=color, s=50,
                           label=f"{text}: never" if never else None)
            if key == "steps_to_target":
                base = w["batches"][str(batches[0])]
                start = base.get(base["best_baseline"], {}).get(key)
                if start:
                    ax.plot(batches, [start * batches[0] / b for b in batches], ":",
                            color="black", label="perfect scaling")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.set_title(f"{name} (target {w['target']:.3g})", fontsize=9)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    from experiments.cli import parse_ints

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list of suite workloads (default {','.join(WORKLOADS)})")
    parser.add_argument("--multiples", type=parse_ints, default=None,
                        help="batch multiples of the suite's batch (default 1,4,16; --quick 1,2)")
    parser.add_argument("--seeds", type=parse_ints, default=None,
                        help="comma list; the first tunes the rates (default 0,1,2; --quick 0)")
    parser.add_argument("--evals", type=int, default=12,
                        help="evaluations per run after step 0 (default 12)")
    parser.add_argument("--report-only", action="store_true",
                        help="no training: rebuild the outputs from --out's runs.jsonl")
    parser.add_argument("--out", default="runs/batch_scaling")
    parser.add_argument("--record", default=None, metavar="PATH",
                        help="also write the record (JSON) there and its plots beside it, e.g. "
                             "docs/results/batch_scaling.json (then python -m "
                             "experiments.report)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seed 0 (CI)")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    return settle_study_args(args)


def settle_study_args(args):
    """The checks and defaults a multiples study shares (this one and ``horizon.py``):
    ``--workloads`` known, ``--multiples`` increasing from 1 (default 1, 2 quick, else
    :data:`MULTIPLES`), ``--seeds`` (0 quick, else 0, 1, 2), ``--evals`` at least 1."""
    unknown = [w for w in args.workloads if w not in wl.WORKLOADS]
    if unknown:
        raise SystemExit(f"error: --workloads: unknown {unknown}; allowed: "
                         f"{', '.join(wl.WORKLOADS)}")
    if args.multiples is None:
        args.multiples = [1, 2] if args.quick else list(MULTIPLES)
    if sorted(args.multiples) != args.multiples or args.multiples[0] != 1:
        raise SystemExit("error: --multiples must be increasing and start at 1")
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.evals < 1:
        raise SystemExit("error: --evals must be >= 1")
    return args


def write_outputs(record, out):
    (out / "batch_scaling.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / "batch_scaling.md").write_text(markdown(record))
    plot(record, out / "batch_scaling_steps.png", out / "batch_scaling_seconds.png")
    if "projection" in record:
        plot_projection(record["projection"], out / "batch_scaling_projection.png")
    print(markdown(record), flush=True)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tuning_path = out / "tuning.json"
    tuning = json.loads(tuning_path.read_text()) if tuning_path.exists() else {}
    cache = RunCache(out / CACHE, args.quick, args.evals, train=not args.report_only)
    started = time.perf_counter()
    for name in args.workloads if not args.report_only else ():
        for multiple in args.multiples:
            try:
                workload, data = scaled_workload(name, multiple, args.quick)
            except wl.Unavailable as err:
                print(f"[{name}] skipped: {err}", flush=True)
                break
            steps = total_steps(workload, data)
            print(f"[{name} batch {workload.batch_size}] {steps} steps, "
                  f"{steps * workload.batch_size:,} examples", flush=True)
            tuned = tune(cache, workload, data, args.seeds[0])
            tuning.setdefault(name, {})[str(workload.batch_size)] = tuned
            tuning_path.write_text(json.dumps(tuning, indent=1) + "\n")
            for optimizer, info in tuned.items():
                if info["at_edge"]:
                    print(f"[{name} batch {workload.batch_size}] warning: {optimizer}'s best "
                          f"rate {info['best']:g} is at an end of its grid "
                          f"{list(info['grid'])}", flush=True)
            best, rate = leader(workload, tuned)
            cache.interleave(workload, data, best, rate, args.seeds)
            run_seeds(cache, workload, data, tuned, args.seeds[1:])
    record = summarize(args.workloads, cache.rows(), tuning, args.multiples, args.quick)
    if record["workloads"]:
        floats = {name: exchanged_floats(name, args.quick) for name in record["workloads"]}
        record["projection"] = project(record, floats)
    from experiments.record import stamp

    record.update({**stamp(argv),
                   "quick": args.quick, "seeds": args.seeds, "evals": args.evals,
                   "budget": "S_m = S_1 / sqrt(m) steps",
                   "seconds": round(time.perf_counter() - started, 1)})
    write_outputs(record, out)
    if args.record:
        path = Path(args.record)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        plot(record, path.with_name(path.stem + "_steps.png"),
             path.with_name(path.stem + "_seconds.png"))
        if "projection" in record:
            plot_projection(record["projection"], path.with_name(path.stem + "_projection.png"))
    return record


if __name__ == "__main__":
    main()
