"""What a data point of the loss is: the loss's terms, its divisor and its masks.

K-FAC's G is the second moment of the output gradient of one loss *term* (DESIGN §8). A
classifier's loss has one term per example; a language model's Keras loss averages over the B·T
tokens of the batch, a per-pixel loss over B·H·W pixels: each of those is a term. Keras reduces
the per-term values of a ``keras.losses.Loss`` in one place (``reduce_weighted_values``):

    L = Σ_i w_i·ℓ_i / s        s: the divisor

* ``"sum_over_batch_size"`` (Keras' default): ``s`` = the number of values (B·T), or under a
  Keras mask the number of unmasked values;
* ``"mean_with_sample_weight"``: ``s = Σ w`` (mask applied);
* ``"sum"``: ``s = 1``.

THOR needs three things from that (:class:`LossTerms`): the **scale** ``s`` that turns ``dL/dz``
into the gradient of the weighted sum of terms (``g = s·dL/dz``: a per-term gradient, whatever
the reduction), the **count** ``D`` of data points (terms with a nonzero weight and mask: what the
Fisher is an average over) and the **mask** of those terms (padding adds nothing to A, G or the
traces). For a layer with ``R`` valid rows (positions) in the batch, the Fisher per data point is
then ``(R/D)·(A ⊗ G)`` (A, G means over the valid rows): ``R/D`` replaces KFC's ``P`` (rows per
example), see :func:`rows_per_term`. Classification (one term per example, no mask) keeps
``s = D = B`` and ``R/D = P``: the step is what it was.

How THOR learns the terms: the reduction of every ``keras.losses.Loss`` called while a gradient
tape records is observed (:func:`install_observer`: the function Keras reduces with is wrapped; it
returns exactly what Keras' returns) and kept per thread and graph until the optimizer's step
takes it (:func:`take`). That covers ``fit``'s step, a model's own ``train_step`` or
``compute_loss``, a KerasHub task and a custom loop that calls a Keras loss object. A loss written
with raw ops (``tf.reduce_mean``) is not seen: the ``loss_reduction`` option then says what it is
("mean" over the examples of the batch by default).
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import tensorflow as tf

from thor_tf import _keras_compat


class LossTerms(NamedTuple):
    """The terms of one step's loss (this replica's batch).

    ``scale``: float32 scalar, the loss's divisor ``s`` (``g = s·dL/dz``); ``count``: float32
    scalar, ``D`` the data points (terms of nonzero weight); ``mask``: bool ``[B, ...]`` over the
    terms (values' shape, e.g. ``[B, T]``), None when every term counts; ``per_example``: float32
    scalar, terms per example ``τ`` (a constant when the values' shape past the batch is static:
    1 for a per-example loss, T for a per-token one).
    """

    scale: tf.Tensor
    count: tf.Tensor
    mask: Optional[tf.Tensor]
    per_example: tf.Tensor


def per_example(reduction, batch_size):
    """Terms of a loss with one term per example (``loss_reduction`` "mean" or "sum", or a loss
    THOR did not see): ``s = B`` for a mean (1 for a sum), ``D = B``, no mask."""
    batch = tf.cast(batch_size, tf.float32)
    scale = batch if reduction == "mean" else tf.constant(1.0)
    return LossTerms(scale=scale, count=batch, mask=None, per_example=tf.constant(1.0))


def _size(t):
    """float32 number of elements (a constant when the shape is static)."""
    if t.shape.is_fully_defined():
        n = 1
        for d in t.shape:
            n *= int(d)
        return tf.constant(float(n))
    return tf.cast(tf.size(t), tf.float32)


def _broadcast_weight(weight, values):
    """``weight`` expanded or squeezed to ``values``' rank (Keras' squeeze_or_expand_to_same_rank)
    and broadcast to its shape."""
    weight = tf.convert_to_tensor(weight)
    while weight.shape.rank is not None and weight.shape.rank > values.shape.rank \
            and weight.shape[-1] == 1:
        weight = tf.squeeze(weight, -1)
    while weight.shape.rank is not None and weight.shape.rank < values.shape.rank:
        weight = tf.expand_dims(weight, -1)
    return tf.broadcast_to(weight, tf.shape(values))


def from_reduction(values, sample_weight=None, mask=None, reduction="sum_over_batch_size"):
    """:class:`LossTerms` of one Keras reduction (the arguments of ``reduce_weighted_values``,
    before Keras merges ``mask`` into ``sample_weight``), or None when the values are not reduced
    (``reduction`` None or "none") or are a scalar.

    ``values``: the per-term losses ``[B, ...]``; ``sample_weight``: broadcastable to them or
    None; ``mask``: Keras mask of the predictions/values (bool, values' shape) or None.
    """
    if reduction is None or reduction == "none" or values.shape.rank in (None, 0):
        return None
    if reduction == "mean":
        reduction = "sum_over_batch_size"
    values = tf.convert_to_tensor(values)
    total = _size(values)
    if values.shape[1:].is_fully_defined():
        per_example = tf.constant(float(values.shape[1:].num_elements()))
    else:
        per_example = total / tf.cast(tf.shape(values)[0], tf.float32)
    # The Keras mask and the nonzero sample weights, broadcast to the values' shape.
    in_mask = None if mask is None else _broadcast_weight(tf.cast(mask, tf.bool), values)
    weight = None
    if sample_weight is not None:
        weight = tf.cast(_broadcast_weight(sample_weight, values), tf.float32)
    valid = in_mask
    if weight is not None:
        nonzero = tf.not_equal(weight, 0.0)
        valid = nonzero if valid is None else tf.logical_and(valid, nonzero)
    if reduction == "sum":
        scale = tf.constant(1.0)
    elif reduction == "mean_with_sample_weight" and (weight is not None or in_mask is not None):
        masked = tf.ones_like(values, tf.float32) if weight is None else weight
        if in_mask is not None:
            masked = masked * tf.cast(in_mask, tf.float32)
        scale = tf.reduce_sum(masked)
    elif in_mask is not None:  # Keras rescales a mask so that the mean is over the unmasked terms
        scale = tf.reduce_sum(tf.cast(in_mask, tf.float32))
    else:
        scale = total
    count = total if valid is None else tf.reduce_sum(tf.cast(valid, tf.float32))
    return LossTerms(scale=scale, count=count, mask=valid, per_example=per_example)


def combine(terms):
    """One :class:`LossTerms` for a step whose loss reduced several times (a model with several
    outputs: Keras' loss is ``Σ_k weight_k·L_k``): they must agree on the divisor's structure
    (the same values' shape, e.g. one term per example for each output), else ValueError: the
    output gradients mix terms of different sizes and no one scale makes them per-term."""
    terms = [t for t in terms if t is not None]
    if not terms:
        return None
    first = terms[0]
    for other in terms[1:]:
        same_rank = (first.mask is None) == (other.mask is None)
        if not same_rank or _static_terms(first) != _static_terms(other):
            raise ValueError(
                "thor_tf: this step's loss reduces several Keras losses whose terms differ (e.g. "
                "a per-token loss and a per-example loss): THOR cannot tell what one data point "
                "is. Pass loss_reduction='mean' (a mean over the batch's examples) or 'sum' to "
                "thor_tf.wrap / ThorOptimizer to say it.")
    return first


def _static_terms(terms):
    value = tf.get_static_value(terms.per_example)
    return None if value is None else round(float(value), 6)


# -- observing Keras' reduction --------------------------------------------------------------------
class _Records(threading.local):
    def __init__(self):
        self.graph = None
        self.items = []


_RECORDS = _Records()
_INSTALLED = []


def _items():
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if _RECORDS.graph is not graph:
        _RECORDS.graph, _RECORDS.items = graph, []
    return _RECORDS.items


def install_observer():
    """Wrap Keras' ``reduce_weighted_values`` (what every ``keras.losses.Loss`` reduces with) so
    that a reduction made while a gradient tape records is kept for the optimizer's step. The
    wrapper returns exactly what Keras' returns. Idempotent; False when this Keras has no such
    function (then THOR sees no loss and ``loss_reduction`` decides)."""
    if _INSTALLED:
        return True
    try:
        from keras.src.losses import loss as keras_loss
    except ImportError:  # pragma: no cover - a future Keras
        return False
    original = getattr(keras_loss, "reduce_weighted_values", None)
    if original is None:  # pragma: no cover
        return False

    def reduce_weighted_values(values, sample_weight=None, mask=None,
                               reduction="sum_over_batch_size", dtype=None):
        out = original(values, sample_weight=sample_weight, mask=mask, reduction=reduction,
                       dtype=dtype)
        if _keras_compat.tape_could_record():
            try:
                _items().append((values, sample_weight, mask, reduction))
            except Exception:  # pragma: no cover - observing must never break the user's loss
                pass
        return out

    keras_loss.reduce_weighted_values = reduce_weighted_values
    _INSTALLED.append(original)
    return True


def clear():
    """Forget what was observed in this thread and graph (the start of ``fit``'s step)."""
    del _items()[:]


def take():
    """:class:`LossTerms` of the reductions observed since the last take in this thread and graph
    (None if none), which are forgotten. Several reductions must agree (:func:`combine`)."""
    items = _items()
    taken = list(items)
    del items[:]
    return combine([from_reduction(tf.convert_to_tensor(v), w, m, r) for v, w, m, r in taken])


# -- rows of a layer ------------------------------------------------------------------------------
def row_mask(terms, z, g_dim):
    """``[R]`` float32 weights (1 valid, 0 masked) of the rows of one call whose pre-activation is
    ``z`` ``[B, ..., g_dim features]``, or None (every row counts).

    A layer's rows align with the terms when it has as many rows per example as there are terms
    per example (static shapes), e.g. every Dense/EinsumDense/Embedding of a Transformer on
    ``[B, T]`` tokens: row ``(n, t)`` is term ``(n, t)``. Rows that do not align (a pooled head, a
    strided convolution) all count.
    """
    if terms is None or terms.mask is None:
        return None
    mask_shape, z_shape = terms.mask.shape, z.shape
    if not mask_shape[1:].is_fully_defined() or not z_shape[1:].is_fully_defined():
        return None
    per_example_terms = mask_shape[1:].num_elements()
    per_example_rows = z_shape[1:].num_elements() // g_dim
    if per_example_terms != per_example_rows:
        return None
    return tf.reshape(tf.cast(terms.mask, tf.float32), [-1])
