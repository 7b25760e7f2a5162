"""The first-order baselines as every study builds them: one recipe per optimizer, Keras' own
optimizers, under the standard schedule (:func:`warmup_cosine`: Keras' ``CosineDecay`` with a
linear warmup).

* ``sgd``: SGD with momentum 0.9;
* ``adam``: Adam with ``betas``;
* ``adamw``: AdamW with ``betas`` and decoupled decay ``weight_decay``;
* ``muon``: Keras' Muon (>= 3.10) with decay ``weight_decay``; the variables it does not
  orthogonalize (not 2-D, embeddings, and the layer ``head``) take its AdamW step with ``betas``
  and the same decay;
* ``riemannian``: :class:`RiemannianAdamW` for LoRA adapters (Zhang & Pilanci 2024, "Riemannian
  Preconditioned LoRA"): with Keras' shapes ``a [in, r]``, ``b [r, out]`` (an EinsumDense's ``a``
  reshaped to ``[prod(kernel_shape[:-1]), r]`` as Keras does) each pair's gradients become
  ``grad_a (b bᵀ + δI)⁻¹`` and ``(aᵀa + δI)⁻¹ grad_b`` before AdamW's step (other variables:
  plain AdamW).

AdamW and Muon decay the tensors of rank >= 2 only (kernels and embeddings, not biases or
normalization scales and offsets: nanoGPT's rule). ``clipnorm``: a global-norm clip of the
gradients, or None.
"""

from __future__ import annotations

import functools

NAMES = ("sgd", "adam", "adamw", "muon", "riemannian")
RIEMANNIAN_DELTA = 1e-6
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
    if name in ("adamw", "riemannian"):
        cls = keras.optimizers.AdamW if name == "adamw" else riemannian_adamw_class()
        opt = cls(schedule, weight_decay=weight_decay, beta_1=b1, beta_2=b2, **clip)
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


def riemannian_precondition(grad_a, grad_b, a, b, delta=RIEMANNIAN_DELTA):
    """``(grad_a (b bᵀ + δI)⁻¹, (aᵀa + δI)⁻¹ grad_b)`` for one LoRA pair with Keras' shapes
    ``a [..., r]`` (reshaped to ``[prod(...), r]``) and ``b [r, out]``; ``grad_a`` keeps its shape.
    Any backend tensors or NumPy arrays (the dtype of ``a``)."""
    from keras import ops

    shape_a = ops.shape(a)
    r = shape_a[-1]
    a2 = ops.reshape(a, (-1, r))
    ga2 = ops.reshape(grad_a, (-1, r))
    eye = ops.eye(r, dtype=a2.dtype)
    p_a = ops.matmul(b, ops.transpose(b)) + delta * eye   # [r, r], symmetric
    p_b = ops.matmul(ops.transpose(a2), a2) + delta * eye  # [r, r], symmetric
    new_ga = ops.transpose(ops.linalg.solve(p_a, ops.transpose(ga2)))  # ga · p_a⁻¹
    new_gb = ops.linalg.solve(p_b, grad_b)
    return ops.reshape(new_ga, shape_a), new_gb


def lora_pairs(variables):
    """``[(index of a, index of b), ...]``: ``lora_kernel_a`` / ``lora_kernel_b`` of one layer."""
    found = {}
    for i, v in enumerate(variables):
        parent, _, leaf = v.path.rpartition("/")
        if leaf in ("lora_kernel_a", "lora_kernel_b"):
            found.setdefault(parent, {})[leaf[-1]] = i
    return [(p["a"], p["b"]) for p in found.values() if "a" in p and "b" in p]


@functools.cache
def riemannian_adamw_class():
    import keras

    class RiemannianAdamW(keras.optimizers.AdamW):
        """AdamW on the Riemannian-preconditioned gradients of each LoRA pair (found by the
        variable names ``lora_kernel_a`` / ``lora_kernel_b`` of one layer); other variables get
        plain AdamW."""

        def __init__(self, *args, delta=RIEMANNIAN_DELTA, **kwargs):
            super().__init__(*args, **kwargs)
            self.delta = float(delta)

        def precondition(self, grads, variables):
            grads = list(grads)
            for i, j in lora_pairs(variables):
                if grads[i] is None or grads[j] is None:
                    continue
                grads[i], grads[j] = riemannian_precondition(
                    grads[i], grads[j], variables[i].value, variables[j].value, self.delta)
            return grads

        def apply(self, grads, trainable_variables=None):
            variables = list(trainable_variables if trainable_variables is not None
                             else self._trainable_variables)
            return super().apply(self.precondition(grads, variables), trainable_variables)

        def get_config(self):
            return {**super().get_config(), "delta": self.delta}

    return RiemannianAdamW
