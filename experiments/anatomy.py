"""Where THOR's lead moves, and why, measured: one suite run of THOR and of the best baseline,
paired, with what THOR's state does along the way (issue 54, item 2).

    python experiments/anatomy.py --multiple 1 --seeds 0          # Fashion CNN, suite's length
    python experiments/anatomy.py --multiple 4 --seeds 0,1,2      # 4x the length (horizon.py's)
    python experiments/anatomy.py --quick --out /tmp/anatomy      # digits CNN, 1 epoch (CI)

Each seed trains THOR (``thor_tf.wrap`` defaults, ``WarmupCosine(total_steps)``) and the
baseline (default Muon) through the suite's own loop (``suite.train_run``: the same initial
weights and batch order for a seed; the baseline's warmup + cosine; ``--multiple m``: ``m`` times
the suite's epochs at the suite's batch, ``horizon.lengthened_workload``). Measured, at ``--evals``
(default 24) evenly spaced evaluations and step 0 (outside the timed segments, through
``train_run``'s ``on_evaluate`` hook), and inside the segments (a Keras callback):

1. **Curves**: the loss on a fixed train subset (``TRAIN_SUBSET`` rows, a fixed permutation of
   the training set), the held-out loss and metric (the test split), their gap (held-out minus
   train-subset loss); per evaluation, the baseline's steps to THOR's value there over THOR's
   steps (``match``: > 1, THOR is ahead; the first evaluation of the baseline at or past it).
2. **THOR's state** per layer: ``model.thor.layer_stats()`` (refreshes, reuses, frozen,
   frozen_at_step, last_refresh_step) and ``model.thor.counters()``; the basis's ``age`` =
   steps done - ``last_refresh_step``.
3. **Staleness of the bases in use**: fresh full factors ``A``, ``G`` (float64,
   ``thor_tf.split.probe.batch_factors``) on ``PROBE_BATCHES`` fixed batches of the training set
   (the suite's batch size). For each side (``A`` with ``Q_A``, ``G`` with ``Q_G`` of
   ``model.thor.bases``), with ``F_bd`` the factor's diagonal blocks of the split in use (the
   last one zero-padded) and ``Q`` the block-diagonal basis: :func:`offdiag_fraction` =
   ``||offdiag(Q^T F_bd Q)||_F / ||F_bd||_F`` -- ``in_use`` (THOR's bases), ``identity`` (no
   rotation), ``fresh_other`` (the eigenbasis of the *other* probe batch's factor: the floor
   batch noise puts under any refresh; a basis fresh from the same batch gives 0) -- each the
   mean over the probe batches; and ``outside`` = ``||F - F_bd||_F / ||F||_F``, the share the
   split leaves out (a side kept as its diagonal, block 1, has nothing to rotate: its measures
   are 0 and only ``outside`` says anything). Scale-free: the factors' scale does not matter.
4. **Step size per layer**: ``||w_after - w_before||_F / ||w_before||_F`` of one optimizer step,
   all of a layer's trainable variables together (kernel and bias), at every ``every``-th step
   (about ``STEP_SAMPLES`` per run; weights copied on ``on_train_batch_begin`` and measured on
   ``on_train_batch_end``: the harness's ``steps_per_execution`` is 1, checked), and the
   learning rate at that step.
5. **Per phase** of the schedule (warmup: steps ``<= W = round(0.05 T)``; then the first,
   second and last third of the cosine): each side's values at the phase's last evaluation,
   THOR's refreshes in the phase, blocks frozen at its end, the mean age and staleness in it,
   the mean step size per layer in it (:func:`phase_table`).

The baseline's rate: ``--baseline-rate``, else its best seed-0 rate at this length in
``horizon_runs.jsonl`` (phase "sweep"), else the best in ``--rate-check``'s record (below),
else (not tuned at this length) the suite's (``suite.json``) with a note in the record.
``--rate-check`` trains the baseline alone, seed 0, at that rate / 3 and x 3
(``horizon.centred_grid``) and adds their finals to ``anatomy_<workload>_<m>x_rates.json``:
whether the rate is the best at this length.

Outputs in ``--out`` (default ``docs/results``): ``anatomy_<workload>_<m>x.json`` (``runs``:
one per seed and optimizer, keyed ``"<optimizer>/<seed>"``; ``phases``: the per-phase table,
medians over seeds; a seed already in the file is kept and not rerun, so seeds can be added by
later calls) and ``anatomy_<workload>_<m>x.png`` (loss curves, accuracy, gap, step size per
layer, off-diagonal energy of the bases in use, THOR's refreshes per layer).
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

from experiments import horizon as hz  # noqa: E402
from experiments import baselines, suite, tables  # noqa: E402
from experiments import workloads as wl  # noqa: E402
from experiments.run_cache import read_jsonl, study_thor_options  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EVALS = 24
TRAIN_SUBSET = 2000
PROBE_BATCHES = 2
STEP_SAMPLES = 120
PHASES = ("warmup", "cosine 1/3", "cosine 2/3", "cosine 3/3")
QUICK_WORKLOAD = "digits_cnn"


# --------------------------------------------------------------------------------------------
# Staleness of a basis (pure NumPy; tests/test_anatomy.py checks it against closed forms)
# --------------------------------------------------------------------------------------------

def split_blocks(factor, nb, d):
    """``[nb, d, d]``: the diagonal blocks of size ``d`` of the ``[n, n]`` ``factor``
    (``n <= nb·d``; the last block zero-padded)."""
    factor = np.asarray(factor, np.float64)
    n = factor.shape[0]
    pad = nb * d - n
    if pad < 0 or pad >= d:
        raise ValueError(f"a {n}x{n} factor is not {nb} blocks of {d}")
    padded = np.pad(factor, ((0, pad), (0, pad)))
    r = np.arange(nb)
    return padded.reshape(nb, d, nb, d)[r, :, r, :]


def offdiag_fraction(factor, bases):
    """``||offdiag(Q^T F_bd Q)||_F / ||F_bd||_F``: the share of the split's diagonal blocks of
    ``factor`` (``F_bd``, ``[n, n]`` cut as ``bases``) that the block-diagonal basis ``Q``
    (``bases``: ``[nb, d, d]``, eigenvectors as columns) leaves off the diagonal. 0: ``Q``
    diagonalizes every block; a side kept as its diagonal (``d = 1``) is always 0."""
    q = np.asarray(bases, np.float64)
    nb, d, _ = q.shape
    blocks = split_blocks(factor, nb, d)
    total = float(np.sum(blocks ** 2))
    if total == 0.0:
        return 0.0
    rotated = np.matmul(np.matmul(np.swapaxes(q, 1, 2), blocks), q)  # Q_k^T F_k Q_k
    diagonal = np.einsum("kii->ki", rotated)
    off = float(np.sum(rotated ** 2) - np.sum(diagonal ** 2))
    return math.sqrt(max(off, 0.0) / total)


def outside_fraction(factor, nb, d):
    """``||F - F_bd||_F / ||F||_F``: the share of ``factor`` outside the split's blocks."""
    factor = np.asarray(factor, np.float64)
    total = float(np.sum(factor ** 2))
    if total == 0.0:
        return 0.0
    inside = float(np.sum(split_blocks(factor, nb, d) ** 2))
    return math.sqrt(max(total - inside, 0.0) / total)


def eigenbases(factor, nb, d):
    """``[nb, d, d]``: the eigenvectors of each of ``factor``'s split blocks (a fresh basis)."""
    return np.linalg.eigh(split_blocks(factor, nb, d))[1]


def identity_bases(nb, d):
    return np.broadcast_to(np.eye(d), (nb, d, d))


def side_staleness(factors, bases):
    """The measures of one side (module docstring, 3) from the probe batches' ``factors`` (one
    ``[n, n]`` each, at least two) and the ``bases`` in use ``[nb, d, d]``."""
    nb, d, _ = np.shape(bases)
    if d == 1:  # kept as its diagonal: nothing to rotate
        return {"in_use": 0.0, "identity": 0.0, "fresh_other": 0.0,
                "outside": float(np.mean([outside_fraction(f, nb, d) for f in factors])),
                "block": 1}
    fresh = [eigenbases(f, nb, d) for f in factors]
    k = len(factors)
    return {"in_use": float(np.mean([offdiag_fraction(f, bases) for f in factors])),
            "identity": float(np.mean([offdiag_fraction(f, identity_bases(nb, d))
                                       for f in factors])),
            "fresh_other": float(np.mean([offdiag_fraction(factors[i], fresh[(i + 1) % k])
                                          for i in range(k)])),
            "outside": float(np.mean([outside_fraction(f, nb, d) for f in factors])),
            "block": int(d)}


def staleness(model, probes):
    """``{layer: {"A": measures, "G": measures}}`` of a THOR model now (``probes``:
    ``[(x, y)]``)."""
    from thor_tf.split.probe import batch_factors

    per_batch = batch_factors(model, probes)
    with _one_blas_thread():
        return _staleness(model, per_batch)


def _one_blas_thread():
    """NumPy's BLAS on one thread: beside TensorFlow's threads on a shared CPU, a threaded
    ``eigh`` of a 128x128 block took 1.2 s against 0.03 s on one thread."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # scikit-learn's dependency; without it, as NumPy is
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def _staleness(model, per_batch):
    out = {}
    for block in model.thor.blocks:
        name = block.name
        if any(name not in f for f in per_batch):
            continue
        bases = model.thor.bases(name)
        out[name] = {}
        for side, key in (("A", "Q_A"), ("G", "Q_G")):
            factors = [f[name][0 if side == "A" else 1] for f in per_batch]
            if any(f is None for f in factors):
                continue
            out[name][side] = side_staleness(factors, bases[key])
    return out


# --------------------------------------------------------------------------------------------
# Step sizes inside the fit
# --------------------------------------------------------------------------------------------

def layer_of(variable):
    path = getattr(variable, "path", variable.name)
    return path.split("/")[0]


def step_size_callback(every, record):
    """A Keras callback appending ``{"step", "lr", "layers": {layer: ||dw||/||w||}}`` to
    ``record`` at every ``every``-th optimizer step (0-based; counts across segments)."""
    import keras

    class StepSizes(keras.callbacks.Callback):
        step = 0
        before = None

        def on_train_batch_begin(self, batch, logs=None):
            spe = getattr(self.model, "steps_per_execution", 1)
            if spe != 1:
                raise RuntimeError(f"steps_per_execution {spe}: a batch hook is not one step")
            if self.step % every == 0:
                self.before = [(layer_of(v), v.numpy().astype(np.float64))
                               for v in self.model.trainable_variables]
                try:
                    lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
                except Exception:  # noqa: BLE001 (a read-out only)
                    lr = None
                self.lr = lr

        def on_train_batch_end(self, batch, logs=None):
            if self.before is not None:
                num, den = {}, {}
                for (layer, w0), v in zip(self.before, self.model.trainable_variables):
                    dw = v.numpy().astype(np.float64) - w0
                    num[layer] = num.get(layer, 0.0) + float(np.sum(dw ** 2))
                    den[layer] = den.get(layer, 0.0) + float(np.sum(w0 ** 2))
                record.append({"step": self.step, "lr": self.lr, "layers": {
                    k: math.sqrt(num[k] / den[k]) if den[k] > 0 else None for k in num}})
                self.before = None
            self.step += 1

    return StepSizes()


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------

def fixed_rows(n, count, salt):
    """``count`` row indices of ``n`` from a fixed permutation (the same for every run)."""
    return np.random.default_rng([salt, 54]).permutation(n)[:min(count, n)]


def _evaluate(model, x, y):
    result = model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)
    return {k: float(v) for k, v in result.items()}


def run_one(workload, data, optimizer, rate, seed, evals, quick, probes, subset):
    """Train one run through ``suite.train_run`` with the measurements; its record."""
    import types

    total = len(suite.batch_order(data.num_train, workload.batch_size, workload.epochs, seed,
                                  workload.single_pass))
    every = max(1, total // STEP_SAMPLES)
    steps_record, points = [], []
    tag = f"[{optimizer} seed={seed}]"
    metric = workload.metric

    def on_evaluate(model, row):
        step = row["step"]
        train = _evaluate(model, data.x_train[subset], data.y_train[subset])
        test = _evaluate(model, data.x_test, data.y_test)
        point = {"step": step, "seconds": row["seconds"], "train_loss": train["loss"],
                 "test_loss": test["loss"], "test_metric": test.get(metric, test["loss"]),
                 "train_metric": train.get(metric, train["loss"]),
                 "gap": test["loss"] - train["loss"], "segment_train_loss": row["train_loss"]}
        line = (f"{tag} step {step:5d}  train {point['train_loss']:.4f}  held-out "
                f"{point['test_loss']:.4f}  {metric} {point['test_metric']:.4f}")
        if optimizer == "thor":
            stats = model.thor.layer_stats()
            point["layers"] = {s["name"]: {
                "refreshes": s["refreshes"], "reuses": s["reuses"], "frozen": s["frozen"],
                "frozen_at_step": s["frozen_at_step"], "last_refresh_step":
                    s["last_refresh_step"], "age": (step - s["last_refresh_step"]
                                                    if s["refreshes"] else None),
                "split_a": s["split_a"], "split_g": s["split_g"]} for s in stats}
            if any(s["refreshes"] for s in stats):
                point["counters"] = {k: (v if isinstance(v, (int, float)) else float(v))
                                     for k, v in model.thor.counters().items()}
                point["staleness"] = staleness(model, probes)
                rotated = [m["in_use"] for sides in point["staleness"].values()
                           for m in sides.values() if m["block"] > 1]
                fresh = [m["fresh_other"] for sides in point["staleness"].values()
                         for m in sides.values() if m["block"] > 1]
                line += (f"  refreshes {sum(s['refreshes'] for s in stats)}  frozen "
                         f"{sum(s['frozen'] for s in stats)}  offdiag in use "
                         f"{np.mean(rotated):.3f} (fresh {np.mean(fresh):.3f})")
        points.append(point)
        print(line, flush=True)

    # THOR on the studies' rule (relative ε 1e-2): the runs in the records were trained with it.
    args = types.SimpleNamespace(quick=quick, thor_option=dict(study_thor_options()), evals=evals)
    started = time.perf_counter()
    rows = suite.train_run(workload, data, optimizer, rate, seed, args, lambda row: None,
                           callbacks=[step_size_callback(every, steps_record)],
                           on_evaluate=on_evaluate)
    return {"optimizer": optimizer, "rate": float(rate), "seed": int(seed), "total_steps": total,
            "warmup_steps": int(round(baselines.WARMUP_FRACTION * total)), "step_every": every,
            "final_metric": rows[-1]["metric"], "evals": points, "step_sizes": steps_record,
            "wall_seconds": round(time.perf_counter() - started, 1)}


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------

def phase_of(step, total, warmup):
    """Index into :data:`PHASES` of optimizer step ``step`` (1-based count of steps done)."""
    if step <= warmup:
        return 0
    third = (total - warmup) / 3
    return 1 + min(2, int((step - warmup - 1e-9) // third)) if third > 0 else 3


def add_match(thor, base, higher_is_better):
    """Per THOR evaluation: the baseline's first step at or past THOR's value there, over THOR's
    step (``match``; None: the baseline never got there), for train loss, held-out loss and
    metric."""
    keys = {"train_loss": False, "test_loss": False, "test_metric": higher_is_better}
    for p in thor["evals"]:
        p["match"] = {}
        if p["step"] == 0:
            continue
        for key, higher in keys.items():
            hit = next((q["step"] for q in base["evals"] if q["step"] > 0 and (
                q[key] >= p[key] if higher else q[key] <= p[key])), None)
            p["match"][key] = None if hit is None else hit / p["step"]


def phase_rows(run):
    """Per phase of one run: the values at its last evaluation, and means over it."""
    total, warmup = run["total_steps"], run["warmup_steps"]
    out = []
    evals = [p for p in run["evals"] if p["step"] > 0]
    for index, name in enumerate(PHASES):
        inside = [p for p in evals if phase_of(p["step"], total, warmup) == index]
        if not inside:
            out.append({"phase": name})
            continue
        last = inside[-1]
        before = [p for p in run["evals"] if p["step"] < inside[0]["step"]]
        row = {"phase": name, "end_step": last["step"],
               **{k: last[k] for k in ("train_loss", "test_loss", "test_metric", "gap")}}
        sizes = [s for s in run["step_sizes"] if phase_of(s["step"] + 1, total, warmup) == index]
        if sizes:
            row["step_size"] = {k: statistics.fmean(s["layers"][k] for s in sizes)
                                for k in sizes[0]["layers"] if sizes[0]["layers"][k] is not None}
            row["lr"] = statistics.fmean(s["lr"] for s in sizes if s["lr"] is not None)
        if "match" in last:
            row["match"] = last["match"]
        if "layers" in last:
            start = before[-1]["layers"] if before and "layers" in before[-1] else None
            row["refreshes"] = {k: v["refreshes"] - (start[k]["refreshes"] if start else 0)
                                for k, v in last["layers"].items()}
            row["frozen"] = {k: v["frozen"] for k, v in last["layers"].items()}
            row["age"] = {k: statistics.fmean(p["layers"][k]["age"] or 0 for p in inside)
                          for k in last["layers"]}
            with_stale = [p for p in inside if "staleness" in p]
            if with_stale:
                row["staleness"] = {
                    layer: {side: {m: statistics.fmean(p["staleness"][layer][side][m]
                                                       for p in with_stale)
                                   for m in ("in_use", "identity", "fresh_other", "outside")}
                            for side in with_stale[-1]["staleness"][layer]}
                    for layer in with_stale[-1]["staleness"]}
        out.append(row)
    return out


def _median_tree(values):
    """Median over seeds of nested dicts of numbers (keys of the first; None, a baseline that
    never matched THOR, counts as the largest; booleans: how many seeds)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_tree([v[k] for v in values if isinstance(v, dict) and k in v])
                for k in first}
    if isinstance(first, bool):
        return sum(bool(v) for v in values)  # how many seeds
    if isinstance(first, (int, float)) or first is None:
        return suite._median(values)  # None (never) sorts last: the median may be never
    return first


def phase_table(runs):
    """``{optimizer: [per phase: medians over seeds]}`` (frozen: the number of seeds)."""
    table = {}
    for optimizer in sorted({r["optimizer"] for r in runs.values()}):
        per_seed = [phase_rows(r) for r in runs.values() if r["optimizer"] == optimizer]
        table[optimizer] = [_median_tree([p[i] for p in per_seed])
                            for i in range(len(PHASES))]
    return table


def path_length(runs):
    """Per run: ``sum_t ||dw_t||/||w_t||`` over the run per layer (the sampled steps times the
    sampling interval: an estimate), ``sum_t lr_t`` the same way, and the final gap."""
    out = {}
    for key, run in sorted(runs.items()):
        sizes, every = run["step_sizes"], run["step_every"]
        layers = [k for k in sizes[0]["layers"]] if sizes else []
        out[key] = {"layers": {k: every * sum(s["layers"][k] or 0.0 for s in sizes)
                               for k in layers},
                    "lr": every * sum(s["lr"] or 0.0 for s in sizes),
                    "final_gap": run["evals"][-1]["gap"], "final_metric": run["final_metric"]}
    return out


#: Basis ages (steps since the layer's refresh) binned for :func:`staleness_by_age`.
YOUNG, OLD = 10, 30


def staleness_by_age(runs):
    """Per rotated side, over THOR's evaluations after warmup (every seed): the mean off-diagonal
    energy of the basis in use when it is young (age <= :data:`YOUNG`) and old (>= :data:`OLD`),
    with the identity's and the other batch's fresh basis's over the same evaluations, and how
    many evaluations each bin holds: does a basis get worse as it ages?"""
    bins = {}
    for run in runs.values():
        if run["optimizer"] != "thor":
            continue
        for p in run["evals"]:
            if p["step"] <= run["warmup_steps"] or "staleness" not in p:
                continue
            for layer, sides in p["staleness"].items():
                age = p["layers"][layer]["age"]
                for side, m in sides.items():
                    if m["block"] <= 1 or age is None:
                        continue
                    key = f"{layer} {side}"
                    for name, keep in (("young", age <= YOUNG), ("old", age >= OLD),
                                       ("all", True)):
                        if keep:
                            bins.setdefault(key, {}).setdefault(name, []).append(
                                (m["in_use"], m["identity"], m["fresh_other"]))
    out = {}
    for key, groups in bins.items():
        out[key] = {}
        for name, values in groups.items():
            arr = np.array(values)
            out[key][name] = {"n": len(values), "in_use": float(arr[:, 0].mean()),
                              "identity": float(arr[:, 1].mean()),
                              "fresh_other": float(arr[:, 2].mean())}
    return out


def markdown(record):
    """The per-phase table as text (medians over seeds)."""
    table, metric = record["phases"], record["metric"]
    base = record["baseline"]
    lines = [f"{record['workload']} at {record['multiple']}x ({record['total_steps']} steps, "
             f"seeds {record['seeds']}): THOR vs {base} {record['baseline_rate']:g}", ""]

    def ratio(v):
        return "never" if v is None else f"{v:.2f}"

    rows = []
    for t, b in zip(table.get("thor", []), table.get(base, [])):
        if "end_step" not in t:
            continue
        m = t.get("match") or {}
        rows.append((f"{t['phase']} ({t['end_step']:.0f})",
                     f"{t['train_loss']:.4f} / {b['train_loss']:.4f}",
                     f"{t['test_loss']:.4f} / {b['test_loss']:.4f}",
                     f"{t['test_metric']:.4f} / {b['test_metric']:.4f}",
                     f"{t['gap']:+.4f} / {b['gap']:+.4f}",
                     f"{ratio(m.get('train_loss'))}, {ratio(m.get('test_loss'))}, "
                     f"{ratio(m.get('test_metric'))}"))
    lines += tables.md_table(
        ("phase (end step)", f"train-subset loss THOR / {base}", "held-out loss",
         f"held-out {metric}", "gap (held-out - train)",
         f"{base}'s steps to THOR's train loss, held-out loss, {metric} / THOR's"), rows)
    layers = sorted({k for t in table.get("thor", []) for k in t.get("step_size", {})})
    lines += ["", "Step size ||dw||/||w|| per step, mean in phase, THOR / " + base + ":", ""]
    lines += tables.md_table(
        ["phase"] + layers,
        [[t["phase"]] + [f"{t['step_size'][k]:.2e} / {b['step_size'].get(k, float('nan')):.2e}"
                         for k in layers]
         for t, b in zip(table.get("thor", []), table.get(base, []))
         if "step_size" in t and "step_size" in b])
    lines += ["", "THOR's state per phase: refreshes in it, mean basis age, off-diagonal "
              "energy in use / identity / fresh from the other probe batch (rotated sides):", ""]
    rows = []
    for t in table.get("thor", []):
        if "refreshes" not in t:
            continue
        stale = "; ".join(f"{layer} {side}({m['in_use']:.3f}/{m['identity']:.3f}/"
                          f"{m['fresh_other']:.3f})"
                          for layer, sides in (t.get("staleness") or {}).items()
                          for side, m in sides.items() if m["identity"] > 0)
        rows.append((t["phase"], ", ".join(f"{k} {v:g}" for k, v in t["refreshes"].items()),
                     ", ".join(f"{k} {v:.0f}" for k, v in t["age"].items()),
                     ", ".join(f"{k} {v}" for k, v in t["frozen"].items()), stale))
    lines += tables.md_table(
        ("phase", "refreshes", "age", "frozen (seeds)", "off-diagonal energy"), rows)
    paths = record.get("path_length") or {}
    if paths:
        layers = sorted({k for p in paths.values() for k in p["layers"]})
        lines += ["", "The whole run's path, sum over steps of ||dw||/||w|| per layer (sampled "
                  "steps x interval), the sum of the rates, and the final gap and metric:", ""]
        lines += tables.md_table(
            ["run"] + layers + ["sum lr", "final gap", "final metric"],
            [[key] + [f"{p['layers'].get(k, float('nan')):.2f}" for k in layers]
             + [f"{p['lr']:.2f}", f"{p['final_gap']:+.3f}", f"{p['final_metric']:.4f}"]
             for key, p in paths.items()])
    by_age = record.get("staleness_by_age") or {}
    if by_age:
        lines += ["", f"Off-diagonal energy by the basis's age (THOR, after warmup, all seeds): "
                  f"in use when young (age <= {YOUNG}) / old (>= {OLD}); identity; fresh from "
                  f"the other probe batch (evaluations in each bin):", ""]

        def cell(group):
            return "-" if not group else f"{group['in_use']:.3f} ({group['n']})"

        lines += tables.md_table(
            ("side", "young", "old", "identity", "fresh other"),
            [(key, cell(b.get("young")), cell(b.get("old")), f"{b['all']['identity']:.3f}",
              f"{b['all']['fresh_other']:.3f}") for key, b in by_age.items()])
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Figure
# --------------------------------------------------------------------------------------------

def plot(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, base = record["runs"], record["baseline"]
    colors = {"thor": "tab:red", base: "tab:orange"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (ax_loss, ax_metric, ax_gap), (ax_step, ax_stale, ax_age) = axes
    for key, run in sorted(runs.items()):
        opt, bold = run["optimizer"], run["seed"] == record["seeds"][0]
        label = (opt if opt == "thor" else f"{opt} {run['rate']:g}") if bold else None
        kw = dict(color=colors.get(opt), lw=1.6 if bold else 0.7, alpha=1 if bold else 0.6)
        steps = [p["step"] for p in run["evals"]]
        ax_loss.plot(steps, [p["test_loss"] for p in run["evals"]], label=label and
                     f"{label} held-out", **kw)
        ax_loss.plot(steps, [p["train_loss"] for p in run["evals"]], ls="--", label=label and
                     f"{label} train subset", **kw)
        ax_metric.plot(steps, [p["test_metric"] for p in run["evals"]], label=label, **kw)
        ax_gap.plot(steps, [p["gap"] for p in run["evals"]], label=label, **kw)
    total, warmup = record["total_steps"], record["warmup_steps"]
    for ax in (ax_loss, ax_metric, ax_gap, ax_step, ax_stale, ax_age):
        for b in (warmup, warmup + (total - warmup) / 3, warmup + 2 * (total - warmup) / 3):
            ax.axvline(b, color="gray", lw=0.6, ls=":")
        ax.set_xlabel("step")
    ax_loss.set_yscale("log")
    ax_loss.set_title("loss: held-out (solid), fixed train subset (dashed)", fontsize=9)
    ax_metric.set_title(f"held-out {record['metric']}", fontsize=9)
    finals = [r["evals"][-1]["test_metric"] for r in runs.values()]
    if record["metric"] == "accuracy":
        ax_metric.set_ylim(min(finals) - 0.08, max(finals) + 0.02)
    ax_gap.set_title("held-out minus train-subset loss", fontsize=9)
    ax_gap.axhline(0, color="gray", lw=0.6)
    # Step size per layer: seed 0, a running mean over 5 samples.
    seed0 = record["seeds"][0]
    styles = ["-", "--", "-.", ":"]
    for opt in ("thor", base):
        run = runs.get(f"{opt}/{seed0}")
        if not run or not run["step_sizes"]:
            continue
        layers = list(run["step_sizes"][0]["layers"])
        for i, layer in enumerate(layers):
            xs = [s["step"] for s in run["step_sizes"]]
            ys = np.array([s["layers"][layer] or np.nan for s in run["step_sizes"]])
            k = min(5, len(ys))
            smooth = np.convolve(ys, np.ones(k) / k, mode="same")
            ax_step.plot(xs, smooth, color=colors.get(opt), ls=styles[i % 4], lw=1.1,
                         label=f"{opt} {layer}")
    ax_step.set_yscale("log")
    ax_step.set_title(f"||dw||/||w|| per step, per layer (seed {seed0}, mean of 5)", fontsize=9)
    thor = runs.get(f"thor/{seed0}")
    if thor:
        stale = [p for p in thor["evals"] if "staleness" in p]
        keys = [(layer, side) for layer, sides in stale[-1]["staleness"].items()
                for side, m in sides.items() if m["block"] > 1] if stale else []
        cmap = plt.get_cmap("tab10")
        for i, (layer, side) in enumerate(keys):
            xs = [p["step"] for p in stale]
            c = cmap(i % 10)
            ax_stale.plot(xs, [p["staleness"][layer][side]["in_use"] for p in stale], color=c,
                          lw=1.4, label=f"{layer} {side}")
            ax_stale.plot(xs, [p["staleness"][layer][side]["identity"] for p in stale],
                          color=c, lw=0.7, ls=":")
            ax_stale.plot(xs, [p["staleness"][layer][side]["fresh_other"] for p in stale],
                          color=c, lw=0.7, ls="--")
        ax_stale.set_title("off-diagonal energy of a fresh factor: basis in use (solid), "
                           "identity (dotted),\nfresh from the other probe batch (dashed); "
                           f"THOR seed {seed0}", fontsize=9)
        # Refreshes (cumulative), not the age: evaluations sample the age too sparsely to show it.
        pts = [p for p in thor["evals"] if p.get("layers")]
        for i, layer in enumerate(thor["evals"][-1].get("layers", {})):
            ax_age.plot([p["step"] for p in pts], [p["layers"][layer]["refreshes"] for p in pts],
                        ls=styles[i % 4], color=cmap(i % 10), label=layer)
            frozen = [p["step"] for p in pts if p["layers"][layer]["frozen"]]
            if frozen:
                ax_age.axvline(frozen[0], color=cmap(i % 10), lw=0.8)
        steps = [p["step"] for p in pts]
        ax_age.plot(steps, [s // 10 + 1 for s in steps], color="gray", lw=0.7, ls=":",
                    label="every cadence point")
        ax_age.set_title(f"THOR's refreshes per layer, cumulative (vertical: frozen), seed "
                         f"{seed0}", fontsize=9)
    for ax in (ax_loss, ax_metric, ax_gap, ax_step, ax_stale, ax_age):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5)
    fig.suptitle(f"{record['workload']} at {record['multiple']}x the suite's length "
                 f"({total} steps): THOR (defaults) vs {base} {record['baseline_rate']:g}; "
                 f"seeds {record['seeds']} (seed {seed0} bold); dotted: the schedule's phases",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The baseline's rate
# --------------------------------------------------------------------------------------------

def baseline_rate(name, baseline, multiple, quick, given=None, root=ROOT):
    """``(rate, source)``: ``given``; else the best seed-0 final of ``baseline`` at this length
    in ``docs/results/horizon_runs.jsonl``; else the best of ``--rate-check``'s record at this
    length; else the suite's (``suite.json``) or, quick, the middle of the workload's grid."""
    if given is not None:
        return float(given), "--baseline-rate"
    workload = wl.WORKLOADS[name]
    if quick:
        grid = workload.baselines.get(baseline, (1e-2,))
        return float(grid[len(grid) // 2]), "quick: the middle of the workload's grid"
    cache = root / "docs" / "results" / hz.CACHE
    if cache.exists():
        sign = 1 if workload.higher_is_better else -1
        tuned = [r for r in read_jsonl(cache)
                 if r.get("workload") == name and r.get("phase") == "sweep"
                 and r.get("optimizer") == baseline and r.get("multiple") == multiple
                 and r.get("seed") == 0 and not r.get("quick")]
        if tuned:
            best = max(tuned, key=lambda r: sign * r["final"])
            return float(best["rate"]), (f"{hz.CACHE}: best seed-0 final at {multiple}x of "
                                         f"{sorted(r['rate'] for r in tuned)}")
    check = root / "docs" / "results" / f"anatomy_{name}_{multiple}x_rates.json"
    if check.exists():
        finals = json.loads(check.read_text())["finals"]
        if len(finals) > 1:
            sign = 1 if workload.higher_is_better else -1
            best = max(finals, key=lambda k: sign * finals[k])
            return float(best), (f"{check.name}: best seed-0 final of {sorted(map(float, finals))}"
                                 f" (--rate-check)")
    suite_json = root / "docs" / "results" / "suite.json"
    if suite_json.exists():
        result = json.loads(suite_json.read_text()).get("results", {}).get(name, {})
        if result.get("baseline") == baseline:
            note = "" if multiple == 1 else f" (not tuned at {multiple}x)"
            return float(result["rate"]), f"suite.json: the suite's best at 1x{note}"
    grid = workload.baselines.get(baseline, (1e-2,))
    return float(grid[len(grid) // 2]), "the middle of the workload's grid (not tuned)"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    from experiments.cli import parse_ints

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workload", default=None, choices=sorted(wl.WORKLOADS),
                        help=f"default fashion_cnn (--quick: {QUICK_WORKLOAD})")
    parser.add_argument("--multiple", type=parse_ints, default=[1],
                        help="times the suite's length, comma list (default 1)")
    parser.add_argument("--seeds", type=parse_ints, default=[0], help="comma list (default 0)")
    parser.add_argument("--evals", type=int, default=None,
                        help=f"evaluations after step 0 (default {DEFAULT_EVALS}; --quick 4)")
    parser.add_argument("--baseline", default="muon", choices=suite.BASELINES)
    parser.add_argument("--baseline-rate", type=float, default=None,
                        help="the baseline's peak rate (default: tuned, see above)")
    parser.add_argument("--out", default=None,
                        help="output directory (default docs/results; --quick runs/anatomy)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--rate-check", action="store_true",
                        help="instead: the baseline alone at its rate / 3 and x 3 (seed 0)")
    args = parser.parse_args(argv)
    args.workload = args.workload or (QUICK_WORKLOAD if args.quick else "fashion_cnn")
    args.evals = args.evals or (4 if args.quick else DEFAULT_EVALS)
    if args.evals < 1:
        raise SystemExit("error: --evals must be >= 1")
    args.out = Path(args.out or ("runs/anatomy" if args.quick else ROOT / "docs" / "results"))
    args.argv = argv  # for the records' command (experiments.record)
    return args


def record_path(out, workload, multiple):
    return Path(out) / f"anatomy_{workload}_{multiple}x.json"


def run_length(args, multiple):
    """Train what the record at ``multiple`` lacks; write it after every seed; the record."""
    from experiments.record import environment

    workload, data = hz.lengthened_workload(args.workload, multiple, args.quick)
    if args.quick and not workload.single_pass:  # CI's time: one epoch of the quick sizes
        workload = dataclasses.replace(workload, epochs=multiple)
    rate, source = baseline_rate(args.workload, args.baseline, multiple, args.quick,
                                 args.baseline_rate)
    path = record_path(args.out, args.workload, multiple)
    record = json.loads(path.read_text()) if path.exists() else {}
    if record and (record.get("evals") != args.evals or record.get("quick") != args.quick):
        print(f"{path}: made with other settings; starting it again", flush=True)
        record = {}
    if record and (record.get("baseline") != args.baseline or record.get("baseline_rate") != rate):
        # THOR's runs do not depend on the baseline: keep them, train the baseline again.
        print(f"{path}: baseline {record.get('baseline')} {record.get('baseline_rate')} -> "
              f"{args.baseline} {rate:g}: THOR's runs kept", flush=True)
        record["runs"] = {k: r for k, r in record.get("runs", {}).items()
                          if r["optimizer"] == "thor"}
        for r in record["runs"].values():
            for p in r["evals"]:
                p.pop("match", None)
    total = len(suite.batch_order(data.num_train, workload.batch_size, workload.epochs, 0,
                                  workload.single_pass))
    record.update({
        "workload": args.workload, "title": workload.title, "multiple": multiple,
        "quick": args.quick, "batch": workload.batch_size, "epochs": workload.epochs,
        "total_steps": total, "warmup_steps": int(round(baselines.WARMUP_FRACTION * total)),
        "evals": args.evals, "metric": workload.metric,
        "higher_is_better": workload.higher_is_better, "baseline": args.baseline,
        "baseline_rate": rate, "baseline_rate_source": source, "data": data.source,
        "train_subset": int(min(TRAIN_SUBSET, data.num_train)), "probe_batches": PROBE_BATCHES,
        "environment": environment()})
    record.setdefault("runs", {})
    print(f"[anatomy {args.workload} {multiple}x] {total} steps of batch {workload.batch_size}; "
          f"{args.baseline} at {rate:g} ({source})", flush=True)
    subset = fixed_rows(data.num_train, TRAIN_SUBSET, 1)
    probe_rows = fixed_rows(data.num_train, PROBE_BATCHES * workload.batch_size, 2)
    probes = [(data.x_train[r], data.y_train[r])
              for r in probe_rows.reshape(PROBE_BATCHES, -1)]
    for index, seed in enumerate(args.seeds):
        plan = [("thor", 0.0), (args.baseline, rate)]
        for optimizer, lr in (plan if index % 2 == 0 else plan[::-1]):
            key = f"{optimizer}/{seed}"
            if key in record["runs"]:
                print(f"[anatomy] {key}: in {path.name}, kept", flush=True)
                continue
            record["runs"][key] = run_one(workload, data, optimizer, lr, seed, args.evals,
                                          args.quick, probes, subset)
        for seed_key in (f"thor/{seed}",):
            base_key = f"{args.baseline}/{seed}"
            if seed_key in record["runs"] and base_key in record["runs"]:
                add_match(record["runs"][seed_key], record["runs"][base_key],
                          workload.higher_is_better)
        finish(record, path, args.argv)
    return record


def _rounded(value, digits=5):
    """``value`` with every float to ``digits`` significant digits (the record's size)."""
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))
    return value


def finish(record, path, argv=None):
    from experiments.record import stamp

    record.update(stamp(argv))
    record["seeds"] = sorted({r["seed"] for r in record["runs"].values()})
    if {"thor", record["baseline"]} <= {r["optimizer"] for r in record["runs"].values()}:
        record["phases"] = phase_table(record["runs"])
        record["staleness_by_age"] = staleness_by_age(record["runs"])
        record["path_length"] = path_length(record["runs"])
        record["table"] = markdown(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_rounded(record), separators=(",", ":")) + "\n")
    if "phases" in record:
        plot(record, path.with_suffix(".png"))
        print("\n" + record["table"], flush=True)
    print(f"wrote {path}", flush=True)


def rate_check(args, multiple):
    """The baseline alone (no measurements) at its rate here and a factor 3 either side, seed 0,
    the suite's loop: is the rate the best at this length? ``{rate: final}`` added to
    ``anatomy_<workload>_<m>x_rates.json`` (a rate the file or the anatomy record's seed 0
    already has is not trained again)."""
    workload, data = hz.lengthened_workload(args.workload, multiple, args.quick)
    rate, source = baseline_rate(args.workload, args.baseline, multiple, args.quick,
                                 args.baseline_rate)
    path = Path(args.out) / f"anatomy_{args.workload}_{multiple}x_rates.json"
    record = json.loads(path.read_text()) if path.exists() else {
        "workload": args.workload, "multiple": multiple, "baseline": args.baseline, "seed": 0,
        "centre": rate, "centre_source": source, "finals": {}, "curves": {}}
    run_args = argparse.Namespace(quick=args.quick, thor_option={}, evals=args.evals)
    anatomy = record_path(args.out, args.workload, multiple)
    if anatomy.exists():  # the rate of the anatomy record: its seed-0 final
        done = json.loads(anatomy.read_text())
        run = done.get("runs", {}).get(f"{args.baseline}/0")
        if run:
            record["finals"].setdefault(hz._rate_key(run["rate"]), run["final_metric"])
    for lr in hz.centred_grid(rate):
        key = hz._rate_key(lr)
        if key in record["finals"]:
            continue
        rows = suite.train_run(workload, data, args.baseline, lr, 0, run_args, lambda row: None)
        record["finals"][key] = rows[-1]["metric"]
        record["curves"][key] = [[r["step"], r["metric"]] for r in rows]
        path.parent.mkdir(parents=True, exist_ok=True)
        from experiments.record import stamp

        path.write_text(json.dumps({**record, **stamp(args.argv)}, indent=1))
    print(f"wrote {path}: {record['finals']}", flush=True)
    return record


def main(argv=None):
    args = parse_args(argv)
    if args.rate_check:
        return [rate_check(args, m) for m in args.multiple]
    return [run_length(args, m) for m in args.multiple]


if __name__ == "__main__":
    main()
