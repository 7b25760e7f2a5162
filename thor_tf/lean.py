"""Few-op forms of constructs that THOR's traced step uses many times.

THOR's first call costs in proportion to its graph: every op is traced in Python (~0.3 ms),
optimized, instantiated and given a kernel at its first run (docs/overhead.md, "Tracing"). A
``tf.eye`` of dynamic size is ~22 ops, of static size ~7, a constant 1; ``x[:, None, None]`` is
4 ops (a strided slice and its three index constants), a reshape 2. Values are the same.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

#: Above this size an identity is built by ``tf.eye`` (a few ops) instead of stored in the graph
#: as a constant (``d²`` floats: 1 MiB at 512).
CONSTANT_EYE_MAX = 512


def eye(d: int, dtype=tf.float32):
    """The ``[d, d]`` identity (static ``d``); broadcasts against ``[nb, d, d]`` in ``tf.where``
    and products."""
    d = int(d)
    dtype = tf.as_dtype(dtype)
    if d <= CONSTANT_EYE_MAX:
        return tf.constant(np.eye(d, dtype=dtype.as_numpy_dtype))
    return tf.eye(d, dtype=dtype)


def per_block(values, rank: int):
    """``values`` ``[nb]`` as ``[nb, 1, …]`` of the given rank, to select or scale whole blocks
    (``tf.where(per_block(ok, 3), new, old)``)."""
    return tf.reshape(values, [-1] + [1] * (int(rank) - 1))
