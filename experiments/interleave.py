"""Seconds to the target with THOR's and the best baseline's training interleaved in one process,
segment by segment, so that both see the same host.

On a shared machine the speed moves from one few-second window to the next, and the load that
``experiments.timing`` measures does not show it (docs/timing.md, "What the load does not
see"): the suite's runs of THOR and of the baseline, a minute apart, can meet hosts 25 % apart.
Here, per workload and seed, THOR (defaults) and the workload's best baseline at its best rate
(``docs/results/suite_grid.json``'s choice, the suite's own schedule) are built in one process on the same
weights and batches, and trained through the suite's segments (one Keras ``fit`` epoch between
two evaluations, timed as the suite times them: ``timing.fit_segment``), alternating: segment 1
of one, segment 1 of the other, segment 2 of the first... (which one goes first alternates by
segment and seed). Evaluations are not timed. The rows are the suite's, so its summary gives
the steps and seconds to the target (the baseline's median final in this run).

Reported per workload:

* ``seconds_ratio``: THOR's median seconds to the target over the baseline's (the suite's
  statistic);
* ``paired_ratios`` and ``paired_median``: per seed, THOR's seconds to the target over the
  baseline's from the same seed's interleaved pair (None when one never reached it), and their
  median;
* the steps ratio, both sides' finals, first segments and steady steps.

JSON in ``--out``, a PNG beside it.

    python scripts/bench_interleaved.py --out docs/results/suite.json   # ~17 min, 7 workloads; then python -m experiments.report
    python scripts/bench_interleaved.py --quick     # the tabular MLP, one seed: the harness

The same pairing serves ``batch_scaling.py --interleave`` and ``horizon.py``
(:func:`interleaved_rows`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from experiments import record, workloads
from experiments.cli import parse_thor_option

ROOT = Path(__file__).resolve().parents[1]


def segment_order(index, seed):
    """Which of (THOR, baseline) trains first in segment ``index`` of seed ``seed``."""
    return (0, 1) if (index + seed) % 2 == 0 else (1, 0)


def interleaved_rows(workload, data, baseline, rate, seed, evals, thor_options=(), quick=False):
    """The suite's metric rows of THOR (defaults, or ``thor_options``: ``[(name, value)]`` as
    the suite's ``--thor-option``) and ``baseline`` at ``rate`` on ``workload`` / ``data``, seed
    ``seed``, trained segment by segment in turn (two ``suite.SegmentedRun``)."""
    import keras

    from experiments import suite, train

    train.quiet_retracing()
    keras.backend.clear_session()
    order, plan = suite.segment_plan(workload, data, seed, evals)
    runs = []
    for optimizer, lr in (("thor", 0.0), (baseline, rate)):
        keras.utils.set_random_seed(seed)
        runs.append(suite.SegmentedRun(workload, data, optimizer, lr, seed, quick, len(order),
                                       thor_options))
    for run in runs:
        run.evaluate(0, None)
    for index, stop, idx in plan:
        for k in segment_order(index, seed):
            runs[k].evaluate(stop, runs[k].train(index, idx))
    for run in runs:
        print(run.summary_line(), flush=True)
    return runs[0].rows + runs[1].rows


def suite_rows(name, baseline, rate, seed, quick, evals, thor_options=()):
    """The suite's metric rows of THOR and the baseline on suite workload ``name``, seed
    ``seed``, trained segment by segment in turn (``thor_options``: ``[(name, value)]`` wrap
    options other than the defaults, as the suite's ``--thor-option``)."""
    workload = workloads.WORKLOADS[name].sized(quick)  # the suite's --quick sizes under quick
    return interleaved_rows(workload, workload.load(quick), baseline, rate, seed, evals,
                            thor_options, quick)


def pairs_median(pairs):
    """``(median, decided_by)`` of THOR's seconds to the target over the baseline's across
    interleaved ``pairs`` (``(thor_seconds, baseline_seconds)``, None where that side never got
    there). Every pair one side finished counts: only THOR as 0, only the baseline as infinite
    (a pair THOR loses is not left out of its median); pairs neither finished are left out. Of
    an even count the mean of the middle two, or the higher of them when the lower is 0 or the
    higher infinite (no average with either). ``decided_by``: ``"ratio"`` (the median is a
    ratio), ``"only_thor"`` or ``"only_baseline"`` (it is 0 or infinite; the median is then
    None, as it is when no pair got there: ``decided_by`` None)."""
    ranked = sorted(0.0 if not b else math.inf if t is None else t / b  # b of 0: not there
                    for t, b in pairs if t is not None or b)
    if not ranked:
        return None, None
    half = len(ranked) // 2
    if len(ranked) % 2:
        median = ranked[half]
    else:
        low, high = ranked[half - 1], ranked[half]
        median = high if low == 0 or math.isinf(high) else (low + high) / 2
    if median == 0:
        return None, "only_thor"
    if math.isinf(median):
        return None, "only_baseline"
    return median, "ratio"


def paired(summary):
    """Per seed, THOR's seconds to the target over the baseline's (None where one never got
    there), and their :func:`pairs_median`."""
    thor, base = summary["optimizers"]["thor"], summary["optimizers"][summary["best_baseline"]]
    by_seed = dict(zip(base["seeds"], base["seconds_to_target"]))
    pairs = [(t, by_seed.get(s)) for s, t in zip(thor["seeds"], thor["seconds_to_target"])]
    ratios = [None if t is None or not b else t / b for t, b in pairs]
    return ratios, pairs_median(pairs)[0]


def record_paired(name, result, quick=False):
    """:func:`paired` of one workload's entry of a record this module wrote (``result``: its
    ``results[name]``, with its ``rows``), recomputed from the rows: a record keeps the
    median it was written with, which the rule of :func:`pairs_median` may have changed since
    (2026-12-01)."""
    from experiments import suite

    summary = suite.summarize_workload(workloads.WORKLOADS[name].sized(quick), result["rows"])
    return paired(summary)


def workload_result(name, baseline, rate, seeds, quick, evals, thor_options=()):
    from experiments import suite

    rows = []
    for seed in seeds:
        rows += suite_rows(name, baseline, rate, seed, quick, evals, thor_options)
    summary = suite.summarize_workload(workloads.WORKLOADS[name].sized(quick), rows)
    ratios, median = paired(summary)
    thor, base = summary["optimizers"]["thor"], summary["optimizers"][summary["best_baseline"]]
    return {"workload": name, "baseline": baseline, "rate": rate, "target": summary["target"],
            "steps_ratio": summary.get("steps_ratio"),
            "seconds_ratio": summary.get("seconds_ratio"),
            "paired_ratios": ratios, "paired_median": median,
            "thor_final": thor["final"], "baseline_final": base["final"],
            "first_seconds": [thor["median_first_seconds"], base["median_first_seconds"]],
            "steady_seconds_per_step": [thor["median_steady_seconds_per_step"],
                                        base["median_steady_seconds_per_step"]],
            "timing": summary.get("timing"), "rows": rows}


def best_baselines(path):
    """``{workload: (optimizer, rate)}`` as the suite's grid (``docs/results/suite_grid.json``)
    chose them."""
    summary = json.loads(Path(path).read_text())
    return {w["workload"]: (w["best_baseline"], float(w["optimizers"][w["best_baseline"]]["lr"]))
            for w in summary["workloads"] if w.get("best_baseline")}


def finish_workload_axes(fig, ax, results, ylabel, path):
    """The workload plots' common end: parity line, one tick per workload of ``results`` (in its
    order, with its baseline), ``ylabel``, legend; saved to ``path``."""
    names = list(results)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\nvs {results[n]['baseline']}" for n in names], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, name in enumerate(names):
        r = results[name]
        points = [p for p in r["paired_ratios"] if p is not None]
        ax.scatter([i] * len(points), points, color="0.5", s=12, zorder=3,
                   label="per seed" if i == 0 else None)
        if r["paired_median"] is not None:
            ax.bar(i, r["paired_median"], 0.6, color="tab:blue", alpha=0.6,
                   label="median of the per-seed ratios" if i == 0 else None)
        if r["seconds_ratio"] is not None:
            ax.scatter([i], [r["seconds_ratio"]], marker="x", color="k", s=40, zorder=4,
                       label="ratio of the medians (the suite's)" if i == 0 else None)
    ax.axhline(0.75, color="k", lw=0.6, ls=":")
    finish_workload_axes(fig, ax, results, "THOR seconds to target / baseline's", path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--evals", type=int, default=10, help="evaluations per run (the suite's)")
    parser.add_argument("--suite", default=str(ROOT / "docs" / "results" / "suite_grid.json"))
    parser.add_argument("--out", default="runs/bench_interleaved.json")
    parser.add_argument("--quick", action="store_true",
                        help="the tabular MLP, one seed, 4 evaluations: the harness")
    parser.add_argument("--thor-option", action="append", default=[], type=parse_thor_option,
                        metavar="NAME=VALUE",
                        help="a thor_tf.wrap option other than its default, as the suite's "
                             "(e.g. split_dim=auto; repeatable)")
    args = parser.parse_args(argv)
    chosen = best_baselines(args.suite)
    names = ["tabular_mlp"] if args.quick else [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in chosen]
    if unknown:
        parser.error(f"--workloads: {unknown} have no best baseline in {args.suite}; "
                     f"allowed: {sorted(chosen)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers; got {args.seeds!r}")
    if args.quick:
        seeds, args.evals = seeds[:1], min(args.evals, 4)
    if not seeds or args.evals < 1:
        parser.error("--seeds needs at least one seed and --evals at least 1")
    results = {}
    for name in names:
        baseline, rate = chosen[name]
        r = workload_result(name, baseline, rate, seeds, args.quick, args.evals,
                            args.thor_option)
        results[name] = r
        fmt = lambda v: "never" if v is None else f"{v:.2f}x"
        print(f"{name}: THOR vs {baseline} {rate:g}: steps {fmt(r['steps_ratio'])}, seconds "
              f"(medians) {fmt(r['seconds_ratio'])}, per seed "
              f"{[fmt(p) for p in r['paired_ratios']]}, their median {fmt(r['paired_median'])}",
              flush=True)
    record.write(args.out, {"seeds": seeds, "evals": args.evals, "quick": args.quick,
                            "thor_options": dict(args.thor_option), "results": results},
                 plot, results, argv=argv, script=ROOT / "scripts" / "bench_interleaved.py")
    return results


if __name__ == "__main__":
    main()
