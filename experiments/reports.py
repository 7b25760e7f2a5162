"""What the reports share: the CSV reader, time to a target, the machine's description, the
number formatter and the markdown table writer."""

from __future__ import annotations

import csv
import math
import os
import platform


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

