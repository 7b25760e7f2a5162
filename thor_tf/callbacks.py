"""Keras callbacks for THOR telemetry: the trace rule's per-layer Δ and decisions over time."""

from __future__ import annotations

import csv
import os
import warnings

import keras
import numpy as np
import tensorflow as tf

from thor_tf.state import DECISION_CODES


class TraceRuleLogger(keras.callbacks.Callback):
    """Writes each cadence point's per-layer Δ and decision; prints a summary at the end of fit.

    Rows of the CSV: ``step, epoch, layer, delta, decision, refreshes, reuses`` with ``decision`` one
    of ``refresh`` / ``reuse`` / ``freeze`` (frozen at this point) / ``frozen`` (frozen earlier: no
    work). With ``log_dir`` the same Δ and a decision code (2 refresh, 1 reuse, 0 freeze/frozen)
    go to TensorBoard scalars ``thor/<layer>/delta`` and ``thor/<layer>/decision`` at that step.

    The train step writes each cadence point's decisions into the engine's ``decision_log`` (the
    last 64 points); the callback reads the rows it has not seen after each batch, so with
    ``steps_per_execution > 1`` every cadence point still gets its rows. The train step itself
    never leaves the device.

    Args:
      csv_path: where to write the CSV (None: keep rows in memory only, see ``rows``).
      log_dir: optional TensorBoard log directory.
      summary: print the per-layer table (refreshes / reuses / frozen at) when fit ends.
    """

    def __init__(self, csv_path=None, log_dir=None, summary=True):
        super().__init__()
        if log_dir:
            try:
                import tensorboard  # noqa: F401  (tf.summary needs it; TF >= 2.20 does not ship it)
            except ImportError as err:
                raise ValueError(
                    "`log_dir` needs the tensorboard package (pip install tensorboard, or "
                    "thor_tf[tensorboard]); pass log_dir=None to write only the CSV.") from err
        self.csv_path = csv_path
        self.log_dir = log_dir
        self.summary = summary
        self.rows = []
        self._writer = None
        self._last_points = None
        self._epoch = 0

    def _engine(self):
        engine = getattr(self.model, "thor", None)
        if engine is None:
            raise ValueError("TraceRuleLogger needs a model returned by thor_tf.wrap()")
        return engine

    def on_train_begin(self, logs=None):
        engine = self._engine()
        self._names = [b.name for b in engine.blocks]
        # fit builds the THOR state before callbacks start
        self._last_points = int(engine.state.cadence_points.numpy())
        self._lost_warned = False
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        engine = self._engine()
        points = int(engine.state.cadence_points.numpy())
        if points == self._last_points:
            return
        log = engine.decision_log
        if points - self._last_points > log.size and not self._lost_warned:
            warnings.warn(
                f"TraceRuleLogger: {points - self._last_points} cadence points passed between two "
                f"batch ends; only the last {log.size} are kept (lower steps_per_execution).",
                stacklevel=2)
            self._lost_warned = True
        for row in log.rows(self._last_points, points):
            step = int(row["step"])
            for i, name in enumerate(self._names):
                decision = DECISION_CODES[int(row["code"][i])]
                delta = float(row["delta"][i]) if decision != "frozen" else float("nan")
                self.rows.append({
                    "step": step, "epoch": int(row["epoch"]), "layer": name, "delta": delta,
                    "decision": decision, "refreshes": int(row["refreshes"][i]),
                    "reuses": int(row["reuses"][i]),
                })
                if self._writer is not None:
                    code = {"refresh": 2, "reuse": 1}.get(decision, 0)
                    with self._writer.as_default(step=step):
                        if np.isfinite(delta):
                            tf.summary.scalar(f"thor/{name}/delta", delta)
                        tf.summary.scalar(f"thor/{name}/decision", code)
        self._last_points = points

    def on_train_end(self, logs=None):
        if self.csv_path:
            directory = os.path.dirname(self.csv_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            with open(self.csv_path, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=["step", "epoch", "layer", "delta", "decision",
                                                        "refreshes", "reuses"])
                writer.writeheader()
                writer.writerows(self.rows)
        if self._writer is not None:
            self._writer.flush()
        if self.summary:
            print(summary_table(self._engine().layer_stats()))


def summary_table(stats):
    """Per-layer refreshes / reuses / frozen-at table from ``engine.layer_stats()``."""
    rows = [("layer", "A", "G", "refreshes", "reuses", "frozen at", "last Δ")]
    for s in stats:
        frozen = str(s["frozen_at_step"]) if s["frozen"] else "-"
        rows.append((s["name"], str(s["a_dim"]), str(s["g_dim"]), str(s["refreshes"]),
                     str(s["reuses"]), frozen, f"{s['last_delta']:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
