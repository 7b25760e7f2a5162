"""Hardware-aware splitting: measure and choose the split dimension of the inverses (the H of THOR).

Training inverts each damped Kronecker factor ``F + d·I`` ([n, n]) only on its diagonal blocks of
``split_dim`` (:func:`thor_tf.rules.inverse_ops.invert_blocks`). Smaller blocks are faster to invert but drop
more of the factor. Calibration (DESIGN.md §2) measures both effects on the factors of the model and
on the machine that trains, and picks the dimension where they balance:

1. candidates ``1, 16, 32, 64, …`` up to the largest factor dimension (:func:`candidates`);
2. information: per factor matrix ``A`` and candidate ``b`` the loss
   ``L = 1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ)) = 1 − ‖Â‖₂/‖A‖₂`` with ``Â`` the block-diagonal part of
   ``A`` (blocks of ``b``, the last one partial) (:func:`information_loss`); the *information
   curve* is, per candidate, the fraction of the model's factor matrices with ``L < 1%``
   (:func:`loss_fractions`). It lies in [0, 1] and rises with the candidate (it is 1 at the exact
   inverse, ``b >= n`` for every factor);
3. speed: ``p_b`` = seconds to invert all the model's damped factors split at ``b``, exactly as
   training does (:func:`time_split_inversion`); the *speed curve* is ``p_1 / p_b``
   (:func:`normalize_speed`): 1 at ``b = 1`` (normally the fastest split) and falling as ``b``
   grows;
4. the crossing of the two curves, linearly interpolated on a log2 axis between neighbouring
   candidates, rounded to the nearest candidate on that axis (:func:`find_crossing`; MindSpore's
   ResNet-50 on Ascend: crossing at 106 → 128).

:func:`calibrate` runs all four steps on a trained :class:`~thor_tf.model.ThorModel` or on a
collection of factor matrices and returns a JSON-ready dict; ``thor_tf.wrap(model,
split_dim="calibration.json")`` reads its ``split_dim`` key. ``scripts/calibrate_split_dim.py`` is
the command-line front end (training warm-up, JSON and plot).

Conventions: factors are symmetric PSD ``[n, n]`` matrices, undamped (as
``model.thor.factors(name)`` returns them from a model trained with ``split_dim`` at least its
largest factor dimension: with a smaller split only the diagonal blocks are ever computed). The
information loss is measured on the undamped factors (damping adds a multiple of the identity,
which is block-diagonal at every size, so it only hides loss). Timing adds ``d = sqrt(λ)`` to every
factor's diagonal (the engine uses ``sqrt(λ/P)`` for a layer with ``P`` positions; the value
changes the timing only if a Cholesky fails and takes the float64 retry path). The last block of a
split is padded to a full block, so a candidate just below a factor's size can cost more than its
exact inverse (576 at 512: two 512-blocks), and the speed curve need not be monotone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from thor_tf.block_diagonal import diagonal_blocks, split_layout
from thor_tf.rules.inverse_ops import invert_blocks

__all__ = [
    "DEFAULT_THRESHOLD",
    "Crossing",
    "calibrate",
    "candidates",
    "collect_factors",
    "device_description",
    "find_crossing",
    "information_loss",
    "loss_fractions",
    "normalize_speed",
    "time_split_inversion",
]

#: A factor matrix "keeps its information" at a split when its loss ``L`` is below this (1%).
DEFAULT_THRESHOLD = 0.01


# ---------------------------------------------------------------------------------- candidates

def candidates(max_dim: int, base: Sequence[int] = (1, 16)) -> list:
    """Candidate split dimensions for factors of size up to ``max_dim``.

    ``base = (first, start)``: the list is ``first``, then ``start, 2·start, 4·start, …`` — every
    such value ``<= max_dim`` — followed by ``max_dim`` itself when it is not already in the list,
    so the last candidate is always the exact inverse of the largest factor. The default gives
    ``1, 16, 32, 64, …``; e.g. ``candidates(577) == [1, 16, 32, 64, 128, 256, 512, 577]``,
    ``candidates(512)`` ends with 512, ``candidates(10) == [1, 10]``.

    Args:
      max_dim: the largest factor dimension of the model (int >= 1).
      base: ``(first, start)`` with ``1 <= first < start``.

    Returns:
      Sorted list of distinct python ints.
    """
    if isinstance(max_dim, bool) or not isinstance(max_dim, (int, np.integer)) or max_dim < 1:
        raise ValueError(f"`max_dim` must be an int >= 1; got {max_dim!r}.")
    first, start = (int(b) for b in base)
    if not 1 <= first < start:
        raise ValueError(f"`base` must be (first, start) with 1 <= first < start; got {base!r}.")
    max_dim = int(max_dim)
    out = [first] if first <= max_dim else []
    value = start
    while value <= max_dim:
        out.append(value)
        value *= 2
    if not out or out[-1] != max_dim:
        out.append(max_dim)
    return out


def _check_candidates(cands) -> list:
    cands = [int(c) for c in cands]
    if not cands or any(c < 1 for c in cands) or any(b <= a for a, b in zip(cands, cands[1:])):
        raise ValueError(f"candidates must be a non-empty increasing list of ints >= 1; got {cands!r}.")
    return cands


# ------------------------------------------------------------------------------ information

def _spectral_norms(stack: np.ndarray) -> np.ndarray:
    """Spectral norm ``‖M‖₂ = sqrt(λmax(MMᵀ))`` of each matrix of a ``[b, d, d]`` float64 stack."""
    if stack.shape[-1] == 1:
        return np.abs(stack[:, 0, 0])
    asym = np.max(np.abs(stack - np.swapaxes(stack, -1, -2)))
    if asym <= 1e-6 * np.max(np.abs(stack)):
        # Symmetric: ‖M‖₂ = max |eigenvalue| (eigvalsh is cheaper and more accurate than an SVD).
        sym = 0.5 * (stack + np.swapaxes(stack, -1, -2))
        return np.max(np.abs(np.linalg.eigvalsh(sym)), axis=-1)
    return np.linalg.norm(stack, ord=2, axis=(-2, -1))


def _as_square(matrix) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
        raise ValueError(f"factor matrices must be square [n, n]; got shape {m.shape}.")
    if not np.all(np.isfinite(m)):
        raise ValueError("factor matrices must be finite (got NaN/Inf).")
    return m


def information_loss(matrix, block_size: int, norm: Optional[float] = None) -> float:
    """``L = 1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ))`` for the split of ``matrix`` at ``block_size``.

    ``Â`` keeps the diagonal blocks of ``A`` ([n, n]) of size ``block_size`` (the last block
    partial when ``block_size`` does not divide ``n``) and zeros elsewhere. Since
    ``sqrt(λmax(MMᵀ)) = ‖M‖₂`` and the spectral norm of a block-diagonal matrix is the largest of
    its blocks' norms, ``L = 1 − max_k ‖A_kk‖₂ / ‖A‖₂``. Computed in float64 NumPy.

    ``L`` is 0 when ``A`` is block-diagonal at ``block_size`` (hence also at any multiple of a
    block size at which it is block-diagonal), when ``block_size >= n``, and, by convention, for
    ``A = 0``. For a PSD ``A`` it lies in ``[0, 1)`` (a principal block never has a larger norm).

    Args:
      matrix: ``[n, n]`` array (any float dtype).
      block_size: int >= 1.
      norm: ``‖A‖₂`` if already known (to reuse it across candidates).

    Returns:
      python float.
    """
    a = _as_square(matrix)
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1; got {block_size}.")
    n = a.shape[0]
    if block_size >= n:
        return 0.0
    full = float(_spectral_norms(a[None])[0]) if norm is None else float(norm)
    if full == 0.0:
        return 0.0
    kept = float(np.max(_spectral_norms(diagonal_blocks(a, block_size))))
    return float(min(1.0, max(0.0, 1.0 - kept / full)))  # clip round-off (a block's norm <= ‖A‖₂)


def loss_fractions(matrices: Iterable, cands: Sequence[int],
                   threshold: float = DEFAULT_THRESHOLD, return_losses: bool = False):
    """Per candidate, the fraction of ``matrices`` whose information loss is ``< threshold``.

    Args:
      matrices: iterable of ``[n_i, n_i]`` factor matrices (sizes may differ).
      cands: increasing candidate block sizes.
      threshold: the loss below which a matrix counts as kept (default 1%).
      return_losses: also return the ``[num_matrices, num_candidates]`` float64 loss table.

    Returns:
      list of floats in [0, 1] (one per candidate), or ``(fractions, losses)``. A candidate
      ``>= n_i`` gives that matrix ``L = 0``, so the fraction is 1 at ``max(n_i)``.
    """
    cands = _check_candidates(cands)
    mats = [_as_square(m) for m in matrices]
    if not mats:
        raise ValueError("`matrices` is empty.")
    losses = np.zeros((len(mats), len(cands)))
    for i, m in enumerate(mats):
        full = float(_spectral_norms(m[None])[0])
        for j, c in enumerate(cands):
            losses[i, j] = information_loss(m, c, norm=full)
    fractions = [float(f) for f in np.mean(losses < threshold, axis=0)]
    return (fractions, losses) if return_losses else fractions


# ----------------------------------------------------------------------------------- timing

def _sync(values):
    """Block until ``values`` are computed (GPUs run asynchronously; a no-op wait on CPU)."""
    del values
    tf.test.experimental.sync_devices()


def time_split_inversion(matrices: Sequence, cands: Sequence[int], damping: float,
                         repeats: int = 5, warmup: int = 2, device: Optional[str] = None) -> list:
    """Seconds to invert all ``matrices``, damped, split at each candidate, as training does.

    Training computes each factor's diagonal blocks directly (:func:`thor_tf.blocks.block_gram`,
    ``[nb, d, d]`` with zero padding past the factor's dimension) and inverts them with
    :func:`thor_tf.rules.inverse_ops.invert_blocks` (damp, identity on the padding, one batched Cholesky,
    float64 retry of failed blocks). So for each candidate ``b`` the blocks of every factor are cut
    beforehand (:func:`thor_tf.rules.inverse_ops.split_layout`; not timed) and one ``tf.function`` taking
    them as arguments (nothing constant-folded) returns
    ``[invert_blocks(B_i, damping, n_i) for B_i in blocks]``. Each function is traced once and run
    ``warmup`` times; then ``repeats`` rounds time every candidate once per round (round robin, so
    that load on a shared machine spreads over all candidates); each run waits for its results
    (``sync_devices``). The device is the default one (the GPU when TensorFlow sees one) unless
    ``device`` names one.

    Args:
      matrices: the (undamped) factors ``[n_i, n_i]``.
      cands: increasing candidate split dimensions.
      damping: value added to every factor's diagonal (``d``, e.g. ``sqrt(λ)``), > 0.
      repeats: timed runs per candidate (the median is returned), >= 1.
      warmup: untimed runs per candidate after tracing, >= 0.
      device: optional TF device string, e.g. ``"/CPU:0"``.

    Returns:
      list of median seconds, one per candidate.
    """
    cands = _check_candidates(cands)
    if int(repeats) < 1 or int(warmup) < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0; got {repeats}, {warmup}.")
    if not damping > 0:
        raise ValueError(f"`damping` must be > 0; got {damping!r}.")
    arrays = [np.asarray(_as_square(m), np.float32) for m in matrices]
    if not arrays:
        raise ValueError("`matrices` is empty.")
    dims = [a.shape[0] for a in arrays]

    def make_fn(shapes):
        spec = [[tf.TensorSpec(s, tf.float32) for s in shapes], tf.TensorSpec([], tf.float32)]

        def invert_all(blocks, d):
            return [invert_blocks(b, d, n) for b, n in zip(blocks, dims)]

        return tf.function(invert_all, input_signature=spec, autograph=False)

    def run_all():
        damp = tf.constant(float(damping), tf.float32)
        inputs, fns = [], []
        for c in cands:
            blocks = [tf.constant(diagonal_blocks(a, split_layout(a.shape[0], c)[1]))
                      for a in arrays]
            inputs.append(blocks)
            fns.append(make_fn([b.shape for b in blocks]))
        for fn, blocks in zip(fns, inputs):  # trace, then warm up
            for _ in range(1 + int(warmup)):
                _sync(fn(blocks, damp))
        # Round robin over the candidates, so that a slow spell of a shared machine hits all of
        # them alike instead of one candidate's whole series.
        times = [[] for _ in cands]
        for _ in range(int(repeats)):
            for k, (fn, blocks) in enumerate(zip(fns, inputs)):
                start = time.perf_counter()
                _sync(fn(blocks, damp))
                times[k].append(time.perf_counter() - start)
        return [float(statistics.median(t)) for t in times]

    # One tf.function per candidate is the point here: silence TF's "excessive retracing" warning.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        if device is None:
            return run_all()
        with tf.device(device):
            return run_all()
    finally:
        logger.setLevel(level)


def normalize_speed(seconds: Sequence[float]) -> list:
    """Speed curve ``p_1 / p_n``: time at the first candidate over time at each candidate.

    It is 1 at the first (smallest, fastest) candidate and falls as the blocks grow, so it runs
    opposite to the information curve. Timing noise can push a value slightly above 1.
    """
    seconds = [float(s) for s in seconds]
    if not seconds or any(not s > 0 for s in seconds):
        raise ValueError(f"`seconds` must be positive; got {seconds!r}.")
    return [seconds[0] / s for s in seconds]


# --------------------------------------------------------------------------------- crossing

@dataclasses.dataclass(frozen=True)
class Crossing:
    """Outcome of :func:`find_crossing`.

    Attributes:
      crossing: interpolated dimension where the curves cross (float), or None when they do not.
      split_dim: the chosen candidate (int).
      reason: one line saying how ``split_dim`` was chosen.
    """

    crossing: Optional[float]
    split_dim: int
    reason: str


def find_crossing(cands: Sequence[int], info_curve: Sequence[float],
                  speed_curve: Sequence[float]) -> Crossing:
    """Where the rising information curve meets the falling speed curve.

    With ``D_i = info_i − speed_i``, scanning candidates from the smallest:

    * the first ``i`` with ``D_i == 0``, if no sign change comes before it: the curves meet at a
      candidate; ``crossing = split_dim = cands[i]``;
    * otherwise the first ``i`` with ``D_{i−1} < 0 < D_i``: the curves are taken as straight lines
      between neighbouring candidates on a log2 axis (the candidates double, so that is their
      natural scale and how the calibration plot draws them) and the crossing is
      ``x = 2^(u_{i−1} + (u_i − u_{i−1})·t)`` with ``u = log2(c)`` and
      ``t = −D_{i−1}/(D_i − D_{i−1})``; ``split_dim`` is the candidate nearer to ``x`` on that axis
      (``c_i`` when ``x >= sqrt(c_{i−1}·c_i)``, a tie going to the larger block, which keeps more
      information). E.g. MindSpore's crossing at 106 between 64 and 128 → 128.

    Fallbacks (``crossing`` is None):

    * ``D_0 > 0`` (information already above speed at the smallest candidate; since the speed
      curve is 1 there, every factor is kept at that split): the smallest candidate;
    * ``D_i < 0`` everywhere (too much information lost at every split that is cheaper than the
      exact inverse): the largest candidate, the exact inverse.

    Args:
      cands: increasing candidate dimensions.
      info_curve: fraction of factors kept per candidate (:func:`loss_fractions`).
      speed_curve: normalized speed per candidate (:func:`normalize_speed`).

    Returns:
      :class:`Crossing`.
    """
    cands = _check_candidates(cands)
    info = [float(v) for v in info_curve]
    speed = [float(v) for v in speed_curve]
    if not len(info) == len(speed) == len(cands):
        raise ValueError(f"curves must have one value per candidate ({len(cands)}); got "
                         f"{len(info)} and {len(speed)}.")
    diff = [i - s for i, s in zip(info, speed)]
    if diff[0] == 0:
        return Crossing(float(cands[0]), cands[0],
                        f"curves meet at the smallest candidate {cands[0]}")
    if diff[0] > 0:
        return Crossing(None, cands[0],
                        f"no crossing: information >= speed from the smallest candidate "
                        f"{cands[0]} on; using it")
    for i in range(1, len(cands)):
        if diff[i] == 0:
            return Crossing(float(cands[i]), cands[i], f"curves meet at candidate {cands[i]}")
        if diff[i] > 0:
            lo, hi = cands[i - 1], cands[i]
            t = -diff[i - 1] / (diff[i] - diff[i - 1])
            x = 2.0 ** (math.log2(lo) + (math.log2(hi) - math.log2(lo)) * t)
            chosen = hi if t >= 0.5 else lo  # nearer on the log2 axis (t is linear in log2)
            return Crossing(float(x), chosen,
                            f"curves cross at {x:.1f} between {lo} and {hi}; nearest candidate "
                            f"{chosen}")
    return Crossing(None, cands[-1],
                    f"no crossing: information < speed at every candidate; using the largest "
                    f"candidate {cands[-1]} (exact inverse)")


# ------------------------------------------------------------------------------ calibrate

def device_description() -> str:
    """The device that :func:`time_split_inversion` uses by default, in words."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", gpus[0].name)
        except Exception:  # details are best effort
            name = gpus[0].name
        return f"GPU: {name}" + (f" (+{len(gpus) - 1} more)" if len(gpus) > 1 else "")
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} logical cores visible)"


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
