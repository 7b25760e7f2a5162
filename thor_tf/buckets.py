"""Size buckets: the diagonal blocks of several factors batched by block size, shared by the
update rules (one batched Cholesky or ``eigh`` per bucket instead of one per factor).

Blocks of sizes within 0.75× of a larger one are zero-padded to it (:func:`size_buckets`); a mask
marks each block's true diagonal entries (:func:`batched_layout`); :func:`per_size_bucket` runs a
function once per bucket and hands every factor its slice back.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["batched_layout", "pad_blocks", "per_size_bucket", "size_buckets"]


def size_buckets(sizes, ratio: float = 0.75):
    """``{bucket size: [block sizes]}``: which block sizes share one batched inversion.

    Each size joins the largest size ``b`` not yet placed with ``d >= ratio·b`` and is padded to
    ``b`` (identity on the padding, so the inverse's top-left block is exact): fewer batches, each
    a handful of ops to trace, for at most ``(1/ratio)³`` (2.4×) the flops of a padded block.
    """
    buckets, left = {}, sorted(set(int(d) for d in sizes), reverse=True)
    while left:
        top = left[0]
        buckets[top] = [d for d in left if d >= ratio * top]
        left = [d for d in left if d < ratio * top]
    return buckets


def batched_layout(factors, size: int):
    """Where the blocks of several factors sit in one ``[B, size, size]`` batch.

    Args:
      factors: per factor ``(owner, nb, d, dim)``: its owner's position (e.g. the layer), its
        number of diagonal blocks ``nb`` of size ``d <= size``, its true dimension ``dim``.
      size: the batch's block size ``S`` (blocks of size ``d < S`` are padded to it by the caller).

    Returns:
      ``(owner [B] int32, mask [B, S] float32, counts)`` as NumPy arrays: each block's owner, 1 on
      the block's true diagonal entries (inside ``d`` and before ``dim``) and 0 on padding, and
      each factor's ``nb`` (to split the batch back).
    """
    owners, rows, counts = [], [], []
    for owner, nb, d, dim in factors:
        entries = np.arange(nb * d).reshape(nb, d) < dim
        rows.append(np.pad(entries, [(0, 0), (0, size - d)]))
        owners.extend([owner] * nb)
        counts.append(nb)
    return (np.asarray(owners, np.int32), np.concatenate(rows).astype(np.float32), counts)


def pad_blocks(blocks, size):
    """``[nb, d, d]`` zero-padded to ``[nb, size, size]``."""
    blocks = tf.convert_to_tensor(blocks)
    pad = size - int(blocks.shape[-1])
    return tf.pad(blocks, [[0, 0], [0, pad], [0, pad]]) if pad else blocks


def _pad_to(tensor, size):
    """``[nb, d, d]`` or ``[nb, d]`` zero-padded to ``size`` on its block axes."""
    tensor = tf.convert_to_tensor(tensor)
    pad = size - int(tensor.shape[1])
    if not pad:
        return tensor
    return tf.pad(tensor, [[0, 0]] + [[0, pad]] * (tensor.shape.rank - 1))


def per_size_bucket(factors, dims, held, fn):
    """Run ``fn`` once per bucket of block sizes (:func:`size_buckets`) over the diagonal blocks
    of several factors, and hand each factor its part back.

    Args:
      factors: per factor its blocks ``[nb, d, d]``; dims: per factor its true dimension.
      held: per factor a tuple of tensors in use with the same leading ``[nb, d]`` axes (inverses
        ``[nb, d, d]``, eigenvalues ``[nb, d]``), padded alongside the blocks.
      fn: ``fn(blocks [B, S, S], mask [B, S], owner [B], held)`` → a tuple of ``[B, S, ...]``
        results, ``owner`` the factor of each block (see :func:`batched_layout`).

    Returns:
      Per factor the tuple of its results, sliced back to its block size.
    """
    sizes = [int(f.shape[-1]) for f in factors]
    out = [None] * len(factors)
    for size, joined in sorted(size_buckets(sizes).items()):
        members = [n for n, d in enumerate(sizes) if d in joined]
        owner, mask, counts = batched_layout(
            [(n, int(factors[n].shape[0]), sizes[n], dims[n]) for n in members], size)
        blocks = tf.concat([pad_blocks(factors[n], size) for n in members], axis=0)
        padded = tuple(tf.concat([_pad_to(held[n][i], size) for n in members], axis=0)
                       for i in range(len(held[members[0]])))
        results = fn(blocks, mask, owner, padded)
        parts = [tf.split(r, counts) for r in results]
        for k, n in enumerate(members):
            d = sizes[n]
            if d == size:
                # Not padded (most blocks: the bucket's own size): no slice to trace. ResNet-50
                # has 108 such factors with two results each, 4 ops a slice.
                out[n] = tuple(p[k] for p in parts)
                continue
            out[n] = tuple(p[k][:, :d, :d] if p[k].shape.rank == 3 else p[k][:, :d]
                           for p in parts)
    return out
