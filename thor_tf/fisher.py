"""Which Fisher: how the per-example output gradients ``g = dℓ/dz`` behind G are obtained.

* ``empirical`` (THOR's choice): ``g`` comes from the training loss with the data's labels, taken
  from the same backward pass as the parameter gradients. Keras reduces the loss (by default the
  mean over its terms: the examples of a classifier, the B·T tokens of a language model, see
  :mod:`thor_tf.loss_terms`) and divides it by the number of replicas, and a loss-scaling
  optimizer multiplies it; :func:`term_scale` undoes all three so that ``G`` is the mean of
  per-term outer products. With sample weights, ``g`` carries its term's weight ``w``.
* ``sampled`` (K-FAC's true Fisher): targets are drawn from the model's own predictive
  distribution (categorical for softmax cross-entropy; Gaussian for mean squared error) and
  ``g = dℓ(y_sampled)/dz`` from a second backward pass, taken only at cadence points.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

_CATEGORICAL = {"sparse_categorical_crossentropy": "sparse", "categorical_crossentropy": "dense"}
_MSE = {"mse", "mean_squared_error"}


@dataclass(frozen=True)
class LossSpec:
    """What the sampled Fisher needs to know about the compiled loss."""

    kind: str  # "sparse", "dense" (categorical one-hot) or "mse"
    from_logits: bool = False


def _loss_name_and_logits(loss):
    if isinstance(loss, str):
        return loss, False
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        name = {
            "SparseCategoricalCrossentropy": "sparse_categorical_crossentropy",
            "CategoricalCrossentropy": "categorical_crossentropy",
            "MeanSquaredError": "mean_squared_error",
        }.get(type(loss).__name__, config.get("name"))
        return name, bool(config.get("from_logits", False))
    if callable(loss):
        return getattr(loss, "__name__", None), False
    return None, False


def loss_spec(loss):
    """LossSpec for a compiled loss, or ValueError naming the supported losses."""
    name, from_logits = _loss_name_and_logits(loss)
    if name in _CATEGORICAL:
        return LossSpec(_CATEGORICAL[name], from_logits)
    if name in _MSE:
        return LossSpec("mse")
    raise ValueError(
        f"`fisher='sampled'` needs a loss whose predictive distribution is known: one of "
        f"{sorted(_CATEGORICAL) + sorted(_MSE)} (string or keras.losses object); got {loss!r}. "
        f"Use fisher='empirical' for other losses.")


def loss_reduction(loss):
    """The compiled loss's reduction: 'sum' or 'mean' (Keras' 'sum_over_batch_size' and others)."""
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    return "sum" if reduction == "sum" else "mean"


def term_scale(divisor, loss_scale=None):
    """Factor turning ``dL/dz`` of the reduced, replica-divided, scaled loss into the gradient of
    the (weighted) sum of the replica's loss terms: ``divisor · R / loss_scale``.

    Args:
      divisor: what the loss divided the weighted sum of its terms by (float32 scalar tensor:
        :attr:`thor_tf.loss_terms.LossTerms.scale`).
      loss_scale: what the loss was multiplied by before differentiation, or None.
    """
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    scale = tf.cast(divisor, tf.float32) * float(replicas)
    if loss_scale is not None:
        scale = scale / tf.cast(loss_scale, tf.float32)
    return scale


def sampled_loss(spec: LossSpec, y_pred, seed=None, mask=None):
    """Sum over the batch of the per-term loss at targets sampled from the model.

    Its gradient with respect to each pre-activation ``z`` is ``dℓ(y_sampled)/dz`` of the summed
    terms directly (no reduction to undo). Targets are constants (stop_gradient). ``mask``: the
    valid terms (bool, the per-term losses' shape, e.g. ``[B, T]``): masked terms (padding) are
    left out.
    """
    y_pred = tf.cast(y_pred, tf.float32)
    if spec.kind in ("sparse", "dense"):
        logits = y_pred if spec.from_logits else tf.math.log(tf.maximum(y_pred, 1e-12))
        flat = tf.reshape(logits, [-1, tf.shape(logits)[-1]])
        labels = tf.random.categorical(tf.stop_gradient(flat), 1, dtype=tf.int64)[:, 0]
        labels = tf.reshape(labels, tf.shape(logits)[:-1])
        per_term = keras.losses.sparse_categorical_crossentropy(
            labels, y_pred, from_logits=spec.from_logits)
        if mask is not None and mask.shape.rank == per_term.shape.rank:
            per_term = per_term * tf.cast(mask, per_term.dtype)
        return tf.reduce_sum(per_term)
    # Mean squared error over K outputs is the negative log-likelihood (up to a constant) of a
    # Gaussian with variance K/2, so that is the distribution the targets are drawn from.
    k = tf.cast(tf.shape(y_pred)[-1], tf.float32)
    noise = tf.random.normal(tf.shape(y_pred)) * tf.sqrt(k / 2.0)
    targets = tf.stop_gradient(y_pred + noise)
    return tf.reduce_sum(keras.losses.mean_squared_error(targets, y_pred))
