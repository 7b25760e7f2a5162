"""The first-order baselines as every study builds them: one recipe per optimizer, Keras' own
optimizers, under the standard schedule (:func:`warmup_cosine`: Keras' ``CosineDecay`` with a
linear warmup).

* ``sgd``: SGD with momentum 0.9;
* ``adam``: Adam with ``betas``;
* ``adamw``: AdamW with ``betas`` and decoupled decay ``weight_decay``;
* ``muon``: Keras' Muon (>= 3.10) with decay ``weight_decay``; the variables it does not
  orthogonalize (not 2-D, embeddings, and the layer ``head``) take its AdamW step with ``betas``
  and the same decay.

AdamW and Muon decay the tensors of rank >= 2 only (kernels and embeddings, not biases or
normalization scales and offsets: nanoGPT's rule). ``clipnorm``: a global-norm clip of the
gradients, or None.
"""

from __future__ import annotations

NAMES = ("sgd", "adam", "adamw", "muon")
#: The share of a run spent warming up, as THOR's ``WarmupCosine`` (``warmup_fraction``).
WARMUP_FRACTION = 0.05


def warmup_cosine(lr, total_steps, warmup=None, floor_fraction=0.0):
    """Linear warmup from 0 to ``lr`` over ``warmup`` steps (default ``WARMUP_FRACTION`` of the
    run, at least 1), then cosine to ``floor_fraction·lr`` at ``total_steps``: Keras'
    ``CosineDecay``, the baselines' schedule in every study."""
    import keras

    if warmup is None:
        warmup = max(1, round(WARMUP_FRACTION * total_steps))
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(total_steps - warmup, 1), alpha=floor_fraction,
        warmup_target=float(lr), warmup_steps=warmup)


def first_order(name, schedule, model, weight_decay, betas=(0.9, 0.999), clipnorm=None,
                head=None):
    """The Keras optimizer of baseline ``name`` (one of :data:`NAMES`) for ``model``."""
    import keras

    clip = dict(global_clipnorm=clipnorm) if clipnorm else {}
    b1, b2 = betas
    if name == "sgd":
        return keras.optimizers.SGD(schedule, momentum=0.9, **clip)
    if name == "adam":
        return keras.optimizers.Adam(schedule, beta_1=b1, beta_2=b2, **clip)
    if name == "adamw":
        opt = keras.optimizers.AdamW(schedule, weight_decay=weight_decay, beta_1=b1, beta_2=b2,
                                     **clip)
    elif name == "muon":
        from experiments.cli import require_muon

        require_muon()
        opt = keras.optimizers.Muon(schedule, weight_decay=weight_decay,
                                    adam_weight_decay=weight_decay, adam_beta_1=b1,
                                    adam_beta_2=b2, exclude_layers=[head] if head else None,
                                    **clip)
    else:
        raise ValueError(f"unknown baseline {name!r}; allowed: {', '.join(NAMES)}")
    opt.exclude_from_weight_decay(var_list=[v for v in model.trainable_variables
                                            if len(v.shape) < 2])
    return opt
