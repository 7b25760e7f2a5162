"""Keras callbacks for THOR telemetry: the trace rule's per-layer Δ and decisions over time."""

from __future__ import annotations

import csv
import os

import keras
import numpy as np
import tensorflow as tf

DECISIONS = ("refresh", "reuse", "freeze", "frozen")


class TraceRuleLogger(keras.callbacks.Callback):
    """Writes each cadence point's per-layer Δ and decision; prints a summary at the end of fit.

    Rows of the CSV: ``step, epoch, layer, delta, decision, refreshes, reuses`` with ``decision`` one
    of ``refresh`` / ``reuse`` / ``freeze`` (frozen at this point) / ``frozen`` (frozen earlier: no
    work). With ``log_dir`` the same Δ and a decision code (2 refresh, 1 reuse, 0 freeze/frozen)
    go to TensorBoard scalars ``thor/<layer>/delta`` and ``thor/<layer>/decision`` at that step.

    The callback reads the engine's small counter vectors after each batch (a few scalars per
    layer); the train step itself never leaves the device.

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
        self._previous = self._snapshot()  # fit builds the THOR state before callbacks start
        self._last_points = int(self._previous["cadence_points"])
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _snapshot(self):
        state = self._engine().state
        return {key: getattr(state, key).numpy().copy() for key in
                ("cadence_points", "refreshes", "reuses", "frozen", "last_delta", "last_refresh")}

    def on_train_batch_end(self, batch, logs=None):
        points = int(self._engine().state.cadence_points.numpy())
        if points == self._last_points:
            return
        now = self._snapshot()
        step = int(self.model.optimizer.iterations.numpy()) - 1
        for i, name in enumerate(self._names):
            if now["refreshes"][i] > self._previous["refreshes"][i]:
                decision = "refresh"
            elif now["frozen"][i] and not self._previous["frozen"][i]:
                decision = "freeze"
            elif now["frozen"][i]:
                decision = "frozen"
            else:
                decision = "reuse"
            delta = float(now["last_delta"][i]) if decision != "frozen" else float("nan")
            self.rows.append({
                "step": step, "epoch": self._epoch, "layer": name, "delta": delta,
                "decision": decision, "refreshes": int(now["refreshes"][i]),
                "reuses": int(now["reuses"][i]),
            })
            if self._writer is not None:
                code = {"refresh": 2, "reuse": 1}.get(decision, 0)
                with self._writer.as_default(step=step):
                    if np.isfinite(delta):
                        tf.summary.scalar(f"thor/{name}/delta", delta)
                    tf.summary.scalar(f"thor/{name}/decision", code)
        self._previous = now
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
