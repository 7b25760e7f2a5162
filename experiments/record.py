"""The stamp every benchmark record carries, and the one writer of a record and its plot.

A record in ``docs/results/`` says what made it: the commit the code was at (``+dirty`` when
``thor_tf/``, ``experiments/`` or ``scripts/`` had uncommitted changes), the date, the machine,
and the command that regenerates it (``python`` + the script as run + its arguments).
:mod:`experiments.report` shows the commit and machine beside each table.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root=ROOT):
    """The short commit the checkout at ``root`` is at, ``+dirty`` with uncommitted changes to the
    code; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "thor_tf", "experiments",
                                "scripts"], cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine():
    """``"x86_64, 2 cores; Linux-…"``: the architecture, cores and platform a run had."""
    return f"{platform.machine()}, {os.cpu_count()} cores; {platform.platform()}"


def environment():
    """``{"device", "tensorflow", "keras", "python", "platform"}`` of this process: the GPUs' names
    or the CPU and its cores, and the versions a run had (a driver's record carries it)."""
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


def command(argv=None, script=None):
    """The command line that made this run, relative to the checkout: ``python <script>
    <argv>`` (``script``: the running file, ``sys.argv[0]``, unless given; ``argv``: its
    arguments, ``sys.argv[1:]`` unless given)."""
    path = Path(script or sys.argv[0]).resolve()
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        pass
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", path.as_posix()] + [str(a) for a in args])


def stamp(argv=None, script=None):
    """``{"commit", "date", "machine", "command"}`` for a record made now."""
    return {"commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(), "command": command(argv, script)}


def write(out, record, plot=None, plot_data=None, argv=None, script=None):
    """Write ``record`` with its :func:`stamp` (fields the record already has win) to JSON
    ``out``; with ``plot``, also ``plot(plot_data, <out>.png)``. Returns the record written."""
    record = {**stamp(argv, script), **record}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    written = [str(out)]
    if plot is not None:
        png = out.with_suffix(".png")
        plot(plot_data, png)
        written.append(str(png))
    print("wrote " + " and ".join(written), flush=True)
    return record
