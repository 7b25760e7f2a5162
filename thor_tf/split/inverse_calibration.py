"""The seed's calibration: one split dimension of the inverse rule's inverses (the H of THOR).

Training inverts each damped Kronecker factor ``F + d·I`` ([n, n]) only on its diagonal blocks
of ``split_dim`` (:func:`thor_tf.rules.inverse_ops.invert_blocks`). Smaller blocks are faster to
invert but drop more of the factor. Calibration (DESIGN.md §2) measures both effects on the
factors of the model and on the machine that trains, and picks the dimension where they balance:

1. candidates ``1, 16, 32, 64, …`` up to the largest factor dimension
   (:func:`thor_tf.split.crossing.candidates`);
2. information: per factor matrix and candidate the loss ``L = 1 − ‖Â‖₂/‖A‖₂``; the
   *information curve* is, per candidate, the fraction of the model's factor matrices with
   ``L < 1%`` (:func:`thor_tf.split.information.loss_fractions`);
3. speed: ``p_b`` = seconds to invert all the model's damped factors split at ``b``, exactly as
   training does (:func:`thor_tf.split.timing.time_split_inversion`); the *speed curve* is
   ``p_1 / p_b`` (:func:`thor_tf.split.crossing.normalize_speed`);
4. the crossing of the two curves (:func:`thor_tf.split.crossing.find_crossing`; MindSpore's
   ResNet-50 on Ascend: crossing at 106 → 128).

:func:`calibrate` runs all four steps on a trained :class:`~thor_tf.model.ThorModel` or on a
collection of factor matrices and returns a JSON-ready dict; ``thor_tf.wrap(model,
split_dim="calibration.json")`` reads its ``split_dim`` key. ``scripts/calibrate_split_dim.py
--rule inverse`` is the command-line front end (training warm-up, JSON and plot). The default
rule's calibration, per factor dimension, is :mod:`thor_tf.split.calibrate`.

Conventions: factors are symmetric PSD ``[n, n]`` matrices, undamped (as
``model.thor.factors(name)`` returns them from a model trained with ``split_dim`` at least its
largest factor dimension: with a smaller split only the diagonal blocks are ever computed). The
information loss is measured on the undamped factors (damping adds a multiple of the identity,
which is block-diagonal at every size, so it only hides loss). Timing adds ``d = sqrt(λ)`` to
every factor's diagonal (the engine uses ``sqrt(λ/P)`` for a layer with ``P`` positions; the
value changes the timing only if a Cholesky fails and takes the float64 retry path). The last
block of a split is padded to a full block, so a candidate just below a factor's size can cost
more than its exact inverse (576 at 512: two 512-blocks), and the speed curve need not be
monotone.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from thor_tf.split.crossing import _check_candidates, candidates, find_crossing, normalize_speed
from thor_tf.split.information import DEFAULT_THRESHOLD, _as_square, loss_fractions
from thor_tf.split.timing import device_description, time_split_inversion

__all__ = ["calibrate", "collect_factors"]


def collect_factors(source) -> dict:
    """``{label: [n, n] ndarray}`` from a trained ThorModel or a collection of factors.

    Accepts: a :class:`~thor_tf.model.ThorModel` after ``fit`` with ``split_dim`` at least its
    largest factor dimension (else only diagonal blocks were computed: ValueError), giving every
    registered layer's ``A`` and ``G`` from ``model.thor.factors``, labelled ``"<layer>/A"``,
    ``"<layer>/G"`` (layers whose block was never refreshed still hold zero factors and are left
    out); a mapping
    ``{label: matrix}`` or ``{layer: {"A": ..., "G": ...}}``; or a sequence of matrices (labelled
    by index).
    """
    engine = getattr(source, "thor", None)
    if engine is not None and hasattr(engine, "factors") and hasattr(engine, "layer_stats"):
        split = getattr(engine.optimizer, "split_dim", None)
        largest = max((max(r["a_dim"], r["g_dim"]) for r in engine.layer_stats()), default=0)
        if split is None or split < largest:
            raise ValueError(
                f"the model was trained with split_dim={split}, below its largest factor dimension "
                f"{largest}: only the diagonal blocks of its factors exist, so their information "
                f"loss cannot be measured. Wrap it with split_dim >= {largest} (e.g. 1 << 30) for "
                f"the calibration warm-up (scripts/calibrate_split_dim.py does).")
        out = {}
        for row in engine.layer_stats():
            if not row.get("refreshes", 0):
                continue
            f = engine.factors(row["name"])
            out[f"{row['name']}/A"] = np.asarray(f["A"])
            out[f"{row['name']}/G"] = np.asarray(f["G"])
        return out
    if isinstance(source, Mapping):
        out = {}
        for key, value in source.items():
            if isinstance(value, Mapping):
                for sub, m in value.items():
                    out[f"{key}/{sub}"] = np.asarray(m)
            else:
                out[str(key)] = np.asarray(value)
        return out
    if isinstance(source, (list, tuple)):
        return {str(i): np.asarray(m) for i, m in enumerate(source)}
    raise ValueError("`model_or_factors` must be a trained ThorModel, a mapping of factor "
                     f"matrices or a list of them; got {type(source).__name__}.")


def calibrate(model_or_factors, cands: Optional[Sequence[int]] = None, damping: float = 0.03,
              threshold: float = DEFAULT_THRESHOLD, repeats: int = 5, warmup: int = 2,
              device: Optional[str] = None) -> dict:
    """Run the whole calibration and return a JSON-ready dict.

    Args:
      model_or_factors: see :func:`collect_factors`.
      cands: candidate split dimensions (default :func:`candidates` of the largest factor size).
      damping: λ; every factor is damped by ``sqrt(λ)`` for timing.
      threshold: information-loss threshold of the information curve (default 0.01).
      repeats, warmup, device: see :func:`time_split_inversion`.

    Returns:
      dict with ``candidates``, ``loss_fraction`` (information curve), ``inversion_seconds``,
      ``speed_normalized`` (``p_1/p_n``), ``crossing`` (float or None), ``split_dim`` (int, for
      ``thor_tf.wrap(..., split_dim=<json>)``), ``reason``, ``threshold``, ``damping``,
      ``factor_damping``, ``repeats``, ``warmup``, ``device``, ``tensorflow_version``,
      ``load_average_1min`` (before timing: on a shared CPU the times move with it),
      ``num_factors``, ``factor_dims`` (sorted, one per factor), ``factors`` (label → dim),
      ``losses`` (label → loss per candidate) and ``skipped_layers`` (never refreshed, left out).
    """
    factors = collect_factors(model_or_factors)
    engine = getattr(model_or_factors, "thor", None)
    skipped = ([row["name"] for row in engine.layer_stats() if not row.get("refreshes", 0)]
               if engine is not None and hasattr(engine, "layer_stats") else [])
    if not factors:
        raise ValueError("no factor matrices to calibrate on (no registered layer, or none refreshed "
                         "yet: train the wrapped model for a few steps first)")
    labels = list(factors)
    mats = [_as_square(factors[k]) for k in labels]
    dims = [m.shape[0] for m in mats]
    cands = _check_candidates(candidates(max(dims)) if cands is None else cands)
    fractions, losses = loss_fractions(mats, cands, threshold=threshold, return_losses=True)
    factor_damping = math.sqrt(float(damping))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    seconds = time_split_inversion(mats, cands, factor_damping, repeats=repeats, warmup=warmup,
                                   device=device)
    speed = normalize_speed(seconds)
    result = find_crossing(cands, fractions, speed)
    return {
        "candidates": cands,
        "loss_fraction": fractions,
        "inversion_seconds": seconds,
        "speed_normalized": speed,
        "crossing": result.crossing,
        "split_dim": result.split_dim,
        "reason": result.reason,
        "threshold": float(threshold),
        "damping": float(damping),
        "factor_damping": factor_damping,
        "repeats": int(repeats),
        "warmup": int(warmup),
        "device": device_description() if device is None else f"{device} ({device_description()})",
        "tensorflow_version": tf.__version__,
        "load_average_1min": None if load is None else round(load[0], 2),
        "num_factors": len(mats),
        "factor_dims": sorted(dims),
        "factors": dict(zip(labels, dims)),
        "losses": {k: [float(v) for v in row] for k, row in zip(labels, losses)},
        "skipped_layers": skipped,
    }
