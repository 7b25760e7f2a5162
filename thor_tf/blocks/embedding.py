"""Embedding(V, D): a Dense layer on one-hot tokens, with a diagonal A stored as V 1×1 blocks.

Shapes: ``x`` holds integer tokens ``[N, T]`` (any shape ``[N, ...]``), ``z = embeddings[x]`` is
``[N, T, D]``, the variable ``layer.embeddings`` is ``[V, D]`` (the block matrix as it is; no bias).

With ``ā`` the one-hot token, ``z = ā @ embeddings`` is Dense, so

    A = mean over the N·T tokens of ā āᵀ = diag(f),   f_v = (count of token v) / (N·T)
    G = mean over the N·T output rows of g gᵀ          [D, D]
    P = T (rows per example)

A is diagonal by structure: :meth:`split_sizes` returns 1 for A, so it is stored and inverted as
V 1×1 blocks (O(V) memory and work, never V×V) whatever ``split_dim`` is; G is split like Dense's.
The preconditioned update of row v is ``∇_v · G_inv / (P·(f_v + d))`` with ``d = √(λ/P)``: a
token absent from the batch has a zero gradient row and gets a zero update. ``tr A`` = mean
``||ā||²`` = 1. A mask (``mask_zero``) does not change the block: every token counts.

Gradients of the embeddings arrive as ``tf.IndexedSlices``; :meth:`to_matrix` densifies them
(duplicate rows summed), so the update of the variable is dense.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock, joined_row_weights
from thor_tf.split.plan import split_size


class EmbeddingBlock(KroneckerBlock):
    """Embedding: A = diag(token frequencies) as V 1×1 blocks, G as Dense over the N·T rows."""

    kind = "embedding"
    kernel_attribute = "embeddings"  # the [V, D] variable; no bias

    def __init__(self, name, layer):
        super().__init__(name, layer)
        self.vocabulary = self.in_dim

    def split_sizes(self, split_dim):
        return 1, split_size(split_dim, self.g_dim)

    def pre_activation(self, inputs):
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = ops.cast(inputs, "int32")
        return ops.cast(ops.take(self.layer.embeddings, inputs, axis=0), self.layer.compute_dtype)

    def matches(self, record):
        # A lookup maps [N, ...] tokens to [N, ..., D]; a tied head called on vectors does not.
        rank_in, rank_z = record.inputs.shape.rank, record.z.shape.rank
        shaped = rank_in is None or rank_z is None or rank_z == rank_in + 1
        return shaped and super().matches(record)

    def to_matrix(self, kernel_value, bias_value=None):
        if isinstance(kernel_value, tf.IndexedSlices):
            kernel_value = tf.convert_to_tensor(kernel_value)
        return tf.reshape(tf.cast(kernel_value, tf.float32), [self.vocabulary, self.g_dim])

    @staticmethod
    def _tokens(inputs):
        return tf.reshape(tf.cast(inputs, tf.int32), [-1])

    def input_rows(self, inputs):
        """The one-hot rows ``[N·T, V]`` (for reference only: training never forms them)."""
        return tf.one_hot(self._tokens(inputs), self.vocabulary, dtype=tf.float32)

    def input_sq_norm_sum(self, inputs):
        count = tf.cast(tf.size(inputs), tf.float32)
        return count, count

    def token_frequencies(self, records, masks=None):
        """``f``: ``[V]`` float32, the fraction of the N·T tokens of ``records`` equal to each v
        (of the valid tokens with row ``masks``: padding counts for nothing)."""
        per_call = [self._tokens(r.inputs) for r in records]
        tokens = tf.concat(per_call, axis=0)
        if masks is None:
            weights = tf.ones_like(tokens, tf.float32)
            total = tf.cast(tf.size(tokens), tf.float32)
        else:
            weights = joined_row_weights(masks, [t[:, None] for t in per_call])
            total = tf.maximum(tf.reduce_sum(weights), 1.0)
        counts = tf.math.unsorted_segment_sum(weights, tokens, self.vocabulary)
        return counts / total

    def factor_a(self, records, split_dim=None, masks=None):
        """``[V, 1, 1]``: A's diagonal, whatever ``split_dim`` (A is diagonal by structure)."""
        return tf.reshape(self.token_frequencies(records, masks), [self.vocabulary, 1, 1])

    def trace_a(self, records, masks=None):
        """``tr A`` = 1: every row is one-hot (masked or not)."""
        return tf.constant(1.0)
