"""Block algebra on *vecs* and *mats* of tensors (pure TensorFlow, no Keras).

This module implements the small "vec / mat / eye" algebra used by the
THOR / K-FAC optimizer to express preconditioning as block-matrix algebra
over the model variables, **without ever flattening** the variables into one
long vector (which would destroy the per-variable parallelism and the block
structure).

Conventions
-----------
vec
    A Python ``list``/``tuple`` of tensors ``[X_0, ..., X_{n-1}]`` in a fixed
    order (e.g. a model's gradients, one tensor per trainable variable).
    Entry ``X_i`` may have any shape ``shape(X_i)``.

mat
    A Python list of rows; every row is a list of the same length ``n`` as the
    vec it acts on.  Entry ``M[i][j]`` is one of

    * a dense *operator tensor* of shape ``shape(X_i) + shape(X_j)``:
      output indices first, then input indices (``T^{uvw}_{ijk}`` is stored
      as ``T[i, j, k, u, v, w]`` where ``ijk`` index the output and ``uvw``
      the input);
    * ``None``: a structural zero block.  It is never stored and every
      product simply skips it;
    * a *lazy operator* object (:class:`KroneckerOperator`,
      :class:`BlockDiagonal`, or any object with ``apply_right(y)`` and
      ``to_dense()`` and optionally ``compose(other)``) standing for a dense
      operator tensor that is never materialised.

eye
    ``eye(shape)`` is the identity operator on tensors of shape ``shape``:
    a dense tensor of shape ``shape + shape`` with
    ``T[i.., u..] = prod_k delta(i_k, u_k)``.

Products
--------
* :func:`tensor_prod` -- outer product, ``U_{ijk} (x) V^{uvw} = T^{uvw}_{ijk}``
  (shape ``x.shape + y.shape``).
* :func:`tensor_transuvection` -- contraction ("transvection") in one of three
  modes: ``"all"`` (full contraction to a scalar), ``"right"`` (operator
  applied to a tensor: ``U^{uvw}_{ijk} . V_{uvw} = T_{ijk}``) and ``"auto"``
  (operator composition, contracting trailing axes of ``x`` with leading axes
  of ``y``).
* :func:`vec_outer_prod`, :func:`vec_inner_prod`, :func:`mat_vec_prod`,
  :func:`mat_mat_prod`, :func:`block_diagonal_mat` lift those to vecs/mats.

Lazy operators
--------------
* :class:`BlockDiagonal` -- a (symmetric) ``[n, n]`` matrix stored only as
  its diagonal blocks ``[nb, d, d]`` (last block possibly padded).
* :class:`KroneckerOperator` -- the map ``X -> scale * left @ X @ right`` on
  ``[p, q]`` matrices, i.e. the 4-tensor ``T[i, j, u, v] = left[i, u] *
  right[v, j]``; with row-major ``vec``,
  ``vec(left @ X @ right) = kron(left, right^T) @ vec(X)``.

Everything works in float32 and float64 (dtype follows the inputs) and inside
``tf.function`` (also with XLA ``jit_compile``): all branching is on *static*
shapes / Python objects, never on tensor values.  Tensors must have a
statically known rank (dimensions may be unknown, then shape checks for those
dimensions are left to TensorFlow at run time).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = [
    "MODES",
    "eye",
    "is_operator",
    "tensor_prod",
    "tensor_transuvection",
    "vec_outer_prod",
    "vec_inner_prod",
    "mat_vec_prod",
    "mat_mat_prod",
    "block_diagonal_mat",
    "BlockDiagonal",
    "split_layout",
    "diagonal_blocks",
    "KroneckerOperator",
]

#: Allowed values of the ``mode`` argument of the contraction functions.
MODES = ("all", "right", "auto")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def is_operator(obj: Any) -> bool:
    """True if ``obj`` is a lazy operator (has ``apply_right`` and ``to_dense``).

    Dense tensors, variables, numpy arrays and ``None`` are *not* operators.
    """
    return (
        obj is not None
        and callable(getattr(obj, "apply_right", None))
        and callable(getattr(obj, "to_dense", None))
    )


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(
            f"Invalid mode={mode!r}; `mode` must be one of {', '.join(repr(m) for m in MODES)}."
        )


def _as_tensor(x, dtype=None) -> tf.Tensor:
    if isinstance(x, tf.Tensor) and (dtype is None or x.dtype == dtype):
        return x
    return tf.convert_to_tensor(x, dtype=dtype)


def _dims(t: tf.Tensor, what: str) -> List[Optional[int]]:
    """Static dims of ``t`` (entries may be None); the rank must be known."""
    shape = t.shape
    if shape.rank is None:
        raise ValueError(f"{what} must have a statically known rank, got shape {shape}.")
    return shape.as_list()


def _dims_compatible(a: Sequence[Optional[int]], b: Sequence[Optional[int]]) -> bool:
    if len(a) != len(b):
        return False
    return all(x is None or y is None or x == y for x, y in zip(a, b))


def _static_rank(obj) -> Optional[int]:
    shape = getattr(obj, "shape", None)
    if shape is None:
        return None
    shape = tf.TensorShape(shape)
    return shape.rank


def _square_half_rank(obj) -> Optional[int]:
    """len(T) if ``obj`` is a (static) square operator of shape T + T, else None."""
    if obj is None:
        return None
    shape = getattr(obj, "shape", None)
    if shape is None:
        return None
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank % 2:
        return None
    h = shape.rank // 2
    dims = shape.as_list()
    if _dims_compatible(dims[:h], dims[h:]):
        return h
    return None


def _densify(x):
    return x.to_dense() if is_operator(x) else _as_tensor(x)


def _sum_terms(terms: list):
    """Sum a non-empty list of tensors / lazy operators.

    A single term is returned as is (so a lazy operator stays lazy); several
    terms are densified where necessary and added with ``tf.add_n``.
    """
    if len(terms) == 1:
        return terms[0]
    dense = [_densify(t) for t in terms]
    return tf.add_n(dense)


# ---------------------------------------------------------------------------
# eye and tensor-level products
# ---------------------------------------------------------------------------
def eye(shape, dtype=tf.float32) -> tf.Tensor:
    """Identity operator on tensors of shape ``shape``.

    Args:
      shape: int, tuple/list of ints or ``tf.TensorShape`` (fully defined),
        the shape ``S`` of the tensors the operator acts on.
      dtype: dtype of the result (default ``tf.float32``).

    Returns:
      Dense tensor ``T`` of shape ``S + S`` with
      ``T[i_1..i_r, u_1..u_r] = prod_k delta(i_k, u_k)``; for ``S = ()`` the
      scalar ``1``.
    """
    if isinstance(shape, int):
        shape = (shape,)
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        raise ValueError(f"eye() needs a fully defined shape, got {shape}.")
    dims = shape.as_list()
    n = math.prod(dims)
    return tf.reshape(tf.eye(n, dtype=dtype), dims + dims)


def tensor_prod(x, y) -> tf.Tensor:
    """Outer (tensor) product ``U_{ijk} (x) V^{uvw} = T^{uvw}_{ijk}``.

    Args:
      x: tensor of shape ``S``.
      y: tensor of shape ``R`` (same dtype as ``x``).

    Returns:
      Tensor of shape ``S + R`` with ``T[s.., r..] = x[s..] * y[r..]``.
    """
    x = _densify(x)
    y = _densify(y)
    xd = _dims(x, "x")
    yd = _dims(y, "y")
    # Broadcasting product: x[..., 1, ..., 1] * y  (no tensordot reshapes).
    xr = tf.reshape(x, tf.concat([tf.shape(x), tf.ones([len(yd)], tf.int32)], 0))
    out = xr * y
    return tf.ensure_shape(out, xd + yd)


def tensor_transuvection(x, y, mode: str = "all", axes: Optional[int] = None):
    """Contraction (transvection) of ``x`` with ``y``.

    Modes:

    * ``"all"``: ``x`` and ``y`` have the same shape ``S``; returns the scalar
      ``sum(x * y)``.
    * ``"right"``: ``x`` has shape ``S + T`` and ``y`` shape ``T``; contracts
      the trailing ``y.ndim`` axes of ``x`` with all of ``y`` and returns shape
      ``S`` (``U^{uvw}_{ijk} . V_{uvw} = T_{ijk}``: operator applied to a
      tensor).
    * ``"auto"``: ``x`` has shape ``S + T`` and ``y`` shape ``T + R``;
      contracts the trailing ``axes`` axes of ``x`` with the leading ``axes``
      axes of ``y`` and returns shape ``S + R`` (operator composition).
      ``axes`` defaults to ``x.ndim // 2`` (operator convention: the input
      half of ``x``).

    ``axes`` is only used in mode ``"auto"``.

    Lazy operators: if ``x`` is a lazy operator (see :func:`is_operator`),
    mode ``"right"`` returns ``x.apply_right(y)``; mode ``"auto"`` with a lazy
    ``y`` of the same class returns ``x.compose(y)`` (when available), and
    otherwise falls back to the dense ``x.to_dense()``; mode ``"all"`` uses
    ``x.to_dense()``.  A lazy ``y`` that cannot be handled lazily is
    densified.

    Returns:
      Scalar tensor (``"all"``), tensor of shape ``S`` (``"right"``), tensor
      of shape ``S + R`` or a lazy operator (``"auto"``).

    Raises:
      ValueError: on an unknown ``mode`` or incompatible static shapes.
    """
    _check_mode(mode)
    if x is None or y is None:
        raise ValueError("tensor_transuvection() got None; None blocks must be skipped by the caller.")

    if is_operator(x):
        if mode == "right" and not is_operator(y):
            return x.apply_right(_as_tensor(y))
        if mode == "auto" and is_operator(y):
            compose = getattr(x, "compose", None)
            rank = _static_rank(x)
            if (
                type(x) is type(y)
                and callable(compose)
                and (axes is None or rank is None or int(axes) == rank // 2)
            ):
                return compose(y)
        x = x.to_dense()
    if is_operator(y):
        y = y.to_dense()

    x = _as_tensor(x)
    y = _as_tensor(y)
    xd = _dims(x, "x")
    yd = _dims(y, "y")

    if mode == "all":
        if not _dims_compatible(xd, yd):
            raise ValueError(
                f"tensor_transuvection(mode='all') needs equal shapes, got {x.shape} and {y.shape}."
            )
        return tf.reduce_sum(x * y)

    if mode == "right":
        k = len(yd)
        if k > len(xd) or not _dims_compatible(xd[len(xd) - k:], yd):
            raise ValueError(
                "tensor_transuvection(mode='right') needs x.shape = S + y.shape, "
                f"got x.shape={x.shape}, y.shape={y.shape}."
            )
        if k == 0:
            return x * y
        return tf.tensordot(x, y, axes=[list(range(len(xd) - k, len(xd))), list(range(k))])

    # mode == "auto"
    k = len(xd) // 2 if axes is None else int(axes)
    if k < 0 or k > len(xd) or k > len(yd):
        raise ValueError(
            f"tensor_transuvection(mode='auto'): invalid axes={k} for x.shape={x.shape}, "
            f"y.shape={y.shape}."
        )
    if not _dims_compatible(xd[len(xd) - k:], yd[:k]):
        raise ValueError(
            "tensor_transuvection(mode='auto'): trailing axes of x must match leading axes "
            f"of y; got x.shape={x.shape}, y.shape={y.shape}, axes={k}."
        )
    if k == 0:
        return tensor_prod(x, y)
    return tf.tensordot(x, y, axes=k)


# ---------------------------------------------------------------------------
# vec / mat level
# ---------------------------------------------------------------------------
def vec_outer_prod(xs: Sequence, ys: Sequence) -> List[list]:
    """Outer product of two vecs.

    Args:
      xs: vec ``[X_0, ..., X_{n-1}]``.
      ys: vec ``[Y_0, ..., Y_{m-1}]``.

    Returns:
      mat (``n`` rows of ``m`` entries) with
      ``M[i][j] = tensor_prod(X_i, Y_j)`` of shape ``shape(X_i) + shape(Y_j)``;
      an entry is ``None`` when ``X_i`` or ``Y_j`` is ``None``.
    """
    return [
        [None if (x is None or y is None) else tensor_prod(x, y) for y in ys]
        for x in xs
    ]


def vec_inner_prod(xs: Sequence, ys: Sequence, mode: str = "all"):
    """Inner product ``sum_i tensor_transuvection(X_i, Y_i, mode)``.

    Args:
      xs: vec (or a mat row) ``[X_0, ..., X_{n-1}]``; ``None`` entries are
        structural zeros and are skipped.
      ys: vec ``[Y_0, ..., Y_{n-1}]`` of the same length (``None`` entries are
        skipped as well).
      mode: ``"all"``, ``"right"`` or ``"auto"`` (see
        :func:`tensor_transuvection`).

    Returns:
      A scalar (``"all"``), a tensor of the common shape of the terms
      (``"right"``/``"auto"``) or, for a single lazy ``"auto"`` term, a lazy
      operator.

    Raises:
      ValueError: bad ``mode``, different lengths, or every term skipped.
    """
    _check_mode(mode)
    if len(xs) != len(ys):
        raise ValueError(f"vec_inner_prod: length mismatch, {len(xs)} vs {len(ys)}.")
    terms = [
        tensor_transuvection(x, y, mode)
        for x, y in zip(xs, ys)
        if x is not None and y is not None
    ]
    if not terms:
        raise ValueError(
            "vec_inner_prod: every term is None (structural zero); cannot infer the result shape."
        )
    return _sum_terms(terms)


def mat_vec_prod(ms: Sequence[Sequence], xs: Sequence, mode: str = "right") -> list:
    """Matrix-vector product ``[vec_inner_prod(row_i, xs, mode) for row_i in ms]``.

    Args:
      ms: mat with rows of length ``len(xs)``; entry ``M[i][j]`` of shape
        ``shape(Y_i) + shape(X_j)``, ``None`` or a lazy operator.
      xs: vec ``[X_0, ..., X_{n-1}]``.
      mode: contraction mode, default ``"right"`` (operator applied to a
        tensor).

    Returns:
      vec ``[Y_0, ..., Y_{m-1}]`` with ``Y_i = sum_j M[i][j] . X_j``.

    Raises:
      ValueError: bad ``mode``, row length mismatch, or a row whose every
      block is ``None``.
    """
    _check_mode(mode)
    out = []
    for i, row in enumerate(ms):
        if len(row) != len(xs):
            raise ValueError(f"mat_vec_prod: row {i} has {len(row)} entries, vec has {len(xs)}.")
        if all(m is None for m in row):
            raise ValueError(f"mat_vec_prod: row {i} has only None blocks; cannot infer its shape.")
        out.append(vec_inner_prod(row, xs, mode))
    return out


def mat_mat_prod(
    mxs: Sequence[Sequence], mys: Sequence[Sequence], mode: str = "auto", axes=None
) -> List[list]:
    """Matrix-matrix product of two mats.

    ``result[i][j] = sum_k tensor_transuvection(MX[i][k], MY[k][j], mode, axes_k)``;
    terms where either factor is ``None`` are skipped and an entry whose every
    term is skipped stays ``None``.  A single lazy-operator term (e.g. the
    composition of two :class:`KroneckerOperator`) stays lazy; several terms
    are densified and added.

    Number of contracted axes ``axes_k = len(T_k)`` for the inner index ``k``
    (only used in mode ``"auto"``): ``axes`` may be an int (same for every
    ``k``) or a sequence with one int (or ``None``) per ``k``.  When not given,
    it is inferred from a square diagonal block ``MY[k][k]`` or ``MX[k][k]``
    (shape ``T_k + T_k``), and otherwise falls back to the
    :func:`tensor_transuvection` default ``x.ndim // 2`` -- which is right for
    square mats acting on one vec, but pass ``axes`` explicitly for
    rectangular blocks between variables of different ranks without a
    diagonal to infer from.

    Args:
      mxs: mat with ``n`` rows of ``K`` entries, ``MX[i][k]`` of shape
        ``S_i + T_k``.
      mys: mat with ``K`` rows of ``m`` entries, ``MY[k][j]`` of shape
        ``T_k + R_j``.
      mode: contraction mode, default ``"auto"``.
      axes: ``None``, int, or a length-``K`` sequence (see above).

    Returns:
      mat with ``n`` rows of ``m`` entries, entry of shape ``S_i + R_j``.
    """
    _check_mode(mode)
    K = len(mys)
    m = len(mys[0]) if K else 0
    for k, row in enumerate(mys):
        if len(row) != m:
            raise ValueError(f"mat_mat_prod: row {k} of the right mat has {len(row)} entries, expected {m}.")
    for i, row in enumerate(mxs):
        if len(row) != K:
            raise ValueError(
                f"mat_mat_prod: row {i} of the left mat has {len(row)} entries, right mat has {K} rows."
            )

    if mode != "auto":
        ks = [None] * K
    elif axes is None:
        ks = []
        for k in range(K):
            h = _square_half_rank(mys[k][k]) if k < m else None
            if h is None and k < len(mxs):
                h = _square_half_rank(mxs[k][k])
            ks.append(h)
    elif isinstance(axes, int):
        ks = [axes] * K
    else:
        ks = list(axes)
        if len(ks) != K:
            raise ValueError(f"mat_mat_prod: axes has {len(ks)} entries, expected {K}.")

    out = []
    for row in mxs:
        out_row = []
        for j in range(m):
            terms = [
                tensor_transuvection(row[k], mys[k][j], mode, ks[k])
                for k in range(K)
                if row[k] is not None and mys[k][j] is not None
            ]
            out_row.append(_sum_terms(terms) if terms else None)
        out.append(out_row)
    return out


def block_diagonal_mat(blocks: Sequence) -> List[list]:
    """Block-diagonal mat with ``blocks[i]`` on the diagonal.

    Args:
      blocks: sequence of ``n`` operators (dense operator tensors of shape
        ``shape(X_i) + shape(X_i)``, lazy operators, or ``None``).

    Returns:
      ``n x n`` mat with ``M[i][i] = blocks[i]`` and ``None`` (never stored)
      off the diagonal.
    """
    n = len(blocks)
    return [[blocks[i] if i == j else None for j in range(n)] for i in range(n)]


# ---------------------------------------------------------------------------
# Lazy operators
# ---------------------------------------------------------------------------
def split_layout(dim: int, split_dim: int) -> Tuple[int, int]:
    """``(num_blocks, block_size)`` for a ``dim``-sized matrix cut into diagonal blocks of
    ``split_dim``: ``ceil(dim / split_dim)`` blocks, the last one padded. ``split_dim >= dim``
    gives one exact block of size ``dim``. The one place this arithmetic lives."""
    if split_dim <= 0:
        raise ValueError(f"split_dim must be positive; got {split_dim}.")
    if split_dim >= dim:
        return 1, dim
    return -(-dim // split_dim), split_dim


def diagonal_blocks(matrix, block_size: int):
    """``[nb, d, d]`` diagonal blocks of a dense ``[n, n]`` matrix, the last one zero-padded.

    The layout of :func:`split_layout`. Works on a tensor (returns a tensor) or a NumPy array
    (returns an array of its dtype); vectorised, no Python loop over blocks. The one place that
    cuts diagonal blocks out of a dense matrix (training never does: it computes the blocks
    directly, :func:`thor_tf.blocks.block_gram`).
    """
    is_numpy = isinstance(matrix, np.ndarray)
    matrix = tf.convert_to_tensor(matrix)
    n = int(matrix.shape[-1])
    nb, d = split_layout(n, int(block_size))
    pad = nb * d - n
    if pad:
        matrix = tf.pad(matrix, [[0, pad], [0, pad]])
    m4 = tf.transpose(tf.reshape(matrix, [nb, d, nb, d]), [0, 2, 1, 3])  # [nb, nb, d, d]
    r = tf.range(nb)
    blocks = tf.gather_nd(m4, tf.stack([r, r], axis=1))
    return blocks.numpy() if is_numpy else blocks


class BlockDiagonal:
    """An ``[n, n]`` matrix stored only as its diagonal blocks.

    ``blocks`` has shape ``[nb, d, d]`` with ``nb = ceil(n / d)``; block ``b``
    covers rows/columns ``b*d : (b+1)*d``.  The last block may be padded
    (``nb * d > n``): only its top-left part up to ``n`` is meaningful, the
    padding rows/columns are ignored by every product (:meth:`from_dense` fills
    the padding with the identity so the blocks stay invertible).

    As an operator tensor (for use as a mat entry acting on vectors of shape
    ``[n]``) it is ``T[i, u] = B[i, u]``.  The matrix is normally symmetric
    (a curvature factor), but :meth:`matmul`/:meth:`rmatmul` do not assume it.

    Args:
      blocks: tensor ``[nb, d, d]`` with static ``nb`` and ``d``.
      dim: Python int ``n`` with ``(nb - 1) * d < n <= nb * d``.
    """

    def __init__(self, blocks, dim: int):
        blocks = _as_tensor(blocks)
        shape = blocks.shape
        if shape.rank != 3 or shape[1] is None or shape[0] is None or shape[1] != shape[2]:
            raise ValueError(f"BlockDiagonal: blocks must have static shape [nb, d, d], got {shape}.")
        nb, d = int(shape[0]), int(shape[1])
        dim = int(dim)
        if not (dim > 0 and (nb - 1) * d < dim <= nb * d):
            raise ValueError(
                f"BlockDiagonal: dim={dim} incompatible with blocks of shape {shape} "
                f"(need (nb-1)*d < dim <= nb*d)."
            )
        self._blocks = blocks
        self._dim = dim
        self._nb = nb
        self._d = d

    # -- properties ---------------------------------------------------------
    @property
    def blocks(self) -> tf.Tensor:
        """The stored diagonal blocks, shape ``[nb, d, d]``."""
        return self._blocks

    @property
    def dim(self) -> int:
        """Matrix size ``n``."""
        return self._dim

    @property
    def block_size(self) -> int:
        """Block size ``d``."""
        return self._d

    @property
    def num_blocks(self) -> int:
        """Number of blocks ``nb``."""
        return self._nb

    @property
    def padding(self) -> int:
        """Number of padding rows/columns ``nb * d - n`` in the last block."""
        return self._nb * self._d - self._dim

    @property
    def shape(self) -> tf.TensorShape:
        """Dense shape ``[n, n]``."""
        return tf.TensorShape([self._dim, self._dim])

    @property
    def dtype(self) -> tf.DType:
        return self._blocks.dtype

    def __repr__(self) -> str:
        return (
            f"BlockDiagonal(dim={self._dim}, block_size={self._d}, num_blocks={self._nb}, "
            f"dtype={self.dtype.name})"
        )

    # -- construction -------------------------------------------------------
    @staticmethod
    def _sizes(n: int, block_size: int):
        if int(block_size) <= 0:
            raise ValueError(f"BlockDiagonal: block_size must be positive, got {block_size}.")
        return split_layout(n, int(block_size))

    @staticmethod
    def _padding_mask(nb: int, d: int, n: int, dtype):
        """(valid [nb, d, d] 0/1 mask, identity-on-padding [nb, d, d]) for dim n."""
        idx = tf.range(nb * d)
        valid = tf.cast(tf.reshape(idx < n, [nb, d]), dtype)
        mask = valid[:, :, None] * valid[:, None, :]
        pad_eye = tf.eye(d, batch_shape=[nb], dtype=dtype) * (1 - valid)[:, :, None]
        return mask, pad_eye

    @classmethod
    def from_dense(cls, matrix, block_size: int) -> "BlockDiagonal":
        """Extract the diagonal blocks of a dense ``[n, n]`` matrix.

        Vectorised (no Python loop over blocks).  If ``n`` is not a multiple
        of the block size, the last block is padded with the identity (zeros
        in the cross terms) so it stays invertible.  If ``block_size >= n``
        a single ``[1, n, n]`` block is used.

        Args:
          matrix: dense tensor ``[n, n]`` with static ``n``.
          block_size: requested block size ``d``.

        Returns:
          :class:`BlockDiagonal` with ``blocks`` of shape ``[nb, d, d]``,
          ``nb = ceil(n / d)``.
        """
        matrix = _as_tensor(matrix)
        shape = matrix.shape
        if shape.rank != 2 or shape[0] is None or shape[0] != shape[1]:
            raise ValueError(f"BlockDiagonal.from_dense: need a static square [n, n] matrix, got {shape}.")
        n = int(shape[0])
        nb, d = cls._sizes(n, block_size)
        blocks = diagonal_blocks(matrix, d)
        if nb * d > n:
            _, pad_eye = cls._padding_mask(nb, d, n, blocks.dtype)
            blocks = blocks + pad_eye
        return cls(blocks, n)

    def clean_padding(self) -> "BlockDiagonal":
        """Same matrix with the padding set to the identity (zero cross terms)."""
        if not self.padding:
            return self
        mask, pad_eye = self._padding_mask(self._nb, self._d, self._dim, self.dtype)
        return BlockDiagonal(self._blocks * mask + pad_eye, self._dim)

    def map_blocks(self, fn) -> "BlockDiagonal":
        """``BlockDiagonal(fn(blocks), dim)``; ``fn`` maps ``[nb,d,d] -> [nb,d,d]``.

        E.g. ``bd.map_blocks(tf.linalg.inv)``.  Call :meth:`clean_padding`
        first if ``fn`` needs well-posed padding (e.g. an inverse).
        """
        return BlockDiagonal(fn(self._blocks), self._dim)

    def inverse(self) -> "BlockDiagonal":
        """Block-wise inverse (padding reset to the identity first)."""
        return self.clean_padding().map_blocks(tf.linalg.inv)

    # -- products -----------------------------------------------------------
    def matmul(self, x) -> tf.Tensor:
        """``B @ x`` for ``x`` of shape ``[n, m]`` (returns ``[n, m]``).

        Pads the rows of ``x`` to ``nb * d``, reshapes to ``[nb, d, m]``,
        does one batched matmul and slices back to ``n`` rows.
        """
        x = _as_tensor(x, self.dtype)
        if x.shape.rank != 2:
            raise ValueError(f"BlockDiagonal.matmul: x must be [n, m], got {x.shape}.")
        if x.shape[0] is not None and x.shape[0] != self._dim:
            raise ValueError(f"BlockDiagonal.matmul: x has {x.shape[0]} rows, expected {self._dim}.")
        pad = self.padding
        if pad:
            x = tf.pad(x, [[0, pad], [0, 0]])
        xr = tf.reshape(x, [self._nb, self._d, -1])
        y = tf.linalg.matmul(self._blocks, xr)  # [nb, d, m]
        y = tf.reshape(y, [self._nb * self._d, -1])
        if pad:
            y = y[: self._dim]
        return y

    def rmatmul(self, x) -> tf.Tensor:
        """``x @ B`` for ``x`` of shape ``[m, n]`` (returns ``[m, n]``).

        Pads the columns of ``x`` to ``nb * d``, reshapes to ``[m, nb, d]``
        and contracts block-wise with one einsum.
        """
        x = _as_tensor(x, self.dtype)
        if x.shape.rank != 2:
            raise ValueError(f"BlockDiagonal.rmatmul: x must be [m, n], got {x.shape}.")
        if x.shape[1] is not None and x.shape[1] != self._dim:
            raise ValueError(f"BlockDiagonal.rmatmul: x has {x.shape[1]} columns, expected {self._dim}.")
        pad = self.padding
        if pad:
            x = tf.pad(x, [[0, 0], [0, pad]])
        if self._nb == 1:
            # One block: a plain matmul (the einsum's batch axis of size 1 costs ~25 % more on
            # CPU for a [3137·128]·[128·128] product, the CNN's dense1 G side).
            y = tf.linalg.matmul(x, self._blocks[0])
        else:
            xr = tf.reshape(x, [-1, self._nb, self._d])
            y = tf.einsum("mbi,bij->mbj", xr, self._blocks)
            y = tf.reshape(y, [-1, self._nb * self._d])
        if pad:
            y = y[:, : self._dim]
        return y

    def apply_right(self, y) -> tf.Tensor:
        """Operator application ``B . y`` for ``y`` of shape ``[n]`` or ``[n, ...]``.

        Contracts the first axis of ``y`` with the columns of ``B``; returns the
        shape of ``y``.
        """
        y = _as_tensor(y, self.dtype)
        dims = _dims(y, "y")
        if not dims:
            raise ValueError("BlockDiagonal.apply_right: y must have rank >= 1.")
        if dims[0] is not None and dims[0] != self._dim:
            raise ValueError(f"BlockDiagonal.apply_right: y.shape[0]={dims[0]}, expected {self._dim}.")
        if len(dims) == 2:
            return self.matmul(y)
        out = self.matmul(tf.reshape(y, [self._dim, -1]))
        target = dims if all(v is not None for v in dims) else tf.shape(y)
        return tf.reshape(out, target)

    def compose(self, other: "BlockDiagonal"):
        """``self @ other``.

        Stays a :class:`BlockDiagonal` when both share ``dim`` and
        ``block_size`` (one batched matmul, padding cleaned to the identity);
        otherwise a dense ``[n, n]`` tensor.
        """
        if isinstance(other, BlockDiagonal):
            if other.dim != self.dim:
                raise ValueError(f"BlockDiagonal.compose: dim mismatch {self.dim} vs {other.dim}.")
            if other.block_size == self.block_size:
                a = self.clean_padding().blocks
                b = other.clean_padding().blocks
                return BlockDiagonal(tf.linalg.matmul(a, b), self._dim)
            return self.matmul(other.to_dense())
        return self.matmul(_densify(other))

    def to_dense(self) -> tf.Tensor:
        """Dense ``[n, n]`` matrix, zeros off the diagonal blocks (padding dropped)."""
        nb, d = self._nb, self._d
        sel = tf.eye(nb, dtype=self.dtype)  # [nb, nb]
        full = self._blocks[:, :, None, :] * sel[:, None, :, None]  # [nb, d, nb, d]
        full = tf.reshape(full, [nb * d, nb * d])
        if self.padding:
            full = full[: self._dim, : self._dim]
        return full


def _factor_dim(f) -> Optional[int]:
    if isinstance(f, BlockDiagonal):
        return f.dim
    return f.shape[0]


def _left_mul(f, x):
    """f @ x for a dense matrix or BlockDiagonal f."""
    if isinstance(f, BlockDiagonal):
        return f.matmul(x)
    return tf.linalg.matmul(f, x)


def _right_mul(x, f):
    """x @ f for a dense matrix or BlockDiagonal f."""
    if isinstance(f, BlockDiagonal):
        return f.rmatmul(x)
    return tf.linalg.matmul(x, f)


def _to_matrix(f):
    return f.to_dense() if isinstance(f, BlockDiagonal) else f


class KroneckerOperator:
    """Lazy Kronecker-factored operator on ``[p, q]`` matrices.

    Represents the linear map ``X -> scale * left @ X @ right`` where
    ``left`` is ``[p, p]`` and ``right`` is ``[q, q]``, each a dense tensor or
    a :class:`BlockDiagonal`.  As an operator 4-tensor (output indices first)
    it is

        ``T[i, j, u, v] = scale * left[i, u] * right[v, j]``,  shape ``[p, q, p, q]``.

    Relation to the Kronecker product: with row-major vectorisation
    ``vec(X)[u*q + v] = X[u, v]``,

        ``vec(left @ X @ right) = kron(left, right^T) @ vec(X)``.

    (In K-FAC terms, for a dense layer kernel ``W`` of shape ``[in, out]``,
    ``left`` is the inverse input-activation factor and ``right`` the inverse
    output-gradient factor.)

    Args:
      left: ``[p, p]`` tensor or :class:`BlockDiagonal`.
      right: ``[q, q]`` tensor or :class:`BlockDiagonal`.
      scale: Python float or scalar tensor multiplier (default ``1.0``).
    """

    def __init__(self, left, right, scale=1.0):
        if not isinstance(left, BlockDiagonal):
            left = _as_tensor(left)
            if left.shape.rank != 2:
                raise ValueError(f"KroneckerOperator: left must be [p, p], got {left.shape}.")
        if not isinstance(right, BlockDiagonal):
            right = _as_tensor(right)
            if right.shape.rank != 2:
                raise ValueError(f"KroneckerOperator: right must be [q, q], got {right.shape}.")
        if left.dtype != right.dtype:
            raise ValueError(f"KroneckerOperator: dtype mismatch {left.dtype} vs {right.dtype}.")
        self._left = left
        self._right = right
        self._scale = scale

    @property
    def left(self):
        """Left factor, ``[p, p]`` tensor or :class:`BlockDiagonal`."""
        return self._left

    @property
    def right(self):
        """Right factor, ``[q, q]`` tensor or :class:`BlockDiagonal`."""
        return self._right

    @property
    def scale(self):
        """Scalar multiplier (Python number or scalar tensor)."""
        return self._scale

    @property
    def dtype(self) -> tf.DType:
        return self._left.dtype

    @property
    def input_shape(self) -> tf.TensorShape:
        """Shape ``[p, q]`` of the matrices the operator acts on."""
        return tf.TensorShape([_factor_dim(self._left), _factor_dim(self._right)])

    @property
    def shape(self) -> tf.TensorShape:
        """Shape ``[p, q, p, q]`` of the (never materialised) operator tensor."""
        return self.input_shape.concatenate(self.input_shape)

    def __repr__(self) -> str:
        return f"KroneckerOperator(input_shape={self.input_shape.as_list()}, dtype={self.dtype.name})"

    def _apply_scale(self, t):
        s = self._scale
        if isinstance(s, (int, float)) and s == 1:
            return t
        return t * tf.cast(s, t.dtype)

    def apply_right(self, x) -> tf.Tensor:
        """``scale * left @ x @ right`` for ``x`` of shape ``[p, q]``.

        Never materialises the Kronecker product: cost is two (block-)matmuls.
        """
        x = _as_tensor(x, self.dtype)
        if x.shape.rank != 2 or not _dims_compatible(x.shape.as_list(), self.input_shape.as_list()):
            raise ValueError(
                f"KroneckerOperator.apply_right: x must have shape {self.input_shape}, got {x.shape}."
            )
        y = _right_mul(_left_mul(self._left, x), self._right)
        return self._apply_scale(y)

    def compose(self, other: "KroneckerOperator") -> "KroneckerOperator":
        """``self o other``: ``X -> self(other(X))``.

        Returns ``KroneckerOperator(self.left @ other.left, other.right @ self.right,
        self.scale * other.scale)``.  Factors that are both
        :class:`BlockDiagonal` with the same block size stay block-diagonal;
        otherwise dense matmuls are used.
        """
        if not isinstance(other, KroneckerOperator):
            raise TypeError(f"KroneckerOperator.compose: expected a KroneckerOperator, got {type(other)}.")

        def mul(a, b):
            if isinstance(a, BlockDiagonal) and isinstance(b, BlockDiagonal):
                return a.compose(b)
            if isinstance(a, BlockDiagonal):
                return a.matmul(b)
            if isinstance(b, BlockDiagonal):
                return b.rmatmul(a)
            return tf.linalg.matmul(a, b)

        s1, s2 = self._scale, other._scale
        if isinstance(s1, (int, float)) and isinstance(s2, (int, float)):
            scale = s1 * s2
        else:
            scale = tf.cast(s1, self.dtype) * tf.cast(s2, self.dtype)
        return KroneckerOperator(mul(self._left, other._left), mul(other._right, self._right), scale)

    def to_dense(self) -> tf.Tensor:
        """Materialise ``T[i, j, u, v] = scale * left[i, u] * right[v, j]`` ([p, q, p, q]).

        For tests / introspection only (memory ``p^2 q^2``).
        """
        left = _to_matrix(self._left)
        right = _to_matrix(self._right)
        return self._apply_scale(tf.einsum("iu,vj->ijuv", left, right))
