"""The benchmarks' worker protocol and the defaults a record of THOR stores.

A benchmark re-runs itself in a fresh process (fresh tracing, fresh memory peak) with
:func:`run_self`; the worker prints its result as one ``RESULT{json}`` line (:func:`report`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


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
    from thor_tf.split.plan import split_config

    config = ThorConfig()
    rule = config.update_rule
    return {"split_dim": split_config(config.split_dim),
            "update_rule": {"name": rule.name, **rule.get_config()},
            "frequency": config.trace_rule.frequency, "preset": config.trace_rule.preset,
            "trace_filter": config.trace_rule.trace_filter,
            "max_block_age": config.trace_rule.max_block_age,
            "graph_optimization": inspect.signature(
                model.ThorModel.__init__).parameters["graph_optimization"].default}


def write_results(out, summary, script, argv, plot, plot_data):
    """Write a benchmark's ``summary`` with its stamp and TensorFlow's version and devices
    (:func:`experiments.record.write`) to JSON ``out``, and ``plot(plot_data, <out>.png)``."""
    import tensorflow as tf

    from experiments import record

    summary = {**summary, "tensorflow": tf.__version__,
               "gpus": len(tf.config.list_physical_devices("GPU"))}
    return record.write(out, summary, plot, plot_data, argv=argv, script=script)
