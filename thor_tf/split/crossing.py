"""The candidate splits and where the information curve meets the speed curve (the seed's rule,
DESIGN.md §2): the calibration's choice for one factor dimension, whatever the rule.

:func:`candidates` gives ``1, 16, 32, 64, …`` up to a dimension; :func:`normalize_speed` turns
seconds per candidate into the speed curve ``p_1/p_b``; :func:`find_crossing` interpolates the
crossing on a log2 axis and rounds it to a candidate (MindSpore's ResNet-50 on Ascend: 106 →
128). NumPy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

__all__ = ["Crossing", "candidates", "find_crossing", "normalize_speed"]


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


def normalize_speed(seconds: Sequence[float]) -> list:
    """Speed curve ``p_1 / p_n``: time at the first candidate over time at each candidate.

    It is 1 at the first (smallest, fastest) candidate and falls as the blocks grow, so it runs
    opposite to the information curve. Timing noise can push a value slightly above 1.
    """
    seconds = [float(s) for s in seconds]
    if not seconds or any(not s > 0 for s in seconds):
        raise ValueError(f"`seconds` must be positive; got {seconds!r}.")
    return [seconds[0] / s for s in seconds]


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
