"""What a split keeps, the measure each rule's calibration weighs against the split's cost.

**The inverse rule** (the seed's, :func:`information_loss`, :func:`loss_fractions`): per factor
matrix ``A`` and candidate ``b`` the loss ``L = 1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ)) =
1 − ‖Â‖₂/‖A‖₂`` with ``Â`` the block-diagonal part of ``A`` (blocks of ``b``, the last one partial); the
*information curve* is, per candidate, the fraction of the model's factor matrices with
``L < 1%``. It lies in [0, 1] and rises with the candidate (1 at the exact inverse, ``b >= n``
for every factor).

**The eigenbasis rule** (:func:`held_out_kept`, :func:`kept_curve`): how well a split basis from
one batch diagonalizes the next batch's factor.

The eigenbasis rule (:class:`thor_tf.rules.Eigenbasis`) rotates each gradient into the
eigenbasis of its factors' diagonal blocks, takes a basis at a refresh (from that batch's
factors) and uses it on the following batches' gradients until the next one. A split decides two
things at once: larger blocks let the basis follow more of a factor's correlations, but each
block's basis is estimated from the same rows, so past a size the batch can support, its
directions are the batch's noise and do not hold on the next batch. The seed's information loss
(:func:`information_loss`, the block-diagonal part's spectral norm against the
whole) sees only the first effect: it always favours the largest block.

The measure here sees both. For a factor ``F`` ([n, n], symmetric PSD) from batch 1 and ``F'``
from batch 2 and a split ``b``: ``Q = ⊕_k Q_k`` with ``F_kk = Q_k Λ_k Q_kᵀ`` the eigenvectors of
batch 1's diagonal blocks (``b``-sized, the last one partial), and

    kept(b) = ‖diag(Qᵀ F' Q)‖² / ‖F'‖_F²

the fraction of the held-out factor's Frobenius mass that lies on the diagonal in the split
basis: 1 when the basis diagonalizes ``F'`` exactly (``F'`` block-diagonal at ``b`` with the
same eigenvectors as ``F``), ``‖diag F'‖²/‖F'‖_F²`` at ``b = 1`` (no rotation). Only the diagonal
blocks of ``Qᵀ F' Q`` reach its diagonal, so ``kept(b) = Σ_k Σ_i (q_kiᵀ F'_kk q_ki)² / ‖F'‖_F²``:
an ``eigh`` per block of ``F`` and a product per block of ``F'``, float64 NumPy.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from thor_tf.block_diagonal import diagonal_blocks
from thor_tf.split.crossing import _check_candidates

__all__ = ["DEFAULT_THRESHOLD", "held_out_kept", "information_loss", "kept_curve",
           "loss_fractions"]

#: A factor matrix "keeps its information" at a split when its loss ``L`` is below this (1%).
DEFAULT_THRESHOLD = 0.01


def _spectral_norms(stack: np.ndarray) -> np.ndarray:
    """Spectral norm ``‖M‖₂ = sqrt(λmax(MMᵀ))`` of each matrix of a ``[b, d, d]`` float64 stack."""
    if stack.shape[-1] == 1:
        return np.abs(stack[:, 0, 0])
    asym = np.max(np.abs(stack - np.swapaxes(stack, -1, -2)))
    if asym <= 1e-6 * np.max(np.abs(stack)):
        # Symmetric: ‖M‖₂ = max |eigenvalue| (eigvalsh is cheaper and more accurate than an SVD).
        sym = 0.5 * (stack + np.swapaxes(stack, -1, -2))
        return np.max(np.abs(np.linalg.eigvalsh(sym)), axis=-1)
    return np.linalg.norm(stack, ord=2, axis=(-2, -1))


def _as_square(matrix) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
        raise ValueError(f"factor matrices must be square [n, n]; got shape {m.shape}.")
    if not np.all(np.isfinite(m)):
        raise ValueError("factor matrices must be finite (got NaN/Inf).")
    return m


def information_loss(matrix, block_size: int, norm: Optional[float] = None) -> float:
    """``L = 1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ))`` for the split of ``matrix`` at ``block_size``.

    ``Â`` keeps the diagonal blocks of ``A`` ([n, n]) of size ``block_size`` (the last block
    partial when ``block_size`` does not divide ``n``) and zeros elsewhere. Since
    ``sqrt(λmax(MMᵀ)) = ‖M‖₂`` and the spectral norm of a block-diagonal matrix is the largest of
    its blocks' norms, ``L = 1 − max_k ‖A_kk‖₂ / ‖A‖₂``. Computed in float64 NumPy.

    ``L`` is 0 when ``A`` is block-diagonal at ``block_size`` (hence also at any multiple of a
    block size at which it is block-diagonal), when ``block_size >= n``, and, by convention, for
    ``A = 0``. For a PSD ``A`` it lies in ``[0, 1)`` (a principal block never has a larger norm).

    Args:
      matrix: ``[n, n]`` array (any float dtype).
      block_size: int >= 1.
      norm: ``‖A‖₂`` if already known (to reuse it across candidates).

    Returns:
      python float.
    """
    a = _as_square(matrix)
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1; got {block_size}.")
    n = a.shape[0]
    if block_size >= n:
        return 0.0
    full = float(_spectral_norms(a[None])[0]) if norm is None else float(norm)
    if full == 0.0:
        return 0.0
    kept = float(np.max(_spectral_norms(diagonal_blocks(a, block_size))))
    return float(min(1.0, max(0.0, 1.0 - kept / full)))  # clip round-off (a block's norm <= ‖A‖₂)


def loss_fractions(matrices: Iterable, cands: Sequence[int],
                   threshold: float = DEFAULT_THRESHOLD, return_losses: bool = False):
    """Per candidate, the fraction of ``matrices`` whose information loss is ``< threshold``.

    Args:
      matrices: iterable of ``[n_i, n_i]`` factor matrices (sizes may differ).
      cands: increasing candidate block sizes.
      threshold: the loss below which a matrix counts as kept (default 1%).
      return_losses: also return the ``[num_matrices, num_candidates]`` float64 loss table.

    Returns:
      list of floats in [0, 1] (one per candidate), or ``(fractions, losses)``. A candidate
      ``>= n_i`` gives that matrix ``L = 0``, so the fraction is 1 at ``max(n_i)``.
    """
    cands = _check_candidates(cands)
    mats = [_as_square(m) for m in matrices]
    if not mats:
        raise ValueError("`matrices` is empty.")
    losses = np.zeros((len(mats), len(cands)))
    for i, m in enumerate(mats):
        full = float(_spectral_norms(m[None])[0])
        for j, c in enumerate(cands):
            losses[i, j] = information_loss(m, c, norm=full)
    fractions = [float(f) for f in np.mean(losses < threshold, axis=0)]
    return (fractions, losses) if return_losses else fractions

def _square(matrix, name):
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
        raise ValueError(f"`{name}` must be a square [n, n] matrix; got shape {m.shape}.")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"`{name}` must be finite (got NaN/Inf).")
    return 0.5 * (m + m.T)


def held_out_kept(basis_factor, held_out_factor, block_size: int) -> float:
    """``kept(b)`` (module docstring) of ``held_out_factor`` in the split basis of
    ``basis_factor``.

    Args:
      basis_factor: ``[n, n]`` factor whose diagonal blocks give the basis (batch 1).
      held_out_factor: ``[n, n]`` factor it is applied to (batch 2), same ``n``.
      block_size: split ``b`` (int >= 1; ``b >= n``: one block, the full eigenbasis).

    Returns:
      python float in [0, 1]; 1.0 for a zero ``held_out_factor`` (nothing to keep).
    """
    f1 = _square(basis_factor, "basis_factor")
    f2 = _square(held_out_factor, "held_out_factor")
    if f1.shape != f2.shape:
        raise ValueError(f"the two factors must have one shape; got {f1.shape} and {f2.shape}.")
    b = int(block_size)
    if b < 1:
        raise ValueError(f"`block_size` must be an int >= 1; got {block_size!r}.")
    total = float(np.sum(f2 * f2))
    if total == 0.0:
        return 1.0
    n = f1.shape[0]
    on_diagonal = 0.0
    for start in range(0, n, b):
        stop = min(n, start + b)
        block = slice(start, stop)
        if stop - start == 1:
            on_diagonal += float(f2[start, start]) ** 2
            continue
        _, q = np.linalg.eigh(f1[block, block])
        rotated = np.sum(q * (f2[block, block] @ q), axis=0)  # q_iᵀ F'_kk q_i per column i
        on_diagonal += float(np.sum(rotated * rotated))
    return float(min(1.0, on_diagonal / total))


def kept_curve(pairs: Sequence, cands: Sequence[int]) -> list:
    """Per candidate, the mean of :func:`held_out_kept` over ``pairs`` of factors
    (``[(F_batch1, F_batch2)]``, sizes may differ; a candidate at or past a factor's size is its
    full eigenbasis).

    Returns:
      list of floats in [0, 1], one per candidate.
    """
    pairs = list(pairs)
    if not pairs:
        raise ValueError("`pairs` is empty.")
    return [float(np.mean([held_out_kept(f1, f2, c) for f1, f2 in pairs])) for c in cands]
