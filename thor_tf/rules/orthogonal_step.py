"""The eigenbasis rule's orthogonal step (``step="orthogonal"``): each block's update replaced by
its Newton–Schulz orthogonal factor at a chosen scale, many updates in few batched iterations.
A pure function of tensors (no rule state), called inside the traced step.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf.buckets import size_buckets
from thor_tf.rules.eigenbasis_ops import newton_schulz_many

__all__ = ["orthogonalized"]


def orthogonalized(updates, scale="graft", rms=0.2):
    """Each ``[a, g]`` update's Newton–Schulz orthogonal factor ``O``
    (:func:`thor_tf.rules.eigenbasis_ops.newton_schulz`), scaled to the update's Frobenius
    norm (``scale="graft"``: the step's size stays Adam's, its singular values equal) or to
    ``O·rms·√max(a, g)`` (``"rms"``: Muon's RMS, Moonlight's rule).

    One batched iteration per bucket of sizes, not per shape: the updates are grouped by
    their short and long sides (:func:`thor_tf.buckets.size_buckets` on each), taken in the
    bucket's majority orientation and zero-padded to its shape. Zero rows and columns stay
    zero through the iteration and do not change a matrix's norm, so padding changes nothing
    but round-off; a model's many small layers (a Transformer's query/key/value/output, a
    few shapes each) then cost a few batched products instead of a few per shape (the
    iteration's ~30 ops each); evaluated through ``eigh``, the gain's scalar recursion runs
    once for all buckets
    (:func:`thor_tf.rules.eigenbasis_ops.newton_schulz_many`)."""
    tall = [int(u.shape[0]) > int(u.shape[1]) for u in updates]
    short = [int(min(u.shape)) for u in updates]
    long = [int(max(u.shape)) for u in updates]
    heights, widths = size_buckets(short), size_buckets(long)
    to_bucket = lambda buckets, d: next(b for b, sizes in buckets.items() if d in sizes)
    groups = {}
    for n in range(len(updates)):
        key = (to_bucket(heights, short[n]), to_bucket(widths, long[n]))
        groups.setdefault(key, []).append(n)
    out = [None] * len(updates)
    buckets = sorted(groups.items())
    # Each bucket is iterated in its members' majority orientation (Newton–Schulz takes a
    # tall matrix as it is): only a member of the other orientation is transposed, in and
    # out. A Transpose of a small matrix costs about what a product does on this CPU (the
    # char GPT's step had 22 of them, ~1.5 ms).
    bucket_tall = [2 * sum(tall[n] for n in members) > len(members) for _, members in buckets]
    oriented = [[updates[n] if tall[n] == t else tf.transpose(updates[n]) for n in members]
                for (_, members), t in zip(buckets, bucket_tall)]
    # A bucket of one matrix is that matrix, unpadded: 2-D products are ~3x cheaper than a
    # batch of one on this CPU (a small model's buckets are often single).
    stacks = []
    for ((s_size, l_size), members), t, mats in zip(buckets, bucket_tall, oriented):
        rows, cols = (l_size, s_size) if t else (s_size, l_size)
        stacks.append(mats[0] if len(members) == 1 else tf.stack(
            [tf.pad(m, [[0, rows - int(m.shape[0])], [0, cols - int(m.shape[1])]])
             for m in mats]))
    for (_, members), t, mats, stacked, ortho in zip(buckets, bucket_tall, oriented, stacks,
                                                     newton_schulz_many(stacks)):
        if scale == "graft":
            norm = tf.sqrt(tf.reduce_sum(tf.square(stacked), axis=[-2, -1], keepdims=True))
            o_norm = tf.sqrt(tf.reduce_sum(tf.square(ortho), axis=[-2, -1], keepdims=True))
            ortho = ortho * (norm / (o_norm + 1e-30))
        else:
            rms_scales = [rms * max(int(d) for d in updates[n].shape) ** 0.5 for n in members]
            ortho = ortho * (rms_scales[0] if len(members) == 1 else
                             tf.constant(rms_scales, tf.float32)[:, None, None])
        for n, m, o in zip(members, mats, [ortho] if len(members) == 1 else tf.unstack(ortho)):
            if o.shape != m.shape:
                o = o[:int(m.shape[0]), :int(m.shape[1])]
            out[n] = o if tall[n] == t else tf.transpose(o)
    return out
