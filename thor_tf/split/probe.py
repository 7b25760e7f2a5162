"""Full Kronecker factors of a wrapped model's blocks on given batches, outside the train step.

Training computes only the diagonal blocks a split keeps, inside the traced step. Calibrating
the split needs the whole factors of a batch or two: this runs the model's forward pass with the
layer hooks on (:class:`thor_tf.capture.CaptureStore`), differentiates the compiled loss with
respect to the observed pre-activations, and forms each block's ``A`` and ``G``
([a_dim, a_dim] and [g_dim, g_dim], float64 NumPy) from the records, as a refresh would with no
split. Nothing is trained: the weights, the optimizer and the model's other state are untouched
(:func:`untouched`).

Conventions: the factors' overall scale is left as the loss gives it (``G`` is not multiplied by
the number of loss terms): the calibration's measures are invariant to a factor's scale. A
block without a record on a batch (a layer the batch did not reach) is left out of that batch.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from thor_tf import loss_terms

__all__ = ["batch_factors", "untouched"]


@contextlib.contextmanager
def untouched(model):
    """Run passes of ``model`` in training mode and leave no trace of them: its non-trainable
    variables (BatchNormalization's moving statistics, dropout's seed states) are restored after,
    and the loss terms the passes recorded for THOR's step are dropped. A run calibrated on the
    way then trains as the same run without the calibration would."""
    variables = list(model.non_trainable_variables)
    saved = [v.numpy() for v in variables]
    try:
        yield
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)
        loss_terms.clear()


def batch_factors(model, batches) -> list:
    """``[{block name: (A, G)}]``, one dict per ``(x, y)`` batch of ``batches``.

    Args:
      model: a compiled model returned by :func:`thor_tf.wrap` (``model.thor`` is its engine).
      batches: iterable of ``(x, y)`` (arrays or tensors); ``y`` may be None for a model whose
        compiled loss takes none.

    Returns:
      list of dicts of ``(A [a_dim, a_dim], G [g_dim, g_dim])`` float64 arrays. An Embedding's
      ``A`` (diagonal by structure) is its ``[V, V]`` diagonal matrix only when V <= 4,096, else
      None (it is never split).
    """
    with untouched(model):
        return _batch_factors(model, batches)


def _batch_factors(model, batches):
    engine = model.thor
    names = [b.name for b in engine.blocks]
    out = []
    for x, y in batches:
        with tf.GradientTape() as tape:
            with engine.store.step():
                y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        records = engine.store.take(names)
        zs = [r.z for name in names for r in records.get(name, [])]
        z_grads = tape.gradient(loss, zs)
        factors, k = {}, 0
        for block in engine.blocks:
            recs = records.get(block.name, [])
            gs = z_grads[k:k + len(recs)]
            k += len(recs)
            if not recs or any(g is None for g in gs):
                continue
            fixed_a = block.split_sizes(1 << 30)[0] == 1 and block.a_dim > 1
            if fixed_a:
                a = None if block.a_dim > 4096 else np.diag(
                    np.asarray(block.factor_a(recs, None), np.float64).reshape(-1))
            else:
                a = np.asarray(block.factor_a(recs, None)[0], np.float64)
            g = np.asarray(block.factor_g(list(gs), None)[0], np.float64)
            factors[block.name] = (a, g)
        out.append(factors)
    return out
