"""Seconds of traced work on this machine, as the split calibration measures them.

:func:`time_round_robin` times ``(tf.function, args)`` pairs: each traced and warmed up, then
rounds that run every one once (a slow spell of a shared machine hits all alike), each run
waiting for its results (``sync_devices``: GPUs run asynchronously); the median per pair.
:func:`time_split_inversion` is the seed's measure on it: the inverse rule's damped block
inversions of given factors at each candidate split. :func:`device_description` names the
device that runs them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from thor_tf.block_diagonal import diagonal_blocks, split_layout
from thor_tf.rules.inverse_ops import invert_blocks
from thor_tf.split.crossing import _check_candidates
from thor_tf.split.information import _as_square

__all__ = ["device_description", "time_round_robin", "time_split_inversion"]


def _sync():
    """Block until the work queued on every device is done (a no-op wait on CPU)."""
    tf.test.experimental.sync_devices()


def time_round_robin(works: Sequence, repeats: int = 3, warmup: int = 1) -> list:
    """Median seconds of each ``(fn, args)`` in ``works``: each traced and run ``warmup`` times,
    then ``repeats`` rounds that run every one once (round robin: a slow spell of a shared machine
    hits all alike)."""
    if int(repeats) < 1 or int(warmup) < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0; got {repeats}, {warmup}.")
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # one tf.function per candidate is the point: no retracing warning
    try:
        for fn, args in works:
            for _ in range(1 + int(warmup)):
                fn(*args)
        _sync()
        times = [[] for _ in works]
        for _ in range(int(repeats)):
            for k, (fn, args) in enumerate(works):
                start = time.perf_counter()
                fn(*args)
                _sync()
                times[k].append(time.perf_counter() - start)
    finally:
        logger.setLevel(level)
    return [float(statistics.median(t)) for t in times]


def time_split_inversion(matrices: Sequence, cands: Sequence[int], damping: float,
                         repeats: int = 5, warmup: int = 2, device: Optional[str] = None) -> list:
    """Seconds to invert all ``matrices``, damped, split at each candidate, as training does.

    Training computes each factor's diagonal blocks directly (:func:`thor_tf.blocks.block_gram`,
    ``[nb, d, d]`` with zero padding past the factor's dimension) and inverts them with
    :func:`thor_tf.rules.inverse_ops.invert_blocks` (damp, identity on the padding, one batched Cholesky,
    float64 retry of failed blocks). So for each candidate ``b`` the blocks of every factor are cut
    beforehand (:func:`thor_tf.rules.inverse_ops.split_layout`; not timed) and one ``tf.function`` taking
    them as arguments (nothing constant-folded) returns
    ``[invert_blocks(B_i, damping, n_i) for B_i in blocks]``. Timed by :func:`time_round_robin`
    (traced, run ``warmup`` times, then ``repeats`` rounds of every candidate once). The device
    is the default one (the GPU when TensorFlow sees one) unless ``device`` names one.

    Args:
      matrices: the (undamped) factors ``[n_i, n_i]``.
      cands: increasing candidate split dimensions.
      damping: value added to every factor's diagonal (``d``, e.g. ``sqrt(λ)``), > 0.
      repeats: timed runs per candidate (the median is returned), >= 1.
      warmup: untimed runs per candidate after tracing, >= 0.
      device: optional TF device string, e.g. ``"/CPU:0"``.

    Returns:
      list of median seconds, one per candidate.
    """
    cands = _check_candidates(cands)
    if int(repeats) < 1 or int(warmup) < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0; got {repeats}, {warmup}.")
    if not damping > 0:
        raise ValueError(f"`damping` must be > 0; got {damping!r}.")
    arrays = [np.asarray(_as_square(m), np.float32) for m in matrices]
    if not arrays:
        raise ValueError("`matrices` is empty.")
    dims = [a.shape[0] for a in arrays]

    def invert_all(blocks, d):
        return [invert_blocks(b, d, n) for b, n in zip(blocks, dims)]

    def works():
        damp = tf.constant(float(damping), tf.float32)
        out = []
        for c in cands:
            blocks = [tf.constant(diagonal_blocks(a, split_layout(a.shape[0], c)[1]))
                      for a in arrays]
            spec = [[tf.TensorSpec(b.shape, tf.float32) for b in blocks],
                    tf.TensorSpec([], tf.float32)]
            out.append((tf.function(invert_all, input_signature=spec, autograph=False),
                        (blocks, damp)))
        return out

    if device is None:
        return time_round_robin(works(), repeats=repeats, warmup=warmup)
    with tf.device(device):
        return time_round_robin(works(), repeats=repeats, warmup=warmup)


def device_description() -> str:
    """The device that :func:`time_split_inversion` uses by default, in words."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", gpus[0].name)
        except Exception:  # details are best effort
            name = gpus[0].name
        return f"GPU: {name}" + (f" (+{len(gpus) - 1} more)" if len(gpus) > 1 else "")
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} logical cores visible)"
