"""What a split keeps for the eigenbasis rule: how well a split basis from one batch diagonalizes
the next batch's factor.

The eigenbasis rule (:class:`thor_tf.rules.Eigenbasis`) rotates each gradient into the
eigenbasis of its factors' diagonal blocks, takes a basis at a refresh (from that batch's
factors) and uses it on the following batches' gradients until the next one. A split decides two
things at once: larger blocks let the basis follow more of a factor's correlations, but each
block's basis is estimated from the same rows, so past a size the batch can support, its
directions are the batch's noise and do not hold on the next batch. The seed's information loss
(:func:`thor_tf.calibration.information_loss`, the block-diagonal part's spectral norm against
the whole) sees only the first effect: it always favours the largest block.

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

from typing import Sequence

import numpy as np

__all__ = ["held_out_kept", "kept_curve"]


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
