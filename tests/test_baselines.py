"""experiments.baselines: the first-order baselines' one recipe and schedule."""

import math

import keras
import numpy as np
import pytest

from experiments import baselines


def _model():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="predictions")(x))


def _reference_schedule(step, lr, total, warmup, floor_fraction):
    """Linear warmup from 0, then cosine from lr to floor_fraction·lr, in float64."""
    if step < warmup:
        return lr * step / warmup
    t = min(step - warmup, total - warmup) / (total - warmup)
    return lr * (floor_fraction + (1 - floor_fraction) * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("total,warmup,floor", [(200, None, 0.0), (100, 7, 0.1), (9, None, 0.0)])
def test_warmup_cosine_is_the_standard_schedule(total, warmup, floor):
    schedule = baselines.warmup_cosine(0.01, total, warmup, floor)
    w = max(1, round(0.05 * total)) if warmup is None else warmup
    for step in (0, 1, w - 1, w, w + 1, total // 2, total - 1, total, total + 5):
        np.testing.assert_allclose(float(schedule(step)),
                                   _reference_schedule(step, 0.01, total, w, floor),
                                   rtol=1e-5, atol=1e-9, err_msg=f"step {step}")


def test_decay_falls_on_kernels_only_and_muon_leaves_the_head_to_its_adamw():
    model = _model()
    for name in ("adamw", "muon"):
        opt = baselines.first_order(name, 1e-3, model, weight_decay=0.1, betas=(0.9, 0.99),
                                    clipnorm=1.0, head="predictions")
        decayed = {v.path for v in model.trainable_variables if opt._use_weight_decay(v)}
        assert decayed == {"hidden/kernel", "predictions/kernel"}, (name, decayed)
        assert opt.global_clipnorm == 1.0
    muon = baselines.first_order("muon", 1e-3, model, 0.1, (0.9, 0.99), head="predictions")
    assert (muon.adam_beta_1, muon.adam_beta_2) == (0.9, 0.99)
    assert muon.exclude_layers == ["predictions"]
    assert muon.weight_decay == muon.adam_weight_decay == 0.1
    adamw = baselines.first_order("adamw", 1e-3, model, 0.1, (0.9, 0.99))
    assert (adamw.beta_1, adamw.beta_2, adamw.weight_decay) == (0.9, 0.99, 0.1)
    sgd = baselines.first_order("sgd", 1e-3, model, 0.1)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == 0.9 and not sgd.weight_decay
    adam = baselines.first_order("adam", 1e-3, model, 0.1)
    assert type(adam) is keras.optimizers.Adam and not adam.weight_decay
    with pytest.raises(ValueError, match="allowed: sgd, adam, adamw, muon"):
        baselines.first_order("lion", 1e-3, model, 0.1)
