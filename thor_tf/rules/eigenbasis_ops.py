"""The eigenbasis rule's maths: batched eigendecomposition of split factor blocks, moments
carried into a new basis, and the Newton–Schulz orthogonalization of the step.
:class:`thor_tf.rules.eigenbasis.Eigenbasis` calls it; the bucket loop both rules share is
:mod:`thor_tf.buckets`.

**Bases.** The rule keeps, per diagonal block ``F_i`` of a factor (``[nb, d, d]``, undamped, zero on the padding of the last block), its eigenvectors
``Q_i`` (columns) and eigenvalues ``w_i``: ``F_i = Q_i diag(w_i) Q_iᵀ``. Damping does not move
eigenvectors, so the undamped blocks are decomposed.

Padding: the padded rows/columns of a block get the diagonal value ``tr F_i + 1`` (> every
eigenvalue of the PSD block) before ``eigh``, so that ``eigh``'s ascending order puts the true
eigenvectors first and the padding's last, never mixed with a zero eigenvalue of the true block;
the stored basis is then exactly block-diagonal: the true part top-left, identity on the padding.

The stored eigenvalues are those of the block plus the tie-breaking ramp of
:func:`_padded_for_eigh` (at most 10 % of the mean eigenvalue).

Precision and robustness: ``eigh`` runs in float64 (the factors stay float32): float32
eigenvectors of clustered eigenvalues are accurate to ~1e-3 only (see :func:`eigh_blocks`); a
block whose decomposition is not finite keeps the basis it had.

**Cheaper refreshes** (``Eigenbasis(refresh="power_qr")``, :func:`refresh_selected`; SOAP's
method, Vyas et al. 2024, and Distributed Shampoo's skip). From the basis in use ``Q_old``:

* drift: ``D = Q_oldᵀ F Q_old`` (``F`` the ramped block); if its off-diagonal mass
  ``‖D − diag D‖_F / ‖F‖_F`` is below ``drift_tolerance`` the block keeps its basis and
  eigenvalues (nothing changes, the moments are not rotated);
* else one step of orthogonal iteration in float32: ``Q_new = qr(F · Q_old)`` with ``Q_old``'s
  columns in descending order of ``diag D`` (so that Gram–Schmidt keeps the dominant directions
  first, the order in which the iteration converges), eigenvalues ``diag(Q_newᵀ F Q_new)``,
  columns signed like ``Q_old``'s and stored in ascending order as ``eigh``'s;
* a full float64 ``eigh`` (:func:`eigh_blocks`) instead where a check fails: the block was never
  decomposed (its eigenvalues are all 0: the first refresh, from the identity), the power
  step is not finite, or its residual ``‖Q_newᵀ F Q_new − diag‖_F / ‖F‖_F`` exceeds
  ``tolerance``.

The order, padding and ramp contracts are those of ``eigh`` above: the true columns first in
ascending order of their eigenvalue, identity on padding (exactly), the ramp included in ``F``.
The drift test and residual are relative to ``‖F‖_F``, which the largest eigenvalues dominate:
a direction of a small eigenvalue may stay rotated by more than the residual says (SOAP's
trade: one power step per refresh, measured in docs/update_rules.md).

**Orthogonalization** (batched over matrices of one shape). The orthogonal (polar) factor of
``X = U Σ Vᵀ`` is ``U Vᵀ``: every singular value set to 1. Muon (Jordan et al. 2024) approximates it by five iterations of a quintic polynomial whose slope at 0
is large, so that small singular values grow quickly; the result has singular values in about
[0.7, 1.2] rather than exactly 1 (``US'Vᵀ``), which trains as well as the exact factor and costs
only matrix products. The eigenbasis rule orthogonalizes its step after Adam's division in the
eigenbasis (SOAP-Muon), not the gradient: orthogonalizing the rotated gradient would be Muon,
since ``orth(Q_Aᵀ M Q_G) = Q_Aᵀ orth(M) Q_G``.

The iteration and its two evaluations (float32 products, or a float64 ``eigh`` of the small
Gram matrix) are in :mod:`thor_tf.rules.newton_schulz`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from thor_tf import _keras_compat, lean
from thor_tf.block_diagonal import BlockDiagonal

# Newton–Schulz lives in its own module; its names stay importable from here.
from thor_tf.rules.newton_schulz import (NS_COEFFICIENTS, NS_METHODS, NS_STEPS,  # noqa: F401
                                         SPECTRAL_MAX, newton_schulz, newton_schulz_many)

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "NS_STEPS", "RAGGED_PADDING",
           "REFRESHES", "SPECTRAL_MAX", "TIE_BREAK", "basis_change", "eigh_blocks",
           "eigh_selected", "newton_schulz", "newton_schulz_many", "off_diagonal_ratio",
           "power_qr_step", "refresh_selected", "rotate_first_moment", "rotate_in", "rotate_out",
           "rotate_second_moment"]


#: The diagonal ramp that breaks ties (see :func:`_padded_for_eigh`), relative to the block's mean
#: eigenvalue: entry k of the d true entries of a block gets ``TIE_BREAK·(tr/d)·k/d``.
TIE_BREAK = 0.1


def _padded_for_eigh(blocks, mask, tie_break=TIE_BREAK):
    """``blocks`` with ``tr + 1`` on each padding diagonal entry (``mask`` 0 there), and a small
    increasing ramp on the true diagonal.

    The ramp (at most 10 % of the block's mean eigenvalue) makes the basis of a (nearly)
    degenerate eigenspace — A's null space when a batch has fewer rows than A has dimensions — the
    coordinate axes, the same on every device and replica count, instead of whatever float32
    round-off picks: Adam's per-coordinate division is not invariant to rotations inside such a
    space. Eigenvectors of well-separated eigenvalues move by ~10 % of the mean over the gap.
    Measured (digits CNN of tests/scripts, 12 steps, inputs perturbed by 1e-7): the weights
    moved apart by 9e-3 of the step with a 1 % ramp, 3e-5 with 10 %, 4e-7 under the inverse rule."""
    diagonal = tf.linalg.diag_part(blocks) * mask
    size = int(blocks.shape[-1])
    trace = tf.reduce_sum(diagonal, axis=-1)  # [B]
    count = tf.maximum(tf.reduce_sum(mask, axis=-1), 1.0)
    # The true entries come first in a padded block: entry k of the d true ones gets mean·k/d.
    ramp = (tf.expand_dims(tie_break * (trace / count ** 2), 1)
            * tf.constant(np.arange(size, dtype=np.float32)))
    return tf.linalg.set_diag(blocks * _outer(mask),
                              (diagonal + ramp) * mask
                              + (1.0 - mask) * tf.expand_dims(
                                  tf.abs(trace) * (1.0 + tie_break) + 1.0, 1))


def _outer(mask):
    """``[B, d, d]``: ``mask[:, :, None] * mask[:, None, :]`` (few ops)."""
    return tf.expand_dims(mask, 2) * tf.expand_dims(mask, 1)


def _clean(q, w, mask):
    """Exactly block-diagonal basis: true part kept, identity on the padding; ``w`` 0 there."""
    return (q * _outer(mask) + lean.eye(q.shape[-1], q.dtype) * tf.expand_dims(1.0 - mask, 2),
            w * mask)


def eigh_blocks(blocks, mask, previous_q=None, previous_w=None, tie_break=TIE_BREAK):
    """``(Q [B, d, d], w [B, d])``: eigendecomposition of each block (see the module docstring).

    Args:
      blocks: ``[B, d, d]`` float32 symmetric PSD blocks (undamped; zero padding).
      mask: ``[B, d]`` 1 on each block's true entries, 0 on padding.
      previous_q, previous_w: the basis in use, kept for a block whose decomposition fails
        (identity and zeros when None).
      tie_break: the ramp of :func:`_padded_for_eigh`, relative to the mean eigenvalue.
    """
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    mask = tf.convert_to_tensor(mask, tf.float32)
    size = int(blocks.shape[-1])
    if previous_q is None:
        previous_q = lean.eye(size)  # broadcast by the selections below
    if previous_w is None:
        previous_w = tf.zeros(tf.shape(blocks)[:2], tf.float32)
    if size == 1:  # 1×1 blocks (an embedding's diagonal A): the basis is 1
        w = blocks[:, :, 0] * mask
        ok = tf.math.is_finite(w[:, 0])
        return (tf.where(lean.per_block(ok, 3), tf.ones_like(blocks), previous_q),
                tf.where(lean.per_block(ok, 2), w, previous_w))
    padded = _padded_for_eigh(blocks, mask, tie_break)
    # float64: float32 eigenvectors of clustered eigenvalues (a null space under the ramp) are
    # accurate to ~1e-3 only, and Adam's division turns that leakage into full-size steps that
    # differ between LAPACK and XLA, or 1 and 2 replicas. Same cost on CPU for d <= 256
    # (docs/results/bench_eigh.json); refreshes are rare.
    w64, q64 = tf.linalg.eigh(tf.cast(padded, tf.float64))
    w, q = tf.cast(w64, tf.float32), tf.cast(q64, tf.float32)
    ok = tf.logical_and(tf.reduce_all(tf.math.is_finite(q), axis=[1, 2]),
                        tf.reduce_all(tf.math.is_finite(w), axis=1))
    q, w = _clean(q, w, mask)
    return (tf.where(lean.per_block(ok, 3), q, previous_q),
            tf.where(lean.per_block(ok, 2), w, previous_w))


def eigh_selected(blocks, mask, q_in_use, w_in_use, selected, tie_break=TIE_BREAK):
    """``(Q, w)`` in use with the ``selected`` blocks replaced by their new decomposition.

    Only the selected blocks are decomposed (gathered into one batch); under XLA (static shapes)
    all are, when one is selected, and the others keep theirs. Shapes as :func:`eigh_blocks`;
    ``selected`` ``[B]`` bool.
    """
    if _keras_compat.in_xla_context():
        def all_blocks():
            q, w = eigh_blocks(blocks, mask, q_in_use, w_in_use, tie_break)
            return (tf.where(lean.per_block(selected, 3), q, q_in_use),
                    tf.where(lean.per_block(selected, 2), w, w_in_use))
        return tf.cond(tf.reduce_any(selected), all_blocks, lambda: (q_in_use, w_in_use))
    due = tf.where(selected)  # [K, 1]
    q, w = eigh_blocks(tf.gather_nd(blocks, due), tf.gather_nd(tf.convert_to_tensor(mask), due),
                       tf.gather_nd(q_in_use, due), tf.gather_nd(w_in_use, due), tie_break)
    return (tf.tensor_scatter_nd_update(q_in_use, due, q),
            tf.tensor_scatter_nd_update(w_in_use, due, w))


#: How a refresh renews a basis: a float64 ``eigh`` of every refreshing block, or one power step
#: and QR from the basis in use with the drift skip and an ``eigh`` fallback (module docstring).
REFRESHES = ("eigh", "power_qr")

#: What :func:`refresh_selected` did per block (its ``kind``).
KEPT, SKIPPED, POWER_QR, EIGH, NON_FINITE = 0, 1, 2, 3, 4


def off_diagonal_ratio(matrix, norm):
    """``‖M − diag M‖_F / norm`` per matrix of ``matrix`` (``[B, d, d]``; ``norm`` ``[B]``,
    floored at 1e-30 so that a zero block has ratio 0)."""
    # The diagonal zeroed by one product with a constant mask, the same values as subtracting
    # ``diag(diag_part M)`` (a MatrixDiag building another ``[B, d, d]``: 0.3–0.8 ms per call
    # at a refresh on the suite's CNNs, and two more ops).
    off = matrix * _off_diagonal_mask(int(matrix.shape[-1]), matrix.dtype)
    return tf.sqrt(tf.reduce_sum(tf.square(off), axis=[1, 2])) / tf.maximum(norm, 1e-30)


def _off_diagonal_mask(d, dtype):
    """``1 − I`` (``[d, d]``): ones off the diagonal."""
    return 1.0 - lean.eye(d, dtype)


def power_qr_step(blocks, mask, previous_q, tie_break=TIE_BREAK):
    """One step of orthogonal iteration from ``previous_q``, and the drift of ``previous_q``.

    Args:
      blocks: ``[B, d, d]`` float32 symmetric PSD blocks (undamped; zero padding).
      mask: ``[B, d]`` 1 on each block's true entries (a prefix), 0 on padding.
      previous_q: ``[B, d, d]`` the bases in use (orthogonal, identity on padding).
      tie_break: the ramp of :func:`_padded_for_eigh` (``F`` below is the ramped block).

    Returns:
      ``(Q [B, d, d], w [B, d], residual [B], drift [B])``: ``Q = qr(F·Q_old)`` (columns of
      ``Q_old`` taken in descending order of ``diag(Q_oldᵀ F Q_old)``; each new column signed so
      that it has a non-negative product with the old column it came from), its columns sorted by
      ascending ``w = diag(Qᵀ F Q)`` and cleaned like ``eigh``'s (identity on padding, ``w`` 0
      there); ``residual = ‖Qᵀ F Q − diag‖_F / ‖F‖_F`` and ``drift`` the same of ``Q_old``.
      All float32 (see the module docstring and docs/update_rules.md for why that holds).
    """
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    mask = tf.convert_to_tensor(mask, tf.float32)
    previous_q = tf.convert_to_tensor(previous_q, tf.float32)
    padded = _padded_for_eigh(blocks, mask, tie_break)  # padding: (tr + 1)·I, kept out of QR's way
    outer = mask[:, :, None] * mask[:, None, :]
    true = padded * outer  # F: the ramped true part, zero padding
    norm = tf.sqrt(tf.reduce_sum(tf.square(true), axis=[1, 2]))
    product = tf.matmul(padded, previous_q)  # F·Q_old; on padding (tr + 1)·I
    old = tf.matmul(previous_q, product * outer, transpose_a=True)  # Q_oldᵀ F Q_old
    drift = off_diagonal_ratio(old, norm)
    # Orthogonal iteration converges column by column from the dominant one: Gram–Schmidt (QR)
    # must see the largest eigenvalues first. The padding goes last (key -inf): its columns are
    # then orthogonal to the true ones exactly and QR keeps the basis block-diagonal.
    big = tf.fill(tf.shape(mask), float("inf"))
    descending = tf.argsort(tf.where(mask > 0, tf.linalg.diag_part(old), -big), axis=-1,
                            direction="DESCENDING", stable=True)
    q, r = tf.linalg.qr(tf.gather(product, descending, axis=2, batch_dims=1))
    # QR's signs are arbitrary; a positive diagonal of R makes q_jᵀ F q_old,j = R_jj > 0: each
    # column keeps its old orientation (F is PSD), so a converged basis gives R = Q_oldᵀ Q_new
    # ≈ I (moments carried almost unchanged), without gathering Q_old's columns to compare.
    q = q * tf.where(tf.linalg.diag_part(r) < 0, -1.0, 1.0)[:, None, :]
    new = tf.matmul(q, tf.matmul(true, q), transpose_a=True)  # Q_newᵀ F Q_new
    residual = off_diagonal_ratio(new, norm)
    # Stored like eigh's: true columns first, ascending (padding last, key +inf).
    estimate = tf.linalg.diag_part(new)
    ascending = tf.argsort(tf.where(mask > 0, estimate, big), axis=-1, stable=True)
    q = tf.gather(q, ascending, axis=2, batch_dims=1)
    w = tf.gather(estimate, ascending, axis=1, batch_dims=1)
    q, w = _clean(q, w, mask)
    return q, w, residual, drift


def refresh_selected(blocks, mask, q_in_use, w_in_use, selected, refresh="eigh",
                     tie_break=TIE_BREAK, tolerance=0.5, drift_tolerance=0.0, min_size=0):
    """``(Q, w, kind)``: the bases in use with the ``selected`` blocks renewed.

    ``refresh="eigh"``: :func:`eigh_selected`. ``"power_qr"`` (module docstring): per selected
    block, kept when its drift is below ``drift_tolerance`` (``kind`` SKIPPED), else one
    :func:`power_qr_step` (POWER_QR), or a float64 ``eigh`` (EIGH) when the block was never
    decomposed (all its eigenvalues 0), the step is not finite or its residual exceeds
    ``tolerance``. A block whose factor is not finite keeps its basis (NON_FINITE), as does one
    whose ``eigh`` is not (as :func:`eigh_blocks`).
    Decisions are tensors (one traced graph); only the selected blocks are computed, the
    fallback's ``eigh`` only on the blocks that need it (all of them under XLA, when one does).

    Args:
      blocks, mask: as :func:`eigh_blocks` (``[B, d, d]``, ``[B, d]``).
      q_in_use, w_in_use: ``[B, d, d]``, ``[B, d]`` the bases and eigenvalues in use.
      selected: ``[B]`` bool, the blocks to refresh.
      refresh: one of :data:`REFRESHES`.
      tolerance: the largest residual a power step is accepted with (>= 0).
      drift_tolerance: the drift below which a block keeps its basis (>= 0; 0: never skip).
      min_size: ``"power_qr"`` only for blocks of at least this size (the batch's ``d``, known
        when tracing); smaller ones take ``"eigh"`` (on a CPU a power step and QR is no cheaper
        than float64 ``eigh`` below ~100: docs/update_rules.md).

    Returns:
      ``Q [B, d, d]``, ``w [B, d]``, ``kind [B]`` int32: KEPT (not selected), SKIPPED, POWER_QR,
      EIGH (attempted; a failed ``eigh`` keeps the basis) or NON_FINITE.
    """
    if refresh not in REFRESHES:
        raise ValueError(f"`refresh` must be one of {REFRESHES}; got {refresh!r}.")
    blocks = tf.convert_to_tensor(blocks, tf.float32)
    mask = tf.convert_to_tensor(mask, tf.float32)
    q_in_use = tf.convert_to_tensor(q_in_use, tf.float32)
    w_in_use = tf.convert_to_tensor(w_in_use, tf.float32)
    selected = tf.convert_to_tensor(selected, tf.bool)
    kept = tf.fill(tf.shape(selected), KEPT)
    size = int(blocks.shape[-1])
    if refresh == "eigh" or size == 1 or size < min_size:  # 1×1 blocks: the basis is 1
        q, w = eigh_selected(blocks, mask, q_in_use, w_in_use, selected, tie_break)
        return q, w, tf.where(selected, EIGH, kept)

    def renewed(blocks, mask, q_old, w_old, selected, gather):
        # A non-finite factor keeps its basis: LAPACK's eigh raises on NaN, so it never sees one
        # (the identity stands in; its result is discarded).
        usable = tf.reduce_all(tf.math.is_finite(blocks), axis=[1, 2])
        blocks = tf.where(lean.per_block(usable, 3), blocks, lean.eye(size, blocks.dtype))
        selected = selected & usable
        never = tf.reduce_all(tf.equal(w_old * mask, 0.0), axis=1)
        if gather:
            # The power step only where there is a basis to start from: at the first refresh
            # (every block, from the identity) it would be computed and thrown away. The others
            # get residual and drift +inf: neither accepted nor skipped.
            tried = tf.where(selected & ~never)  # [K, 1]
            q_t, w_t, residual_t, drift_t = power_qr_step(
                tf.gather_nd(blocks, tried), tf.gather_nd(mask, tried), tf.gather_nd(q_old, tried),
                tie_break)
            inf = tf.fill(tf.shape(selected), float("inf"))
            q_p = tf.tensor_scatter_nd_update(q_old, tried, q_t)
            w_p = tf.tensor_scatter_nd_update(w_old, tried, w_t)
            residual = tf.tensor_scatter_nd_update(inf, tried, residual_t)
            drift = tf.tensor_scatter_nd_update(inf, tried, drift_t)
        else:
            q_p, w_p, residual, drift = power_qr_step(blocks, mask, q_old, tie_break)
        finite = tf.logical_and(tf.reduce_all(tf.math.is_finite(q_p), axis=[1, 2]),
                                tf.reduce_all(tf.math.is_finite(w_p), axis=1))
        # NaN compares False: a non-finite step is neither skipped nor accepted.
        skip = selected & ~never & (drift < drift_tolerance)
        accept = selected & ~never & ~skip & finite & (residual <= tolerance)
        full = selected & ~skip & ~accept
        q = tf.where(lean.per_block(accept, 3), q_p, q_old)
        w = tf.where(lean.per_block(accept, 2), w_p, w_old)
        q, w = eigh_selected(blocks, mask, q, w, full, tie_break)
        kind = tf.where(skip, SKIPPED, tf.where(accept, POWER_QR, tf.where(full, EIGH, KEPT)))
        return q, w, tf.where(usable, kind, NON_FINITE)

    if _keras_compat.in_xla_context():  # static shapes: every block, when one is selected
        return tf.cond(tf.reduce_any(selected),
                       lambda: renewed(blocks, mask, q_in_use, w_in_use, selected, False),
                       lambda: (q_in_use, w_in_use, kept))
    due = tf.where(selected)  # [K, 1]
    q, w, kind = renewed(tf.gather_nd(blocks, due), tf.gather_nd(mask, due),
                         tf.gather_nd(q_in_use, due), tf.gather_nd(w_in_use, due),
                         tf.ones(tf.shape(due)[:1], tf.bool), True)
    return (tf.tensor_scatter_nd_update(q_in_use, due, q),
            tf.tensor_scatter_nd_update(w_in_use, due, w),
            tf.tensor_scatter_nd_update(kept, due, kind))


#: Padding of the last block, as a share of the ``nb·d`` rows a padded product would cover, above
#: which :func:`_rows_by_blocks` and :func:`_columns_by_blocks` multiply that block at its true
#: size instead (a bias row is a whole 128-block of its own when the inputs are 128·k wide).
#: Measured on this CPU (``Qᵀx``, split 128): 0.44–0.51× for 2 blocks with a short last one,
#: 0.78–0.83× for 3; above, the concatenation costs about what the padding does.
RAGGED_PADDING = 1 / 8


def _rows_by_blocks(q, x, transpose):
    """``Q x`` (``Qᵀ x`` when ``transpose``) for a block-diagonal ``Q`` (``[nb, d, d]``, identity
    on the padding of the last block) and ``x`` ``[n, m]`` with ``n ≤ nb·d``: one batched product
    on ``x``'s rows cut into ``d``-blocks, the padding rows of the last block zero; where that
    padding is over :data:`RAGGED_PADDING` of the product, the full blocks' batched product and
    the last block's true ``[r, r]`` part by itself. 1×1 blocks hold the basis 1: ``x`` as it
    is. A stack of ``L`` such products at once: ``q`` ``[L, nb, d, d]`` and ``x`` ``[L, n, m]``
    (one leading axis, the same on both; see :func:`rotate_in`)."""
    nb, d = int(q.shape[-3]), int(q.shape[-1])
    if d == 1:
        return x
    n = int(x.shape[-2])
    pad = nb * d - n
    if pad > RAGGED_PADDING * nb * d:
        full, rest = divmod(n, d)
        parts = [_rows_by_full_blocks(q, x, full, transpose)] if full else []
        last = q[..., full, :rest, :rest]
        tail = x[..., full * d:, :]
        parts.append(last * tail if rest == 1 else
                     tf.linalg.matmul(last, tail, transpose_a=transpose))
        return parts[0] if len(parts) == 1 else tf.concat(parts, -2)
    if pad:
        x = tf.pad(x, [[0, 0]] * (x.shape.rank - 2) + [[0, pad], [0, 0]])
    y = _rows_by_full_blocks(q, x, nb, transpose)
    return y[..., :n, :] if pad else y


def _rows_by_full_blocks(q, x, full, transpose):
    """:func:`_rows_by_blocks` on the first ``full`` blocks of ``q`` and ``full·d`` rows of
    ``x``: ``[(L,) full·d, m]``; one block is a 2-D product (~3x cheaper than a batch of one on
    this CPU). Slices only where a part is left out."""
    nb, d = int(q.shape[-3]), int(q.shape[-1])
    lead = x.shape[:-2].as_list()
    if int(x.shape[-2]) != full * d:
        x = x[..., :full * d, :]
    if full == 1:
        return tf.linalg.matmul(q[..., 0, :, :], x, transpose_a=transpose)
    q = q if full == nb else q[..., :full, :, :]
    y = tf.linalg.matmul(q, tf.reshape(x, lead + [full, d, -1]), transpose_a=transpose)
    return tf.reshape(y, lead + [full * d, -1])


def _columns_by_blocks(x, q, transpose):
    """``x Q`` (``x Qᵀ`` when ``transpose``): :func:`_rows_by_blocks` on ``x``'s columns."""
    nb, d = int(q.shape[-3]), int(q.shape[-1])
    if d == 1:
        return x
    n = int(x.shape[-1])
    pad = nb * d - n
    if pad > RAGGED_PADDING * nb * d:
        full, rest = divmod(n, d)
        parts = [_columns_by_full_blocks(x, q, full, transpose)] if full else []
        last = q[..., full, :rest, :rest]
        tail = x[..., full * d:]
        parts.append(tail * last if rest == 1 else
                     tf.linalg.matmul(tail, last, transpose_b=transpose))
        return parts[0] if len(parts) == 1 else tf.concat(parts, -1)
    if pad:
        x = tf.pad(x, [[0, 0]] * (x.shape.rank - 1) + [[0, pad]])
    y = _columns_by_full_blocks(x, q, nb, transpose)
    return y[..., :n] if pad else y


def _columns_by_full_blocks(x, q, full, transpose):
    """:func:`_columns_by_blocks` on the first ``full`` blocks: ``[(L,) m, full·d]``."""
    nb, d = int(q.shape[-3]), int(q.shape[-1])
    lead = x.shape[:-2].as_list()
    if int(x.shape[-1]) != full * d:
        x = x[..., :full * d]
    if full == 1:
        return tf.linalg.matmul(x, q[..., 0, :, :], transpose_b=transpose)
    q = q if full == nb else q[..., :full, :, :]
    rows = tf.reshape(x, lead + [-1, full, d])
    equation = "mbj,bij->mbi" if transpose else "mbi,bij->mbj"
    y = tf.einsum(equation if not lead else equation.replace("m", "lm").replace(",b", ",lb"),
                  rows, q)
    return tf.reshape(y, lead + [-1, full * d])


def rotate_in(matrix, q_a, q_g):
    """``Q_Aᵀ M Q_G``: a block's ``[a_dim, g_dim]`` gradient matrix in its eigenbases
    (``q_a`` ``[nb_a, d_a, d_a]``, ``q_g`` ``[nb_g, d_g, d_g]``, columns the eigenvectors, identity
    on padding). The transposes are the products' own (no copy of the bases), and a side of 1×1
    blocks (an embedding's diagonal A) is skipped: its basis is 1. Also ``L`` blocks of one
    shape at once: ``matrix`` ``[L, a_dim, g_dim]``, ``q_a`` ``[L, nb_a, d_a, d_a]``, ``q_g``
    ``[L, nb_g, d_g, d_g]`` (the same products, batched: one op where ``L`` were)."""
    return _columns_by_blocks(_rows_by_blocks(q_a, matrix, transpose=True), q_g, transpose=False)


def rotate_out(matrix, q_a, q_g):
    """``Q_A Δ' Q_Gᵀ``: a step in the eigenbases back to the block's coordinates (shapes as
    :func:`rotate_in`)."""
    return _columns_by_blocks(_rows_by_blocks(q_a, matrix, transpose=False), q_g, transpose=True)


def basis_change(q_old, q_new):
    """``R = Q_oldᵀ Q_new`` per diagonal block (``[nb, d, d]``): coordinates in the old basis →
    coordinates in the new one are ``Rᵀ x``."""
    return tf.linalg.matmul(q_old, q_new, transpose_a=True)


def rotate_first_moment(m, r_a, r_g, a_dim, g_dim):
    """``R_Aᵀ m R_G``: a first moment ``[a_dim, g_dim]`` kept in the old bases, in the new ones
    (exact: the first moment is linear in the gradient). ``r_a`` or ``r_g`` None: that side is
    not rotated (R = I: a side kept as its diagonal, whose basis is 1)."""
    left = m if r_a is None else BlockDiagonal(tf.linalg.matrix_transpose(r_a), a_dim).matmul(m)
    return left if r_g is None else BlockDiagonal(r_g, g_dim).rmatmul(left)


def rotate_second_moment(v, r_a, r_g, a_dim, g_dim):
    """``(R_A∘R_A)ᵀ v (R_G∘R_G)``: the diagonal second moment ``[a_dim, g_dim]`` carried into the
    new bases, entry ``(i, j) = Σ_kl R_A[k,i]² v[k,l] R_G[l,j]²`` (the diagonal of
    ``Rᵀ diag(v) R`` on each side: the old coordinates treated as uncorrelated). It stays ≥ 0
    and keeps the total ``Σ v`` (the columns of an orthogonal R have unit norm). ``r_a`` or
    ``r_g`` None: that side is not rotated, as :func:`rotate_first_moment`."""
    left = v if r_a is None else BlockDiagonal(
        tf.linalg.matrix_transpose(tf.square(r_a)), a_dim).matmul(v)
    return left if r_g is None else BlockDiagonal(tf.square(r_g), g_dim).rmatmul(left)
