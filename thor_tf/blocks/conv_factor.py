"""Conv2D's A factor (KFC) from shifted views of the input, without the im2col patch matrix.

Conventions (those of :func:`thor_tf.blocks.base.block_gram` on im2col rows): a patch's features
are ordered (kh, kw, Cin), as ``tf.image.extract_patches`` orders them, so feature
``f = (i·kw + j)·Cin + c`` is channel ``c`` at kernel offset ``(i, j)``; with a bias the
homogeneous coordinate 1 is feature ``in_dim = kh·kw·Cin``, the last one. ``A = mean over
rows ā āᵀ`` over the ``R = N·Ho·Wo`` output positions of every call; only its diagonal blocks of
size ``d`` (``split_dim``) are needed: ``[nb, d, d]``, the last block zero-padded past ``a_dim``,
blocks cut at multiples of ``d`` whatever the offset boundaries.

Why it is cheaper: the ``Cin×Cin`` block of A between kernel offsets ``p`` and ``q`` is
``Σ_{n,o} x[n, s·o + r·p] x[n, s·o + r·q]ᵀ`` (``s`` stride, ``r`` dilation, ``x`` padded), the
product of two strided views of the padded input, each ``[R, Cin]``. So:

* a diagonal block of A is assembled from *segments* (one kernel offset and a range of channels,
  or the bias), each sliced straight from the padded input (:func:`shifted_view`); only products
  of segments inside the same block are formed, and one block's segments are sliced after the
  previous block's Gram is done, so at most one block's columns (``R × d``) are alive instead of
  the whole ``[R, a_dim]`` patch matrix (plus, on the im2col path, its copies with the ones column
  and the padding);
* A is symmetric, so with "pairs" only the products of segment pairs ``(u, v)`` with ``u <= v``
  are multiplied (the others are transposes): about half the multiply-adds of a block's Gram, and
  the bias row of A is the mean of each segment (a column sum), the corner 1: no ones column;
* for few input channels many small products cost more than they save, and "concat" computes a
  block's Gram as one matmul of its concatenated segments (``PAIRWISE_MIN_CHANNELS``).

Exact: the same sums as im2col in a different order (float32 rounding only). Statistics are
float32 whatever the input dtype. Works on dynamic batch and spatial sizes.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from thor_tf.block_diagonal import split_layout


class Geometry(NamedTuple):
    """A 2-D convolution's window: kernel ``(kh, kw)``, ``strides``, ``dilations`` (2-tuples of
    ints) and ``padding`` ("SAME" or "VALID", TensorFlow's meaning)."""

    kernel: Tuple[int, int]
    strides: Tuple[int, int]
    dilations: Tuple[int, int]
    padding: str


class Segment(NamedTuple):
    """Consecutive features of one diagonal block: channels ``[c0, c1)`` of kernel offset
    ``offset`` (row-major index into ``kh·kw``), or the bias when ``offset`` is None."""

    offset: Optional[int]
    c0: int
    c1: int

    @property
    def width(self):
        return self.c1 - self.c0


def _size(x, axis):
    """Static size of ``x``'s ``axis`` when known, else the dynamic one (a scalar int32 tensor)."""
    static = x.shape[axis]
    return int(static) if static is not None else tf.shape(x)[axis]


def _out_and_pad(size, kernel, stride, dilation, padding):
    """``(output size, padding before, padding after)`` along one axis, TensorFlow's rule:
    SAME gives ``ceil(size / stride)`` outputs and puts the odd padding element after."""
    extent = (kernel - 1) * dilation + 1
    if padding == "VALID":
        return (size - extent) // stride + 1, 0, 0
    out = -(-size // stride)
    total = (out - 1) * stride + extent - size
    total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
    return out, total // 2, total - total // 2


def padded_input(x, geometry: Geometry):
    """``(x padded as the window needs, Ho, Wo)``: SAME adds TensorFlow's padding, VALID none.

    Args:
      x: ``[N, H, W, Cin]`` float32. ``Ho``, ``Wo`` are ints when ``H``, ``W`` are static.
    """
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.strides, geometry.dilations
    ho, top, bottom = _out_and_pad(_size(x, 1), kh, sh, dh, geometry.padding)
    wo, left, right = _out_and_pad(_size(x, 2), kw, sw, dw, geometry.padding)
    if geometry.padding == "SAME":
        x = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
    return x, ho, wo


def shifted_view(xp, ho, wo, geometry: Geometry, segment: Segment):
    """One segment's columns of the im2col matrix, sliced straight from the padded input.

    Args:
      xp, ho, wo: from :func:`padded_input`.
      segment: kernel offset ``i·kw + j`` and channel range ``[c0, c1)`` (not the bias).

    Returns:
      ``[N·Ho·Wo, c1 − c0]``: for every example and output position ``o`` (row-major), channels
      ``c0..c1`` of the input pixel that kernel offset ``(i, j)`` multiplies (zero in the padding).
    """
    (_, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.strides, geometry.dilations
    i, j = divmod(segment.offset, kw)
    view = xp[:, i * dh: i * dh + (ho - 1) * sh + 1: sh,
              j * dw: j * dw + (wo - 1) * sw + 1: sw, segment.c0: segment.c1]
    return tf.reshape(view, [-1, segment.width])


def block_segments(cin: int, offsets: int, has_bias: bool, split: int) -> List[List[Segment]]:
    """The features of each diagonal block of size ``split`` as segments (offset, channel range or
    the bias), in feature order. A block may straddle offsets (``split`` not a multiple of
    ``cin``); the last block ends at ``a_dim`` (its padding is not a segment)."""
    a_dim = offsets * cin + (1 if has_bias else 0)
    nb, d = split_layout(a_dim, split)
    blocks = []
    for b in range(nb):
        lo, hi = b * d, min((b + 1) * d, a_dim)
        segments, f = [], lo
        while f < hi:
            if f == offsets * cin:  # the homogeneous coordinate
                segments.append(Segment(None, 0, 1))
                f += 1
                continue
            offset, c0 = divmod(f, cin)
            c1 = min(cin, c0 + hi - f)
            segments.append(Segment(offset, c0, c1))
            f += c1 - c0
        blocks.append(segments)
    return blocks


def _segment_products(columns: Sequence, count):
    """Unnormalized Gram ``[w, w]`` of the side-by-side segment columns, from the products of
    pairs ``u <= v`` only (A is symmetric).

    Args:
      columns: per segment, ``[R, w_u]`` float32, or None for the bias (a column of ones).
      count: ``R`` (float32 scalar), the bias-bias entry.
    """
    k = len(columns)
    sums = [None if c is None else tf.reduce_sum(c, axis=0, keepdims=True) for c in columns]
    grid = [[None] * k for _ in range(k)]
    for u in range(k):
        for v in range(u, k):
            cu, cv = columns[u], columns[v]
            if cu is None and cv is None:
                piece = tf.reshape(count, [1, 1])
            elif cu is None:
                piece = sums[v]
            elif cv is None:
                piece = tf.transpose(sums[u])
            else:
                piece = tf.matmul(cu, cv, transpose_a=True)
            grid[u][v] = piece
            if v > u:
                grid[v][u] = tf.transpose(piece)
    return tf.concat([tf.concat(row, axis=1) for row in grid], axis=0)


def _concatenated_gram(columns: Sequence, count):
    """Unnormalized Gram ``[w, w]`` of the side-by-side segment columns by one matmul of their
    concatenation (the bias as a ones column): the faster way when segments are narrow (few
    channels), where many small products cost more than the doubled multiply-adds."""
    views = [c for c in columns if c is not None]
    if not views:  # a block holding only the bias
        return tf.reshape(count, [1, 1])
    ones = tf.ones_like(views[0][:, :1]) if len(views) < len(columns) else None
    rows = [ones if c is None else c for c in columns]
    rows = tf.concat(rows, axis=1) if len(rows) > 1 else rows[0]
    return tf.matmul(rows, rows, transpose_a=True)


#: Below this many input channels a block's Gram is one matmul of its concatenated columns; from
#: it, products of segment pairs (half the work by symmetry, more and smaller matmuls). Measured
#: on a 2-core CPU, 3x3 kernel, split 128, batch 128 at 28x28: 1, 4 and 8 channels favour the
#: concatenation (by 15-40%), 16 is even, 32 (14x14) and 64 (8x8) favour the pairs by 30%+. At
#: 16, even at run time, the concatenation wins on graph size (one matmul per block instead of
#: ``k(k+1)/2`` products and ``k(k-1)/2`` transposes for ``k`` segments): less to trace.
PAIRWISE_MIN_CHANNELS = 32

STRATEGIES = ("auto", "pairs", "concat")


def conv_gram_sums(x, geometry: Geometry, has_bias: bool, split: int, strategy: str = "auto"):
    """Unnormalized diagonal blocks ``Σ_rows ā āᵀ`` of one call and its row count.

    Args:
      x: ``[N, H, W, Cin]`` (any float dtype; cast to float32).
      split: block size ``d``; ``>= a_dim`` gives one exact ``[a_dim, a_dim]`` block.
      strategy: "pairs" (:func:`_segment_products`), "concat" (:func:`_concatenated_gram`) or
        "auto" (pairs from :data:`PAIRWISE_MIN_CHANNELS` input channels on).

    Returns:
      ``([nb, d, d] float32, R float32)``; the padding past ``a_dim`` is zero.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}.")
    x = tf.cast(x, tf.float32)
    cin = int(x.shape[-1])
    if strategy == "auto":
        strategy = "pairs" if cin >= PAIRWISE_MIN_CHANNELS else "concat"
    gram_of = _segment_products if strategy == "pairs" else _concatenated_gram
    offsets = geometry.kernel[0] * geometry.kernel[1]
    a_dim = offsets * cin + (1 if has_bias else 0)
    nb, d = split_layout(a_dim, split)
    if d == 1 and a_dim > 1:
        return conv_diagonal_sums(x, geometry, has_bias)
    xp, ho, wo = padded_input(x, geometry)
    count = tf.cast(tf.shape(xp)[0] * ho * wo, tf.float32)
    blocks = []
    for segments in block_segments(cin, offsets, has_bias, split):
        # Each block slices its own views after the previous block is done (a control
        # dependency in graphs): at most one block's columns are alive, not the whole im2col.
        with tf.control_dependencies(blocks[-1:]):
            columns = [None if s.offset is None else shifted_view(xp, ho, wo, geometry, s)
                       for s in segments]
            gram = gram_of(columns, count)
        pad = d - sum(s.width for s in segments)
        blocks.append(tf.pad(gram, [[0, pad], [0, pad]]) if pad else gram)
    return tf.stack(blocks), count


def conv_diagonal_sums(x, geometry: Geometry, has_bias: bool):
    """:func:`conv_gram_sums` at split 1: A's diagonal ``Σ_rows ā²`` as ``[a_dim, 1, 1]`` blocks,
    and the row count.

    Entry ``(i·kw + j)·Cin + c`` sums ``x[n, s·o + r·(i, j), c]²`` over examples and output
    positions: the squared input summed over the batch, then its patches (one
    ``extract_patches`` of a ``[1, H, W, Cin]`` image, TensorFlow's padding and feature order)
    summed over the output positions; the bias entry is the row count. A handful of ops whatever
    ``a_dim`` (the per-block loop would be ~13 ops per 1×1 block: ResNet-50's 4,609-wide A, 60k).
    """
    (kh, kw), strides, rates = geometry.kernel, geometry.strides, geometry.dilations
    energy = tf.reduce_sum(tf.square(x), axis=0, keepdims=True)  # [1, H, W, Cin]
    patches = tf.image.extract_patches(energy, sizes=[1, kh, kw, 1],
                                       strides=[1, *strides, 1], rates=[1, *rates, 1],
                                       padding=geometry.padding)  # [1, Ho, Wo, kh·kw·Cin]
    diagonal = tf.reduce_sum(patches, axis=[0, 1, 2])
    count = tf.cast(tf.shape(x)[0] * tf.shape(patches)[1] * tf.shape(patches)[2], tf.float32)
    if has_bias:
        diagonal = tf.concat([diagonal, tf.reshape(count, [1])], axis=0)
    return tf.reshape(diagonal, [-1, 1, 1]), count


def conv_factor_a(images: Sequence, geometry: Geometry, has_bias: bool, split_dim=None,
                  strategy: str = "auto"):
    """Diagonal blocks of ``A = mean_rows ā āᵀ`` over all calls' positions: ``[nb, d, d]`` float32.

    Args:
      images: one ``[N, H, W, Cin]`` input per call of the layer (sizes may differ between calls).
      split_dim: block size (None: the full factor as one block), as :func:`block_gram`.
      strategy: see :func:`conv_gram_sums`.
    """
    cin = int(images[0].shape[-1])
    a_dim = geometry.kernel[0] * geometry.kernel[1] * cin + (1 if has_bias else 0)
    split = a_dim if split_dim is None else split_dim
    sums, counts = zip(*[conv_gram_sums(x, geometry, has_bias, split, strategy) for x in images])
    return tf.add_n(list(sums)) / tf.add_n(list(counts))
