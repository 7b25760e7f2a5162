"""The benchmarks' worker protocol: a script re-runs itself in a fresh process (fresh tracing,
fresh memory peak) and prints its result as one ``RESULT{json}`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def report(result):
    """Print ``result`` the way :func:`run_self` reads it."""
    print("RESULT" + json.dumps(result), flush=True)


def run_self(script, args, timeout=1800, **environ):
    """Run ``script`` with ``args`` in a fresh Python; the value it reported.

    ``environ`` adds environment variables. Raises ``RuntimeError`` with the worker's output
    tails when it fails or reports nothing.
    """
    cmd = [sys.executable, os.path.abspath(script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **environ))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {' '.join(cmd[1:])} failed:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT"):])


def thor_defaults():
    """What ``thor_tf.wrap(model)`` uses when given no options, as a benchmark record stores it:
    the split (resolved: the default rule's plan), the update rule (name and config), the
    cadence (``frequency``, ``preset``, ``trace_filter``, ``max_block_age``) and
    ``graph_optimization``. A record of THOR at its defaults carries this under
    ``"thor_defaults"``; tests/test_bench_records.py asserts it equals thor_tf's, so changing a
    default fails until the record is re-measured."""
    import inspect

    from thor_tf import model
    from thor_tf.config import ThorConfig
    from thor_tf.split_plan import split_config

    config = ThorConfig()
    rule = config.update_rule
    return {"split_dim": split_config(config.split_dim),
            "update_rule": {"name": rule.name, **rule.get_config()},
            "frequency": config.frequency, "preset": config.preset,
            "trace_filter": config.trace_filter, "max_block_age": config.max_block_age,
            "graph_optimization": inspect.signature(
                model.ThorModel.__init__).parameters["graph_optimization"].default}


def write_results(out, summary, script, argv, plot, plot_data):
    """Write ``summary`` with the machine, date and command to JSON ``out``, and the plot of
    ``plot_data`` (``plot(plot_data, path)``) to the PNG next to it."""
    import platform
    import time

    import tensorflow as tf

    summary = dict(summary)
    summary.update({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "gpus": len(tf.config.list_physical_devices("GPU")),
                    "tensorflow": tf.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", f"scripts/{os.path.basename(script)}"]
                            + (sys.argv[1:] if argv is None else list(argv))),
    })
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(summary, fh, indent=1)
    png = os.path.splitext(out)[0] + ".png"
    plot(plot_data, png)
    print(f"wrote {out} and {png}")


def train_step_seconds(model):
    """A list that receives the seconds of each Python call of ``model.train_step``: Keras runs
    ``train_step`` only while tracing its train function, so each entry is a trace (the first:
    the whole step's graph being built)."""
    original = model.train_step
    spent = []

    def timed(data):
        start = time.perf_counter()
        out = original(data)
        spent.append(time.perf_counter() - start)
        return out

    object.__setattr__(model, "train_step", timed)
    return spent
