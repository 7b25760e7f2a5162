"""The benchmarks' worker protocol: a script re-runs itself in a fresh process (fresh tracing,
fresh memory peak) and prints its result as one ``RESULT{json}`` line."""

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
