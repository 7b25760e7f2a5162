"""Adam for the variables without a block (the eigenbasis rule's first-order path): the
moments and direction of one variable or a stack of them (:func:`adam_moments`), and the
variables of one shape stepped as one stack (:func:`stacked_adam_directions`)."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["adam_moments", "stacked_adam_directions"]


def adam_moments(gradient, m_old, v_old, ok, adam):
    """AdamW's moments and direction for the variables without a block (one variable, or a stack
    of them): ``(m, v, m̂ / (√v̂ + ε))``. ``ok`` False (a skipped step): the moments as they were
    (the caller discards the step). ``adam``: ``(1 − β1ᵗ, 1 − β2ᵗ, ε, β1, 1 − β1, β2, 1 − β2)``."""
    correction_1, correction_2, epsilon, b1, b1c, b2, b2c = adam
    m = b1 * m_old + b1c * gradient
    v = b2 * v_old + b2c * tf.square(gradient)
    if ok is not None:
        m, v = tf.where(ok, m, m_old), tf.where(ok, v, v_old)
    return m, v, (m / correction_1) / (tf.sqrt(v / correction_2) + epsilon)


def stacked_adam_directions(step, grads, variables, skip, adam):
    """Adam's direction ``m̂ / (√v̂ + ε)`` for the variables without a block whose dense
    float32 gradients share a shape with another's (a network's normalization scales and
    offsets), each such group as one stack: ``{position in variables: direction}``. The
    moments are the optimizer's own slots, those ``update_step``'s AdamW path keeps, updated
    here as it would (``step.ok`` False: unchanged); ``update_step`` then adds the weight decay and
    the rate. The same values as per variable, with one set of elementwise ops per group
    instead of per variable (ResNet-50's 106 BatchNormalization vectors: ~14 ops each fewer
    to trace and run). A variable alone of its shape is left to ``update_step``.

    ``step``: the :class:`~thor_tf.rules.step.Step` (its ``slot`` holds the moments);
    ``skip``: positions already preconditioned; ``adam``: ``(1 − β1ᵗ, 1 − β2ᵗ, ε, β1,
    1 − β1, β2, 1 − β2)`` as float32 tensors."""
    groups = {}
    for k, (g, v) in enumerate(zip(grads, variables)):
        if (k in skip or g is None or isinstance(g, tf.IndexedSlices)
                or g.dtype != tf.float32 or tf.as_dtype(v.dtype) != tf.float32
                or not g.shape.is_fully_defined()
                or getattr(v, "overwrite_with_gradient", False)):
            continue
        groups.setdefault(tuple(g.shape), []).append(k)
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        m_vars = [step.slot("adam_m", variables[k]) for k in members]
        v_vars = [step.slot("adam_v", variables[k]) for k in members]
        g = tf.stack([grads[k] for k in members])
        m_old = tf.stack([tf.convert_to_tensor(x) for x in m_vars])
        v_old = tf.stack([tf.convert_to_tensor(x) for x in v_vars])
        m, v, direction = adam_moments(g, m_old, v_old, step.ok, adam)
        for var, value in zip(m_vars, tf.unstack(m)):
            var.assign(value)
        for var, value in zip(v_vars, tf.unstack(v)):
            var.assign(value)
        out.update(zip(members, tf.unstack(direction)))
    return out
