"""Block-diagonal matrices and Kronecker operators: the algebra training applies (pure TensorFlow).

A curvature factor is cut into ``split_dim`` diagonal blocks (:func:`split_layout`: how many, how
large, the last one padded) and kept only as those blocks, ``[nb, d, d]`` (:class:`BlockDiagonal`).
A layer's preconditioner is the Kronecker operator ``X -> scale · left @ X @ right`` on its
``[p, q]`` gradient matrix, ``left`` and ``right`` dense or block-diagonal
(:class:`KroneckerOperator`); the inverse rule applies one per block (:func:`apply_blockwise`, the
product of a block-diagonal mat with a vec of matrices) and measures the step with
:func:`inner_product` (K-FAC's KL clip). Nothing is ever flattened into one long vector, and no
Kronecker product is formed.

Conventions (seed 000's): as an operator 4-tensor, output indices first, a
:class:`KroneckerOperator` is ``T[i, j, u, v] = scale · left[i, u] · right[v, j]``; with row-major
``vec``, ``vec(left @ X @ right) = kron(left, right^T) @ vec(X)``. Everything works in float32 and
float64 (dtype follows the inputs) and inside ``tf.function`` (also with XLA): branching is on
static shapes and Python objects only. The general vec/mat/eye algebra of seed 000 (outer
products, contractions in three modes, mat-mat products), which only the tests use, is
``tests/algebra_reference.py``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["split_layout", "diagonal_blocks", "BlockDiagonal", "KroneckerOperator",
           "apply_blockwise", "inner_product", "is_operator"]


def is_operator(obj: Any) -> bool:
    """True if ``obj`` is a lazy operator (has ``apply_right`` and ``to_dense``).

    Dense tensors, variables, numpy arrays and ``None`` are *not* operators.
    """
    return (
        obj is not None
        and callable(getattr(obj, "apply_right", None))
        and callable(getattr(obj, "to_dense", None))
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


def _densify(x):
    return x.to_dense() if is_operator(x) else _as_tensor(x)


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


# ---------------------------------------------------------------------------
# The products training applies (a block-diagonal mat on a vec; an inner product)
# ---------------------------------------------------------------------------
def apply_blockwise(operators: Sequence, matrices: Sequence) -> list:
    """``[op_i . X_i]``: the block-diagonal mat with ``operators`` on its diagonal applied to the
    vec ``matrices`` (each operator a lazy operator with ``apply_right``, e.g. a
    :class:`KroneckerOperator` on ``[p_i, q_i]``; returns the ``[p_i, q_i]`` results). Seed 000's
    ``mat_vec_prod(block_diagonal_mat(operators), matrices, mode="right")``, whose off-diagonal
    blocks are structural zeros, to the same values and ops.
    """
    if len(operators) != len(matrices):
        raise ValueError(f"apply_blockwise: {len(operators)} operators, {len(matrices)} matrices.")
    return [op.apply_right(_as_tensor(x)) for op, x in zip(operators, matrices)]


def inner_product(xs: Sequence, ys: Sequence) -> tf.Tensor:
    """``Σ_i ⟨X_i, Y_i⟩ = Σ_i sum(X_i · Y_i)`` over two vecs of equal shapes (a scalar); seed
    000's ``vec_inner_prod(xs, ys, mode="all")``, to the same values and ops."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"inner_product: needs two non-empty vecs of one length, got {len(xs)} "
                         f"and {len(ys)}.")
    terms = []
    for x, y in zip(xs, ys):
        x, y = _as_tensor(x), _as_tensor(y)
        if not _dims_compatible(_dims(x, "x"), _dims(y, "y")):
            raise ValueError(f"inner_product: shapes differ, {x.shape} and {y.shape}.")
        terms.append(tf.reduce_sum(x * y))
    return terms[0] if len(terms) == 1 else tf.add_n(terms)
