"""The eigenbasis rule's orthogonal step (``step="orthogonal"``): each block's update replaced by
its Newton–Schulz orthogonal factor at a chosen scale. A pure function of tensors (no rule
state), called inside the traced step.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf.rules.eigenbasis_ops import newton_schulz_many
from thor_tf.rules.newton_schulz import NS_STEPS

__all__ = ["orthogonalized"]


def orthogonalized(updates, scale="graft", rms=0.2, steps=NS_STEPS, blend=None):
    """Each ``[a, g]`` update's Newton–Schulz orthogonal factor ``O``
    (:func:`thor_tf.rules.eigenbasis_ops.newton_schulz`), scaled to the update's Frobenius
    norm (``scale="graft"``: the step's size stays Adam's, its singular values equal) or to
    ``O·rms·√max(a, g)`` (``"rms"``: Muon's RMS, Moonlight's rule). ``steps``: the iteration's
    count (Muon's 5; fewer leave the smallest singular values short of 1, see
    :class:`thor_tf.rules.Eigenbasis`'s ``newton_schulz_steps``); ``blend``: None or ``(k, w)``,
    the factor ``w·O_steps + (1 − w)·O_k`` (:func:`thor_tf.rules.newton_schulz.
    newton_schulz_many`; ``newton_schulz_steps_end``), scaled as ``O``.

    Each update is iterated on its own, as the 2-D matrix it is (a tall one through the
    products' transpose flags, no transposes), in one call of
    :func:`thor_tf.rules.eigenbasis_ops.newton_schulz_many`. Why not batched: the iteration is
    bound by its products' arithmetic, and on CPU a ``BatchMatMul`` of ``n`` matrices costs
    more than ``n`` independent 2-D products, which the runtime also runs side by side (an
    earlier version zero-padded updates of near sizes into batches: the char GPT's of
    ``experiments/lm.py`` took 10.0 ms against 7.3 ms one by one, ResNet-20's 2.9 against 1.7;
    with oneDNN off 21.8 against 15.7 and 5.1 against 3.8; docs/overhead.md). Padding also
    added work: a ``[129, 128]`` update iterated as ``[129, 129]``."""
    orthos = newton_schulz_many(updates, steps, blend=blend)
    out = []
    for update, ortho in zip(updates, orthos):
        if scale == "graft":
            norm = tf.sqrt(tf.reduce_sum(tf.square(update)))
            o_norm = tf.sqrt(tf.reduce_sum(tf.square(ortho)))
            out.append(ortho * (norm / (o_norm + 1e-30)))
        else:
            out.append(ortho * (rms * max(int(d) for d in update.shape) ** 0.5))
    return out
