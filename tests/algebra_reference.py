"""Seed 000's general vec/mat/eye algebra, which only the tests use (float64 references).

Training needs only block-diagonal mats of Kronecker operators applied to a vec of gradient
matrices, and an inner product: those live in :mod:`thor_tf.block_diagonal`, with the lazy
operators themselves (:class:`~thor_tf.block_diagonal.BlockDiagonal`,
:class:`~thor_tf.block_diagonal.KroneckerOperator`, re-exported here). This module keeps the rest of
the algebra, checked in tests/test_algebra_reference.py against NumPy, and is the reference
``apply_blockwise`` and ``inner_product`` are checked against.

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
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import tensorflow as tf

from thor_tf.block_diagonal import (  # noqa: F401  (re-exported: the tests' one namespace)
    BlockDiagonal, KroneckerOperator, _as_tensor, _densify, _dims, _dims_compatible,
    diagonal_blocks, is_operator, split_layout)

#: Allowed values of the ``mode`` argument of the contraction functions.
MODES = ("all", "right", "auto")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(
            f"Invalid mode={mode!r}; `mode` must be one of {', '.join(repr(m) for m in MODES)}."
        )


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
