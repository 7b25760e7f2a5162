"""``split_dim`` as a model uses it: one size for every factor, or a size per factor dimension.

Each Kronecker factor ``[n, n]`` is stored, inverted or eigendecomposed in diagonal blocks of its
split (DESIGN.md §2). ``thor_tf.wrap(model, split_dim=...)`` takes

* an int ``b >= 1``: every factor is split at ``b`` (``b >= n``: not split);
* a :class:`SplitPlan` (or its dict ``{"default": b, "by_dim": {n: b_n}, "diagonal_above":
  w}``): factors of dimension ``n`` at ``b_n``, those wider than ``w`` at 1, the others at
  ``b``. A split of 1 keeps that factor's diagonal only: the eigenbasis rule leaves that side
  unrotated (its basis is 1 on 1×1 blocks: Adam's coordinates on that side);
* the path of a calibration JSON (``scripts/calibrate_split_dim.py``): its ``split_plan`` when
  it has one, else its ``split_dim``;
* ``"auto"``: calibrated for the rule in use at the start of ``fit``
  (:mod:`thor_tf.split.calibrate`), which prints the plan it chose.

:func:`split_size` is what the blocks call: the split of one factor dimension under any of the
resolved forms.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Mapping, Optional, Tuple

__all__ = ["AUTO", "DEFAULT_SPLIT", "SplitPlan", "resolve_split_dim", "split_size", "split_config"]

#: ``split_dim="auto"``: calibrate at the start of ``fit``.
AUTO = "auto"
#: The default split (``wrap``'s ``split_dim``), and what ``"auto"`` gives a dimension it did
#: not calibrate.
DEFAULT_SPLIT = 128


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be an int >= 1; got {value!r}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Split per factor dimension: ``by_dim`` ``((n, b_n), ...)`` sorted by ``n``; a dimension
    not listed there takes 1 when it is wider than ``diagonal_above`` (if set: the factor kept
    as its diagonal, an eigenbasis side not rotated), else ``default``."""

    default: int
    by_dim: Tuple[Tuple[int, int], ...] = ()
    diagonal_above: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "default", _positive_int(self.default, "a SplitPlan's `default`"))
        pairs = tuple(sorted((_positive_int(n, "a SplitPlan dimension"),
                              _positive_int(b, f"the split of dimension {n}"))
                             for n, b in dict(self.by_dim).items()))
        object.__setattr__(self, "by_dim", pairs)
        if self.diagonal_above is not None:
            object.__setattr__(self, "diagonal_above", _positive_int(
                self.diagonal_above, "a SplitPlan's `diagonal_above`"))

    def size(self, dim: int) -> int:
        """The split of a factor of dimension ``dim``."""
        dim = int(dim)
        listed = dict(self.by_dim).get(dim)
        if listed is not None:
            return listed
        if self.diagonal_above is not None and dim > self.diagonal_above:
            return 1
        return self.default

    def get_config(self) -> dict:
        config = {"default": self.default, "by_dim": {str(n): b for n, b in self.by_dim}}
        if self.diagonal_above is not None:
            config["diagonal_above"] = self.diagonal_above
        return config

    @classmethod
    def from_config(cls, config: Mapping) -> "SplitPlan":
        unknown = sorted(set(config) - {"default", "by_dim", "diagonal_above"})
        if unknown or "default" not in config:
            raise ValueError(f"a split plan is {{'default': int, 'by_dim': {{dim: split}}, "
                             f"'diagonal_above': int or None}}; got {dict(config)!r}.")
        return cls(config["default"], tuple((int(n), b) for n, b in
                                            dict(config.get("by_dim") or {}).items()),
                   config.get("diagonal_above"))

    def __str__(self):
        parts = [f"{n}: {'none' if b == 1 else b}" for n, b in self.by_dim]
        if self.diagonal_above is not None:
            parts.append(f"wider than {self.diagonal_above}: none")
        return f"{self.default} ({', '.join(parts)})" if parts else str(self.default)


def split_size(split_dim, dim: int) -> int:
    """The split of a factor of dimension ``dim`` under a resolved ``split_dim`` (int or
    :class:`SplitPlan`)."""
    if isinstance(split_dim, SplitPlan):
        return split_dim.size(dim)
    return split_dim


def split_config(split_dim):
    """``split_dim`` as a saved config holds it: an int, ``"auto"``, or a plan's dict."""
    return split_dim.get_config() if isinstance(split_dim, SplitPlan) else split_dim


def resolve_split_dim(split_dim):
    """An int, a :class:`SplitPlan` or :data:`AUTO` from any form ``wrap`` accepts (module
    docstring); a ``ValueError`` naming ``split_dim`` and its forms otherwise."""
    forms = ("`split_dim` must be an int >= 1, 'auto', a thor_tf.SplitPlan (or its dict "
             "{'default': int, 'by_dim': {dim: split}}), or the path of a calibration JSON file")
    if isinstance(split_dim, SplitPlan):
        return split_dim
    if isinstance(split_dim, str) and split_dim == AUTO:
        return AUTO
    if isinstance(split_dim, Mapping):
        try:
            return SplitPlan.from_config(split_dim)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{forms}; got {split_dim!r} ({err}).") from err
    if isinstance(split_dim, (str, os.PathLike)):
        path = os.fspath(split_dim)
        try:
            with open(path) as fh:
                saved = json.load(fh)
            value = saved.get("split_plan") or saved["split_dim"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{forms} with a 'split_dim' key; could not read one from {path!r}: "
                             f"{err}") from err
        return resolve_split_dim(value)
    if isinstance(split_dim, bool) or not isinstance(split_dim, numbers.Integral) or split_dim < 1:
        raise ValueError(f"{forms}; got {split_dim!r}.")
    return int(split_dim)
