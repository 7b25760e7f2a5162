"""The Kronecker block contract: what every layer type's block provides.

For a layer with (homogeneous) inputs ``ā`` and back-propagated output gradients ``g = dℓ/dz`` of the
per-example loss ``ℓ``, the Fisher block is approximated by ``A ⊗ G`` with

    A = mean over rows of ā āᵀ      [a_dim, a_dim]    (ā = [a, 1] when the bias is folded in)
    G = mean over rows of g gᵀ      [g_dim, g_dim]

Rows: Dense on ``[N, in]`` inputs has one row per example; Dense on ``[N, ..., in]`` and Conv2D
(im2col, KFC) have ``P`` rows per example (positions: ``Ho·Wo`` for Conv2D). For ``P > 1`` the
Fisher is ``P·(A ⊗ G)`` under KFC's assumptions, so the damping used per block is ``λ/P`` (split
as ``√(λ/P)`` per factor) and the preconditioned gradient is scaled by ``1/P``.

Orientation: Keras stores a Dense kernel as ``[in, out]`` and a Conv2D kernel as HWIO
``[kh, kw, Cin, Cout]``. The block's gradient matrix is ``[a_dim, g_dim]`` = kernel reshaped to
``[kh·kw·Cin, Cout]`` (``tf.image.extract_patches`` orders patch features as (kh, kw, Cin), the same
order) with the bias gradient appended as the last row. With row-major vec (``vec(M)[i·g_dim + j]
= M[i, j]``), a single example's gradient has ``vec(∇W) = ā ⊗ g``, so its Fisher block
``vec(∇W) vec(∇W)ᵀ`` equals ``kron(ā āᵀ, g gᵀ) = kron(A, G)``. The preconditioned gradient is
``(A + dI)⁻¹ · M · (G + dI)⁻¹`` (the transpose of DESIGN.md's out×in form).

All statistics are computed in float32 whatever the layer's compute dtype.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf.block_diagonal import split_layout
from thor_tf.split.plan import split_size


def block_gram(rows, split_dim=None, row_weights=None):
    """Diagonal blocks of ``rowsᵀ rows / R`` without forming the full ``[n, n]`` product.

    Args:
      rows: ``[R, n]`` float32.
      split_dim: block size ``d`` (None or >= n: one exact ``[1, n, n]`` block).
      row_weights: None, or ``[R]`` float32 0/1 weights: then ``Σ_valid rowᵀrow / Σ w`` (masked
        rows, e.g. padding tokens, count for nothing).

    Returns:
      ``[nb, d, d]`` with ``nb = ceil(n / d)``; the padding of the last block (columns past ``n``)
      is zero. Cost ``R·nb·d²`` multiply-adds instead of ``R·n²``.
    """
    n = int(rows.shape[-1])
    if row_weights is not None:
        rows = rows * row_weights[:, None]
        count = tf.maximum(tf.reduce_sum(row_weights), 1.0)
    else:
        count = tf.cast(tf.shape(rows)[0], rows.dtype)
    if split_dim is None or split_dim >= n:
        return (tf.matmul(rows, rows, transpose_a=True) / count)[None]
    if split_dim == 1:  # the diagonal: one reduction, not n products of 1×1 blocks
        return tf.reshape(tf.reduce_sum(tf.square(rows), axis=0) / count, [n, 1, 1])
    nb, _ = split_layout(n, split_dim)
    pad = nb * split_dim - n
    if pad:
        rows = tf.pad(rows, [[0, 0], [0, pad]])
    grouped = tf.reshape(rows, [-1, nb, split_dim])  # [R, nb, d]
    return tf.einsum("rbi,rbj->bij", grouped, grouped) / count


def row_count(t):
    """The number of rows of ``t`` ``[..., features]`` (float32 scalar): its size over its last
    axis (few ops when that axis is static)."""
    width = t.shape[-1]
    if width is None:
        return tf.cast(tf.reduce_prod(tf.shape(t)[:-1]), tf.float32)
    return tf.cast(tf.size(t), tf.float32) / float(width)


def positions_per_example(records, g_dim: int):
    """Rows per example ``P`` (float32 scalar) of a layer's calls ``records``: the size of ``z``
    over ``g_dim`` (features per row) and the batch size, summed over calls.

    One call whose ``z`` has static sizes past the batch axis (the usual case) gives a constant:
    no ops to trace at each use. Otherwise (several calls, whose batch sizes may differ, or dynamic
    sizes) ``P = Σ rows / N`` with ``N`` the first call's batch, from dynamic shapes.
    """
    shape = records[0].z.shape
    if len(records) == 1 and shape.rank is not None and None not in shape[1:]:
        per_example = 1
        for size in shape[1:]:
            per_example *= int(size)
        return tf.constant(per_example / g_dim, tf.float32)
    rows = tf.add_n([tf.cast(tf.size(r.z), tf.float32) for r in records]) / float(g_dim)
    return rows / tf.cast(tf.shape(records[0].z)[0], tf.float32)


def joined_row_weights(masks, per_call_rows):
    """``[Σ R_call]`` float32 row weights of several calls: each call's mask (``[R_call]``), or
    ones for a call without one (its rows all count)."""
    return tf.concat([tf.ones([tf.shape(rows)[0]], tf.float32) if mask is None else mask
                      for mask, rows in zip(masks, per_call_rows)], axis=0)


class KroneckerBlock:
    """Base class: shapes, gradient reshaping and factor statistics from captured rows.

    One subclass per layer type owns everything specific to it (registered with
    :func:`thor_tf.register_block`):

    * :meth:`unsupported_reason` (classmethod): why a layer of the type gets no block (shown in the
      registration table), None if it can have one;
    * :attr:`observe`: where the layer's own ``call`` produces ``z`` (``"activation"``: the
      argument of ``self.activation``; ``"output"``: the call's output; default: ``"activation"``
      when the layer has an ``activation``, else ``"output"``). The layer hooks observe ``z``
      there (:mod:`thor_tf.capture`); nothing of the layer's computation is replaced;
    * :meth:`pre_activation`: ``z`` computed from the recorded input and the layer's variables,
      as the layer's class computes it: used to check, once at wrap, that a subclass which
      overrides ``call`` still computes ``z`` that way (else it stays first order);
    * :meth:`input_rows` and :meth:`input_sq_norm_sum`: the rows of A and their cheap trace;
    * optionally :meth:`to_matrix` / :meth:`from_matrix` when the kernel is not ``[..., out]``
      with the contracted axes first.
    """

    kind = "kronecker"
    #: The layer attribute holding the block's weight matrix (``[..., out]``).
    kernel_attribute = "kernel"

    @classmethod
    def unsupported_reason(cls, layer):
        """Why ``layer`` cannot get this block (a short phrase), or None if it can.

        Structural reasons only: trainability can change between compiles and is decided per
        compile by the engine.
        """
        if not getattr(layer, "built", True) or getattr(layer, cls.kernel_attribute, None) is None:
            return "not built"
        if getattr(layer, "lora_enabled", False):
            return "LoRA enabled"
        policy = getattr(layer, "dtype_policy", None)
        if getattr(policy, "quantization_mode", None):
            return "quantized"
        return None

    def split_sizes(self, split_dim):
        """``(split of A, split of G)``: the diagonal block sizes this block's factors are stored
        and inverted in, for the model's ``split_dim`` (an int, or a
        :class:`~thor_tf.split.plan.SplitPlan`: a split per factor dimension). A block whose A is
        diagonal by structure (Embedding) returns 1 for A: V 1×1 blocks, O(V) memory and work."""
        return split_size(split_dim, self.a_dim), split_size(split_dim, self.g_dim)

    def pre_activation(self, inputs):
        """``z`` for one call of the layer on ``inputs`` (compute dtype), as the layer's class
        computes it (the wrap-time check of subclasses that override ``call``)."""
        raise NotImplementedError

    #: Where ``z`` is observed: ``"activation"``, ``"output"`` or None (chosen per layer: the
    #: activation when the layer has one, else the output).
    observe = None

    def observe_point(self):
        """:attr:`observe`, or the default for this layer: its activation if it has one."""
        if self.observe is not None:
            return self.observe
        return "activation" if callable(getattr(self.layer, "activation", None)) else "output"

    def accepts_call(self, args, kwargs):
        """Whether a call of the layer with these arguments is this block's (default: every
        call). A layer with two blocks (a tied embedding's lookup and its ``reverse=True``
        output projection) routes each call to the block that accepts it."""
        return True

    def companion_blocks(self):
        """Further blocks on the same layer (default none): a tied embedding's head, a LoRA
        layer's B side."""
        return []

    #: Another block on the same layer whose records this block reads (default None: the layer's
    #: calls are routed to it by :meth:`accepts_call`). A LoRA layer's B side reads its A side's:
    #: both see every call, the same input, ``z`` and ``dL/dz`` (:mod:`thor_tf.capture`).
    shares_records_of = None

    def matches(self, record):
        """Whether one observed call has the block's structure (static shapes only): ``z`` ends
        in ``g_dim`` features. A call that does not (e.g. a tied embedding used as the output
        head) leaves the layer first order for that step."""
        width = record.z.shape[-1] if record.z.shape.rank else None
        return width is None or int(width) == self.g_dim

    def __init__(self, name: str, layer):
        self.name = name
        self.layer = layer
        self.kernel = getattr(layer, self.kernel_attribute)
        # The bias is folded into A as the homogeneous coordinate when the layer has one.
        self.bias = getattr(layer, "bias", None)
        kernel_shape = tuple(int(s) for s in self.kernel.shape)
        self.kernel_shape = kernel_shape
        self.in_dim = 1
        for s in kernel_shape[:-1]:
            self.in_dim *= s
        self.g_dim = kernel_shape[-1]
        self.a_dim = self.in_dim + (1 if self.bias is not None else 0)

    # -- gradients <-> block matrix -------------------------------------------------------------
    def to_matrix(self, kernel_value, bias_value=None):
        """Kernel (and bias) tensors -> ``[a_dim, g_dim]`` float32 block matrix."""
        m = tf.reshape(tf.cast(kernel_value, tf.float32), [self.in_dim, self.g_dim])
        if self.bias is not None:
            b = tf.reshape(tf.cast(bias_value, tf.float32), [1, self.g_dim])
            m = tf.concat([m, b], axis=0)
        return m

    def from_matrix(self, matrix):
        """``[a_dim, g_dim]`` -> ``(kernel_shaped, bias_or_None)`` float32 tensors."""
        kernel = tf.reshape(matrix[: self.in_dim], self.kernel_shape)
        bias = matrix[self.in_dim] if self.bias is not None else None
        return kernel, bias

    # -- statistics -----------------------------------------------------------------------------
    def input_rows(self, inputs):
        """``[R, in_dim]`` float32 input rows of one call (patches for Conv2D)."""
        raise NotImplementedError

    def input_sq_norm_sum(self, inputs):
        """``(Σ_rows ||a||², R)`` without materializing rows (cheap trace of A)."""
        raise NotImplementedError

    @staticmethod
    def output_rows(g):
        """``[R, g_dim]`` float32 rows of an output-gradient tensor ``[..., g_dim]``."""
        width = g.shape[-1] if g.shape[-1] is not None else tf.shape(g)[-1]
        return tf.reshape(tf.cast(g, tf.float32), [-1, width])

    @property
    def mask_width(self):
        """Features of ``z`` per row of a loss mask (the engine's row masks have one weight per
        ``z.size / mask_width`` rows of a call): ``g_dim``, unless the block's G is not over
        ``z``'s last axis (a LoRA A side: G over the rank)."""
        return self.g_dim

    #: The block's rows per row of a loss mask (a LoRA B side under heads: positions × heads).
    mask_repeats = 1

    def positions(self, records):
        """Rows per example ``P`` (float32 scalar): ``Ho·Wo`` for Conv2D, 1 for plain Dense.

        Several calls of a shared layer add their rows, so ``P`` counts them all.
        """
        return positions_per_example(records, self.g_dim)

    def factor_a(self, records, split_dim=None, masks=None):
        """Diagonal blocks of ``A = mean_rows ā āᵀ``: ``[nb, d, d]`` float32 (see :func:`block_gram`).

        Only the blocks that the split inverse uses are computed: with ``split_dim < a_dim`` this
        costs ``nb·d²`` instead of ``a_dim²`` per row. ``split_dim=None`` gives the full factor as
        one block. ``masks``: None, or per record None / ``[R_call]`` 0/1 row weights (the mean is
        over the valid rows only: :func:`thor_tf.loss_terms.row_mask`).
        """
        per_call = [self.input_rows(r.inputs) for r in records]
        rows = tf.concat(per_call, axis=0)
        if self.bias is not None:
            rows = tf.concat([rows, tf.ones_like(rows[:, :1])], axis=1)
        return block_gram(rows, None if split_dim is None else self.split_sizes(split_dim)[0],
                          joined_row_weights(masks, per_call) if masks is not None else None)

    def factor_g(self, output_grads, split_dim=None, masks=None):
        """Diagonal blocks of ``G = mean_rows g gᵀ`` (``output_grads`` already per-term)."""
        per_call = [self.output_rows(g) for g in output_grads]
        rows = tf.concat(per_call, axis=0)
        return block_gram(rows, None if split_dim is None else self.split_sizes(split_dim)[1],
                          joined_row_weights(masks, per_call) if masks is not None else None)

    def trace_a(self, records, masks=None):
        """``tr(A)`` = mean squared norm of the homogeneous input rows, without forming A (over
        the valid rows when ``masks`` is given: see :meth:`factor_a`)."""
        if masks is not None:
            per_call = [self.input_rows(r.inputs) for r in records]
            weights = joined_row_weights(masks, per_call)
            norms = tf.reduce_sum(tf.square(tf.concat(per_call, axis=0)), axis=-1)
            trace = tf.reduce_sum(norms * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
            return trace + (1.0 if self.bias is not None else 0.0)
        sums, counts = zip(*[self.input_sq_norm_sum(r.inputs) for r in records])
        trace = tf.add_n(list(sums)) / tf.add_n(list(counts))
        return trace + (1.0 if self.bias is not None else 0.0)

    def trace_g(self, output_grads, masks=None):
        """``tr(G)`` = mean squared norm of the output-gradient rows (valid rows with ``masks``)."""
        if masks is not None:
            per_call = [self.output_rows(g) for g in output_grads]
            weights = joined_row_weights(masks, per_call)
            norms = tf.reduce_sum(tf.square(tf.concat(per_call, axis=0)), axis=-1)
            return tf.reduce_sum(norms * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
        total = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in output_grads])
        return total / tf.add_n([row_count(g) for g in output_grads])

    def factor_signature(self):
        """A hashable description of everything but the data that ``factor_a``/``factor_g``
        depend on, or None. Layers whose blocks have equal signatures and whose inputs have the
        same shapes compute their factors with the same graph, which the engine then traces once
        for all of them (a ResNet's repeated convolutions). None (the default, e.g. for blocks
        registered by users): the block's factors are always traced on their own."""
        return None

    def describe(self):
        return {"name": self.name, "kind": self.kind, "a_dim": self.a_dim, "g_dim": self.g_dim}


