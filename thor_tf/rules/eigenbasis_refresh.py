"""The eigenbasis rule's refresh: new bases from the refreshing blocks' factors, and the moments
carried into them (:meth:`thor_tf.rules.Eigenbasis.refresh` calls :func:`refresh_bases`).

Per refreshing block and side: the split factor's blocks decomposed (one batched ``eigh``, or a
power step and QR from the basis in use, per bucket of block sizes:
:func:`thor_tf.rules.eigenbasis_ops.refresh_selected`); a side split 1 keeps its basis 1 and
takes its diagonal as eigenvalues. Where a basis changed, the moments move with it, with
``R = Q_oldᵀ Q_new`` per block: ``m ← R_Aᵀ m R_G``, ``v ← (R_A∘R_A)ᵀ v (R_G∘R_G)``
(:func:`carried_alone`, or :func:`carried_stacked` for blocks of one shape as one stack).
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf import lean
from thor_tf.buckets import per_size_bucket
from thor_tf.rules.eigenbasis_ops import (basis_change, refresh_selected, rotate_first_moment,
                                          rotate_in, rotate_second_moment)

__all__ = ["carried_alone", "carried_stacked", "refresh_bases"]


def refresh_bases(rule, step, layers, refresh, factors):
    """Write the refreshing ``layers``' new bases and eigenvalues, and their moments carried into
    them, into the layers' state (``rule``: the :class:`~thor_tf.rules.Eigenbasis` with its
    options; ``step``: the :class:`~thor_tf.rules.step.Step`; ``refresh``: per layer a bool;
    ``factors``: per layer ``(A, G)`` blocks)."""
    s = step.state
    factors_flat, dims, held = [], [], []  # per factor: A, G, A, G, ...
    for layer, (fa, fg) in zip(layers, factors):
        state = s.layers[layer.index]
        factors_flat += [fa, fg]
        dims += [layer.block.a_dim, layer.block.g_dim]
        held += [(state.Q_A, state.w_A), (state.Q_G, state.w_G)]
    # A side split 1 (1×1 blocks: a factor kept as its diagonal) is not rotated: its basis is
    # 1 for good and its eigenvalues are its diagonal (:func:`_diagonal_side`), with no
    # decomposition, bucket or moment rotation (ResNet-50's unrotated sides: ~40k blocks).
    out = [_diagonal_side(f, h, refresh[n // 2]) if int(f.shape[-1]) == 1 else None
           for n, (f, h) in enumerate(zip(factors_flat, held))]
    rotated = [n for n, o in enumerate(out) if o is None]
    if rotated:
        flags = tf.stack([refresh[n // 2] for n in rotated])

        def decompose(blocks, mask, owner, in_use):
            q, w, _ = refresh_selected(blocks, mask, in_use[0], in_use[1],
                                       tf.gather(flags, owner), rule.refresh_method,
                                       rule.tie_break, rule.refresh_tolerance,
                                       rule.drift_tolerance, rule.refresh_min_size)
            return q, w

        for n, pair in zip(rotated, per_size_bucket(
                [factors_flat[n] for n in rotated], [dims[n] for n in rotated],
                [held[n] for n in rotated], decompose)):
            out[n] = pair
    new = [(out[2 * k], out[2 * k + 1]) for k in range(len(layers))]
    # Before the first step the moments are their initial zeros, which every rotation keeps:
    # the first refresh (every layer's, from the identity) carries nothing.
    started = step.iterations > 0
    groups = {}
    for n, layer in enumerate(layers):
        groups.setdefault(rule._stack_key(s.layers[layer.index]), []).append(n)
    for members in groups.values():
        helds = [s.layers[layers[n].index] for n in members]
        if len(members) == 1:
            moments = [carried_alone(helds[0], new[members[0]], refresh[members[0]],
                                           started)]
        else:
            moments = carried_stacked(helds, [new[n] for n in members],
                                            [refresh[n] for n in members], started)
        for held, moment, n in zip(helds, moments, members):
            if moment is not None:  # None: neither side rotates, the moments stay
                held.m.assign(moment[0])
                held.v.assign(moment[1])
            for q_var, w_var, (q, w) in ((held.Q_A, held.w_A, new[n][0]),
                                         (held.Q_G, held.w_G, new[n][1])):
                if q is not None:  # None: a diagonal side's basis, 1 for good
                    q_var.assign(q)
                w_var.assign(w)


def carried_alone(held, new, flag, started):
    """``(m, v)`` of one block in its new bases (``new``: ``((q_A, w_A), (q_G, w_G))``), under
    a ``tf.cond``: four block products only where a basis changed."""
    (q_a, _), (q_g, _) = new
    if q_a is None and q_g is None:  # both sides diagonal: R = 1 on both, nothing to carry
        return None
    a_dim, g_dim = int(held.m.shape[0]), int(held.m.shape[1])
    # A block that kept its basis (skipped, or a failed decomposition) has it bit for bit:
    # its R is exactly I (Q_oldᵀ Q_old is I only to round-off, which v would accumulate).
    # A diagonal side (q None) keeps its basis 1: R = 1, no product on that side.
    same_a = None if q_a is None else _unchanged(held.Q_A, q_a)
    same_g = None if q_g is None else _unchanged(held.Q_G, q_g)

    def carried():
        r_a = None if q_a is None else _identity_where(same_a, basis_change(held.Q_A, q_a))
        r_g = None if q_g is None else _identity_where(same_g, basis_change(held.Q_G, q_g))
        m = tf.convert_to_tensor(held.m)
        v = tf.convert_to_tensor(held.v)
        return (rotate_first_moment(m, r_a, r_g, a_dim, g_dim),
                rotate_second_moment(v, r_a, r_g, a_dim, g_dim))

    unchanged = [tf.reduce_all(same) for same in (same_a, same_g) if same is not None]
    changed = tf.logical_not(unchanged[0] if len(unchanged) == 1
                             else tf.logical_and(*unchanged))
    return tf.cond(flag & changed & started, carried,
                   lambda: (tf.identity(held.m), tf.identity(held.v)))

def carried_stacked(helds, new, flags, started):
    """:func:`carried_alone` for ``L`` blocks of one shape (``Eigenbasis._stack_key``) as one stack
    under one ``tf.cond`` (taken where any of them changed its basis): ``R_Aᵀ m R_G`` and
    ``(R_A∘R_A)ᵀ v (R_G∘R_G)`` are :func:`rotate_in` by ``R`` and by ``R∘R``. A block that did
    not change keeps its moments as they are (selected, not rotated by ``I``). A diagonal
    side (its new basis None: 1×1 blocks, basis 1) is not rotated; with both sides diagonal
    the moments stay (``None`` per block)."""
    sides = []  # per side: (old bases, new bases) [L, nb, d, d], or None (diagonal)
    for k, name in ((0, "Q_A"), (1, "Q_G")):
        if new[0][k][0] is None:
            sides.append(None)
            continue
        sides.append((tf.stack([tf.convert_to_tensor(getattr(h, name)) for h in helds]),
                      tf.stack([pair[k][0] for pair in new])))
    if sides == [None, None]:
        return [None] * len(helds)
    m_old = tf.stack([tf.convert_to_tensor(h.m) for h in helds])  # [L, a_dim, g_dim]
    v_old = tf.stack([tf.convert_to_tensor(h.v) for h in helds])
    same = [None if side is None else tf.reduce_all(tf.equal(*side), axis=[-2, -1])
            for side in sides]  # [L, nb]
    unchanged = [tf.reduce_all(x, axis=1) for x in same if x is not None]
    changed = tf.logical_not(unchanged[0] if len(unchanged) == 1
                             else tf.logical_and(*unchanged))
    carry = tf.logical_and(tf.logical_and(tf.stack(flags), changed), started)  # [L]

    def carried():
        # A diagonal side's R is 1 (rotate_in skips 1×1 blocks without a product).
        r_a, r_g = (tf.ones([len(helds), *getattr(helds[0], name).shape]) if side is None
                    else _identity_where(x, basis_change(*side))
                    for side, x, name in zip(sides, same, ("Q_A", "Q_G")))
        m = rotate_in(m_old, r_a, r_g)
        v = rotate_in(v_old, tf.square(r_a), tf.square(r_g))
        keep = carry[:, None, None]
        return tf.where(keep, m, m_old), tf.where(keep, v, v_old)

    m, v = tf.cond(tf.reduce_any(carry), carried, lambda: (m_old, v_old))
    return list(zip(tf.unstack(m), tf.unstack(v)))


def _diagonal_side(factor, held, flag):
    """``(None, w)``: a refresh of a side split 1 (``factor`` ``[n, 1, 1]``, ``held`` its ``(Q,
    w)`` in use): its basis stays 1 (None: nothing to write or rotate) and its eigenvalues are
    its diagonal where the layer refreshes and the entry is finite, those in use elsewhere (what
    a decomposition of 1×1 blocks gives: :func:`thor_tf.rules.eigenbasis_ops.eigh_blocks`)."""
    w = factor[:, :, 0]  # [n, 1]
    return None, tf.where(tf.logical_and(flag, tf.math.is_finite(w)), w, held[1])


def _unchanged(q_old, q_new):
    """``[nb]`` bool: the blocks whose basis is bit for bit the one in use."""
    return tf.reduce_all(tf.equal(q_old, q_new), axis=[1, 2])


def _identity_where(same, r):
    """``r`` (``[nb, d, d]``, or a stack ``[L, nb, d, d]`` with ``same`` ``[L, nb]``) with the
    ``same`` blocks replaced by the identity."""
    mask = lean.per_block(same, 3) if same.shape.rank == 1 else same[..., None, None]
    return tf.where(mask, lean.eye(r.shape[-1], r.dtype), r)
