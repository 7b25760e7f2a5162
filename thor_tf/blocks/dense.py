"""Dense: ``z = x @ kernel (+ bias)``; ``x`` is ``[..., in]``, one row of A per leading position."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock, row_count


class DenseBlock(KroneckerBlock):
    """Dense: rows are the input vectors (``[N, in]``, or ``[N, ..., in]`` flattened to rows)."""

    kind = "dense"

    def pre_activation(self, inputs):
        z = ops.matmul(inputs, self.layer.kernel)
        if self.layer.bias is not None:
            z = ops.add(z, self.layer.bias)
        return z

    def input_rows(self, inputs):
        return tf.reshape(tf.cast(inputs, tf.float32), [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        x = tf.cast(inputs, tf.float32)
        return tf.reduce_sum(tf.square(x)), row_count(x)
