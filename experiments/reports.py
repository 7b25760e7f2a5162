"""Results of the comparison scripts: run records, time-to-target, summary JSON, CSV, plots
and the printed table."""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from experiments import timing
from experiments.cli import FIRST_ORDER, OPTIMIZERS

CSV_FIELDS = ("optimizer", "lr", "seed", "epoch", "train_loss", "test_loss", "test_acc",
              "epoch_seconds", "cumulative_seconds", "refreshes") + timing.CSV_COLUMNS
PLOT_FILES = ("accuracy_vs_epoch.png", "accuracy_vs_time.png", "loss_vs_epoch.png",
              "loss_vs_time.png", "curves.png")

@dataclass
class RunResult:
    optimizer: str
    lr: float
    seed: int
    rows: list = field(default_factory=list)
    steps_per_epoch: int = 0
    layer_stats: list = None
    counters: dict = None
    timing: dict = None   # RunClock.summary(): first_seconds, steady_seconds_per_step, load

    @property
    def accuracies(self):
        return [r["test_acc"] for r in self.rows]

    @property
    def cumulative(self):
        return [r["cumulative_seconds"] for r in self.rows]

    @property
    def final_acc(self):
        return self.rows[-1]["test_acc"] if self.rows else float("nan")

    def mean_step_seconds(self):
        """Training seconds per step, without the first epoch (tracing) when there are more."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        steps = self.steps_per_epoch * len(rows)
        return sum(r["epoch_seconds"] for r in rows) / steps if steps else None


class CsvLog:
    """``metrics.csv``: header once, one flushed row per epoch (a killed run keeps its rows);
    ``fields``: the columns (default :data:`CSV_FIELDS`; a missing value, None, is written empty)."""

    def __init__(self, path, fields=CSV_FIELDS):
        self.path = Path(path)
        self.fields = tuple(fields)
        self._fh = open(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=self.fields)
        self._writer.writeheader()
        self._fh.flush()

    def write(self, row):
        self._writer.writerow({k: row[k] for k in self.fields})
        self._fh.flush()

    def close(self):
        self._fh.close()

def read_rows(path, text=("optimizer",), ints=(), columns=None):
    """The rows of a ``metrics.csv`` as dicts of typed values: the ``text`` columns as strings,
    the ``ints`` as ints, every other as a float; empty (or ``None``) is None. ``columns``: the
    columns every row gets (those an older file lacks, e.g. :data:`timing.CSV_COLUMNS`, are
    None)."""
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            parsed = dict.fromkeys(columns or ())
            for key, value in row.items():
                if key in text:
                    parsed[key] = value
                elif value in ("", "None", None):
                    parsed[key] = None
                elif key in ints:
                    parsed[key] = int(float(value))
                else:
                    parsed[key] = float(value)
            rows.append(parsed)
    return rows


def time_to_target(accuracies, cumulative_seconds, target):
    """``(epochs, seconds)`` of the FIRST epoch whose accuracy is ``>= target``.

    Args:
      accuracies: test accuracy after each epoch (epoch 1 first).
      cumulative_seconds: cumulative training seconds at the end of each epoch (same length).
      target: the accuracy to reach (``None``: no target, returns ``(None, None)``).

    Returns:
      ``(epoch, seconds)`` with epochs counted from 1, or ``(None, None)`` if no epoch reaches the
      target (NaN accuracies never do). No interpolation: accuracy is known only at epoch ends.
    """
    accuracies = list(accuracies)
    cumulative_seconds = list(cumulative_seconds)
    if len(accuracies) != len(cumulative_seconds):
        raise ValueError(
            f"accuracies and cumulative_seconds must have the same length; got "
            f"{len(accuracies)} and {len(cumulative_seconds)}")
    if target is None:
        return None, None
    for i, (acc, seconds) in enumerate(zip(accuracies, cumulative_seconds)):
        if acc is not None and not _isnan(acc) and acc >= target:
            return i + 1, float(seconds)
    return None, None


def _isnan(value):
    return isinstance(value, float) and math.isnan(value)


def median_or_none(values):
    """Median where ``None`` counts as "never" (+inf); ``None`` if the median is never/empty."""
    values = [math.inf if v is None or _isnan(v) else float(v) for v in values]
    if not values:
        return None
    m = statistics.median(values)
    return None if math.isinf(m) or math.isnan(m) else m

def by_config(results):
    """``{(optimizer, lr): [results of its seeds]}`` (anything with ``optimizer`` and ``lr``)."""
    configs = {}
    for r in results:
        configs.setdefault((r.optimizer, r.lr), []).append(r)
    return configs


def _score(value):
    return -math.inf if value is None or _isnan(value) else value


def best_configs(results):
    """``{optimizer: (lr, [RunResult per seed])}`` with the best median final accuracy."""
    best = {}
    for (name, lr), runs in by_config(results).items():
        acc = median_or_none([r.final_acc for r in runs])
        if name not in best or _score(acc) > _score(best[name][2]):
            best[name] = (lr, runs, acc)
    return {k: (lr, runs) for k, (lr, runs, _) in best.items()}


def best_baseline(results, target_from=None):
    """``(median final accuracy, name, lr)`` of ``target_from`` (at its best rate), else of the
    best first-order baseline (``cli.FIRST_ORDER``: sgd/adam/adamw/muon); None if none ran."""
    best = best_configs(results)
    baselines = (target_from,) if target_from else FIRST_ORDER
    candidates = [(median_or_none([r.final_acc for r in runs]), name, lr)
                  for name, (lr, runs) in best.items() if name in baselines]
    candidates = [c for c in candidates if c[0] is not None]
    return max(candidates) if candidates else None


def choose_target(results, target_acc, target_from=None):
    """``(target, source text)``: ``--target-acc``, else the final accuracy of ``--target-from``
    (its best learning rate), else of the best first-order baseline (``cli.FIRST_ORDER``:
    sgd/adam/adamw/muon)."""
    if target_acc is not None:
        return float(target_acc), "--target-acc"
    leader = best_baseline(results, target_from)
    if leader is None:
        return None, (f"no first-order baseline ({'/'.join(FIRST_ORDER)}) in this run and no "
                      "--target-acc, so no time-to-target")
    acc, name, lr = leader
    if target_from:
        return acc, f"final test accuracy of {name} (--target-from, best lr={lr:g})"
    return acc, f"final test accuracy of the best first-order baseline ({name}, lr={lr:g})"


def _jsonable(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return _jsonable(value.item())
        except (TypeError, ValueError):
            pass
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def environment_info():
    import keras
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        names = []
        for g in gpus:
            try:
                names.append(tf.config.experimental.get_device_details(g).get("device_name", g.name))
            except Exception:  # noqa: BLE001 - details are best effort
                names.append(g.name)
        device = "GPU: " + ", ".join(names)
    else:
        device = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {"device": device, "tensorflow": tf.__version__, "keras": keras.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def summarize(results, args, dataset_info, model_name):
    target, source = choose_target(results, args.target_acc, getattr(args, "target_from", None))
    optimizers = {}
    for name, (lr, runs) in best_configs(results).items():
        per_seed = []
        for r in runs:
            epochs, seconds = time_to_target(r.accuracies, r.cumulative, target)
            per_seed.append({
                "seed": r.seed, "final_acc": r.final_acc, "epochs_to_target": epochs,
                "seconds_to_target": seconds, "total_seconds": r.cumulative[-1] if r.rows else None,
                "mean_step_seconds": r.mean_step_seconds(),
                "first_epoch_seconds": r.rows[0]["epoch_seconds"] if r.rows else None,
                "refreshes": r.rows[-1]["refreshes"] if r.rows else 0,
                **{k: (r.timing or {}).get(k) for k in (
                    "steady_seconds_per_step", "first_overhead_seconds", "load")},
            })
        entry = {
            "lr": lr,
            "epochs_to_target": median_or_none([s["epochs_to_target"] for s in per_seed]),
            "seconds_to_target": median_or_none([s["seconds_to_target"] for s in per_seed]),
            "final_acc": median_or_none([s["final_acc"] for s in per_seed]),
            "mean_step_seconds": median_or_none([s["mean_step_seconds"] for s in per_seed]),
            "total_seconds": median_or_none([s["total_seconds"] for s in per_seed]),
            # includes graph tracing (THOR's train step traces much longer than a plain one)
            "first_epoch_seconds": median_or_none([s["first_epoch_seconds"] for s in per_seed]),
            "refreshes": median_or_none([s["refreshes"] for s in per_seed]),
            "steady_seconds_per_step": median_or_none(
                [s["steady_seconds_per_step"] for s in per_seed]),
            "load": timing.median([s["load"] for s in per_seed]),
            "target": target,
            "steps_per_epoch": runs[0].steps_per_epoch,
            "per_seed": per_seed,
            "grid": [{"lr": clr, "final_acc": median_or_none([r.final_acc for r in cruns])}
                     for (cname, clr), cruns in by_config(results).items() if cname == name],
        }
        if runs[0].layer_stats is not None:
            entry["layer_stats"] = runs[0].layer_stats  # first seed of the best config
            entry["counters"] = runs[0].counters
        optimizers[name] = entry
    args_dict = {k: (v if not isinstance(v, tuple) else list(v)) for k, v in vars(args).items()}
    leader = best_baseline(results, getattr(args, "target_from", None))
    summary = {
        "target": target,
        "target_source": source,
        "thor_vs_best": thor_vs_baseline(optimizers, leader[1]) if leader else None,
        "optimizers": {k: optimizers[k] for k in args.optimizers if k in optimizers},
        "dataset": dataset_info,
        "model": model_name,
        "args": args_dict,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **environment_info(),
    }
    return _jsonable(summary)


def thor_vs_baseline(optimizers, baseline):
    """THOR's seconds over ``baseline``'s (:func:`timing.compare`: to the target, the first
    epoch, a steady step; medians over the seeds), or "not comparable" and why; None without
    THOR."""
    thor, base = optimizers.get("thor"), optimizers.get(baseline)
    if thor is None or base is None:
        return None
    measures = {name: (thor[key], base[key]) for name, key in (
        ("to_target", "seconds_to_target"), ("first_epoch", "first_epoch_seconds"),
        ("steady_step", "steady_seconds_per_step"))}
    result = timing.compare({s["seed"]: s["load"] for s in thor["per_seed"]},
                            {s["seed"]: s["load"] for s in base["per_seed"]}, measures, baseline)
    return {"baseline": baseline, "lr": base["lr"],
            "epochs_ratio": _ratio(thor["epochs_to_target"], base["epochs_to_target"]), **result}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def write_summary(summary, out_dir):
    path = Path(out_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return path


def median_curves(runs):
    """Per-epoch medians over seeds: epoch, test_acc, train_loss, cumulative_seconds."""
    epochs = min(len(r.rows) for r in runs)
    curves = {"epoch": list(range(1, epochs + 1))}
    for key in ("test_acc", "train_loss", "test_loss", "cumulative_seconds"):
        curves[key] = [statistics.median(r.rows[e][key] for r in runs) for e in range(epochs)]
    return curves


def plot_curves(results, summary, out_dir, title):
    """The four PNGs (and ``curves.png``, all four panels): best config per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_configs(results)
    target = summary.get("target")
    curves = {name: (lr, median_curves(runs)) for name, (lr, runs) in best.items()}
    panels = [
        ("accuracy_vs_epoch.png", "epoch", "test_acc", "epoch", "test accuracy"),
        ("accuracy_vs_time.png", "cumulative_seconds", "test_acc",
         "training wall time (s, cumulative)", "test accuracy"),
        ("loss_vs_epoch.png", "epoch", "train_loss", "epoch", "train loss (epoch mean)"),
        ("loss_vs_time.png", "cumulative_seconds", "train_loss",
         "training wall time (s, cumulative)", "train loss (epoch mean)"),
    ]
    nseeds = len({r.seed for r in results})
    suffix = f" (median of {nseeds} seeds)" if nseeds > 1 else ""

    def draw(ax, xkey, ykey, xlabel, ylabel):
        for name in [n for n in OPTIMIZERS if n in curves]:
            lr, c = curves[name]
            ax.plot(c[xkey], c[ykey], marker="o", markersize=4, label=f"{name} (lr {lr:g})")
        if ykey == "test_acc" and target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1,
                       label=f"target {target:.4f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xkey == "epoch":
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)

    paths = []
    for fname, xkey, ykey, xlabel, ylabel in panels:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        draw(ax, xkey, ykey, xlabel, ylabel)
        ax.set_title(f"{title}{suffix}", fontsize=10)
        fig.tight_layout()
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (_, xkey, ykey, xlabel, ylabel) in zip(axes.flat, panels):
        draw(ax, xkey, ykey, xlabel, ylabel)
    fig.suptitle(f"{title}{suffix}")
    fig.tight_layout()
    path = Path(out_dir) / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def fmt(value, spec, none="never"):
    """``value`` formatted with ``spec``; ``none`` for None (a target never reached), "∞" for
    infinity. The one number formatter of the experiments' tables."""
    if value is None:
        return none
    return "∞" if value == math.inf else format(value, spec)


def md_table(header, rows):
    """A markdown table as lines: the header, the separator ``|---|---|...|`` (one ``---`` per
    column, no alignment marks) and one line per row; the header and each row are written
    ``"| " + " | ".join(cells) + " |"``. ``header``: the column titles; ``rows``: sequences of
    cells already formatted as text, written verbatim (an empty cell comes out as ``|  |``; a
    ``|`` in a cell would split it). The one markdown table writer of the experiments' reports;
    a row whose length differs from the header's raises ValueError."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(rows):
        row = list(row)
        if len(row) != len(header):
            raise ValueError(f"md_table: row {index} has {len(row)} cells, the header "
                             f"{len(header)} ({' | '.join(header)}): {row!r}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary_table(summary):
    """The table printed at the end (best config per optimizer, medians over seeds)."""
    target = summary["target"]
    head = ("optimizer", "lr", "final acc", "epochs->target", "s->target", "1st epoch s",
            "steady s/step", "train s", "load", "refreshes")
    rows = [head]
    for name, e in summary["optimizers"].items():
        rows.append((name, fmt(e["lr"], "g"), fmt(e["final_acc"], ".4f", "nan"),
                     fmt(e["epochs_to_target"], "g", "never" if target is not None else "-"),
                     fmt(e["seconds_to_target"], ".1f", "never" if target is not None else "-"),
                     fmt(e["first_epoch_seconds"], ".1f", "-"),
                     fmt(e.get("steady_seconds_per_step"), ".4f", "-"),
                     fmt(e["total_seconds"], ".1f", "-"), fmt(e.get("load"), ".0%", "?"),
                     fmt(e["refreshes"], "g", "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if target is None:
        lines.insert(0, f"no target accuracy ({summary['target_source']})")
    else:
        lines.insert(0, f"target accuracy {target:.4f}: {summary['target_source']}")
    seeds = len((summary.get("args") or {}).get("seeds") or [])
    if seeds > 1:
        lines.insert(1, f"medians over {seeds} seeds (load: the share of the CPU other "
                        f"processes used during the runs)")
    versus = summary.get("thor_vs_best")
    if versus is not None:
        lines.append(f"THOR / {versus['baseline']} (lr {versus['lr']:g}): epochs to the target "
                     f"{fmt(versus['epochs_ratio'], '.2f', 'never')}, seconds to the target "
                     f"{timing.ratio_text(versus, 'to_target')}, first epoch "
                     f"{timing.ratio_text(versus, 'first_epoch')}, steady step "
                     f"{timing.ratio_text(versus, 'steady_step')}")
        lines.append(f"  {versus['reason'] or 'run back to back'}; {timing.loads_text(versus)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
