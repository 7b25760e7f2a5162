"""The split calibrated for the rule that runs, per factor dimension (the H of THOR).

The seed's calibration (:mod:`thor_tf.split.inverse_calibration`) times the inverse rule's
Cholesky and weighs it against the seed's information curve. What a split costs and keeps
depends on the rule (its :class:`~thor_tf.rules.base.SplitCost`,
:meth:`thor_tf.rules.UpdateRule.split_cost`): the default eigenbasis rule never
inverts; it rotates every step's gradient into its split bases and back and renews the bases at
refreshes. This module calibrates the
split for whichever rule the model trains with, on the model, the batch and the machine at hand:

1. factors: the full ``A`` and ``G`` of every block on two probe batches
   (:func:`thor_tf.split.probe.batch_factors`; the weights are not touched). Each block gives two
   *sides* (its ``A`` of dimension ``a_dim``, its ``G`` of ``g_dim``); sides are grouped by their
   dimension ``n``, and each dimension gets its own split (a CNN's wide first Dense and its
   64-wide convolutions need not share one);
2. cost: per dimension ``n`` and candidate ``b`` (:func:`candidates_for`: ``1`` — no rotation,
   Adam's coordinates on that side —, ``16, 32, …`` up to ``max_split``, and ``n`` itself when
   it fits), the seconds of the rule's real traced work on every side of that dimension:
   ``c_n(b) = Σ_sides [step(b) + rate·refresh(b)]``, ``rate`` the refreshes per step (the trace
   rule's measured rate, or its upper bound ``1/frequency`` before training). The *speed curve*
   is the step's speed against its fastest split, ``(T + min_b c_n(b)) / (T + c_n(b))`` (work
   within 0.5 % of ``T`` of the cheapest counts as equally fast: timing noise), with
   ``T`` the rest of the step every split pays (the model's forward and backward pass on the
   batch and the rule's split-independent work, :meth:`~thor_tf.rules.base.SplitCost.fixed_work`):
   1 at the cheapest split, falling as the side's work grows relative to the step;
3. information: the rule's curve over the same candidates on the probe factors of that
   dimension (the inverse rule: the seed's fraction of factors with loss < 1 %; the eigenbasis
   rule: how well a split basis from batch 1 diagonalizes batch 2's factor, relative to the
   unsplit basis: :mod:`thor_tf.split.information`);
4. the crossing of the two curves, as the seed takes it (:func:`thor_tf.split.crossing.
   find_crossing`), is that dimension's split; where the information stays below the speed at
   every candidate, the rule's ``SplitCost.fallback`` decides (the inverse rule: the largest
   candidate, the seed's; the eigenbasis rule: its default split for that dimension, since its
   measure cannot tell there what the split does to training: docs/split_dim.md). The result is
   a :class:`thor_tf.split.plan.SplitPlan` (the rule's default for dimensions the probe did not
   see).

``thor_tf.wrap(model, split_dim="auto")`` runs this at the start of ``fit`` on its first two
batches and prints the table (:func:`format_report`); ``scripts/calibrate_split_dim.py`` runs it
after a warm-up and writes the JSON ``split_dim=`` takes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from thor_tf.split.crossing import Crossing, find_crossing
from thor_tf.split.crossing import candidates as _doubling_candidates
from thor_tf.split.plan import DEFAULT_SPLIT, SplitPlan, split_size
from thor_tf.split.probe import batch_factors, untouched
from thor_tf.split.timing import time_round_robin

__all__ = ["Side", "auto_split", "calibrate_rule", "candidates_for", "format_report",
           "layer_costs", "probe_sides", "step_base_seconds"]

#: The largest split calibration times by default (a refresh of 512-blocks of a 3,137-wide
#: factor is ~0.4 s of float64 ``eigh`` per call on a 2-core CPU, and its rotations cost ~5x
#: those at 128); a dimension up to it also gets itself (unsplit) as a candidate.
DEFAULT_MAX_SPLIT = 256


#: Differences of a side's work below this share of the step count as equal speed.
SPEED_RESOLUTION = 0.005


@dataclasses.dataclass
class Side:
    """One factor side of a block, as the calibration sees it.

    ``factor``/``previous``: the side's ``[dim, dim]`` factor on probe batches 2 and 1 (NumPy
    float64); ``other_dim``: the block's other side; ``side``: ``"A"`` or ``"G"``."""

    layer: str
    side: str
    dim: int
    other_dim: int
    factor: np.ndarray
    previous: np.ndarray

    @property
    def label(self):
        return f"{self.layer}/{self.side}"


def probe_sides(model, batches) -> list:
    """The :class:`Side` s of a wrapped model's blocks from two probe batches ``[(x, y), (x, y)]``:
    every side of dimension > 1 that both batches reached (an Embedding's diagonal ``A`` is
    never split and is left out)."""
    batches = list(batches)
    if len(batches) != 2:
        raise ValueError(f"`batches` must be two (x, y) batches; got {len(batches)}.")
    first, second = batch_factors(model, batches)
    sides = []
    for block in model.thor.blocks:
        if block.name not in first or block.name not in second:
            continue
        fixed = block.split_sizes(1 << 30)
        for k, (name, dim, other) in enumerate((("A", block.a_dim, block.g_dim),
                                                ("G", block.g_dim, block.a_dim))):
            if dim < 2 or fixed[k] == 1:
                continue
            sides.append(Side(block.name, name, dim, other, second[block.name][k],
                              first[block.name][k]))
    return sides


def candidates_for(dim: int, max_split: int = DEFAULT_MAX_SPLIT) -> list:
    """Candidate splits of a dimension: ``1`` (not rotated / diagonal), ``16, 32, …`` below
    ``dim`` up to ``max_split``, and ``dim`` (unsplit) when ``dim <= max_split``."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 2:
        raise ValueError(f"`dim` must be an int >= 2; got {dim!r}.")
    if isinstance(max_split, bool) or not isinstance(max_split, int) or max_split < 1:
        raise ValueError(f"`max_split` must be an int >= 1; got {max_split!r}.")
    cands = [c for c in _doubling_candidates(int(dim)) if c <= max_split and c < dim]
    if dim <= max_split:
        cands.append(int(dim))
    return cands


def calibrate_rule(sides: Sequence, rule, base_seconds: float, refresh_rate: float,
                   max_split: int = DEFAULT_MAX_SPLIT, default=None,
                   repeats: int = 3, warmup: int = 1, timer=time_round_robin) -> dict:
    """Steps 2–4 of the module docstring on given sides.

    Args:
      sides: :class:`Side` s (at least one).
      rule: the :class:`~thor_tf.rules.UpdateRule` whose work and information are measured.
      base_seconds: ``T``, the seconds of the step every split pays (> 0).
      refresh_rate: refreshes per step of a block, in [0, 1].
      max_split: see :func:`candidates_for`.
      default: the split (int or :class:`SplitPlan`) the plan keeps for dimensions no side has,
        and the ``"default"`` fallback's; None: the rule's ``default_split`` (else 128).
      repeats, warmup: timing (:func:`time_round_robin`).
      timer: ``timer(works, repeats=, warmup=) → seconds`` (tests pass a known cost).

    Returns:
      dict: ``plan`` (:class:`SplitPlan`), ``dims`` (per dimension: ``candidates``,
      ``information``, ``step_seconds``, ``refresh_seconds`` (summed over its sides),
      ``cost_seconds``, ``speed``, ``crossing``, ``split``, ``reason``, ``sides``), ``layers``
      (per side label: its dimension, the other side's and its split), ``base_seconds``,
      ``refresh_rate``, ``rule``.
    """
    if default is None:
        default = getattr(rule, "default_split", DEFAULT_SPLIT)
    sides = list(sides)
    if not sides:
        raise ValueError("no factor sides to calibrate on (no registered layer reached by the "
                         "probe batches).")
    if not base_seconds > 0:
        raise ValueError(f"`base_seconds` must be > 0; got {base_seconds!r}.")
    if not 0 <= refresh_rate <= 1:
        raise ValueError(f"`refresh_rate` must be in [0, 1]; got {refresh_rate!r}.")
    by_dim = {}
    for s in sides:
        by_dim.setdefault(s.dim, []).append(s)
    # Per (dimension, candidate): one traced function runs the step work of every side of that
    # dimension, one the refresh work (as one train step runs them: a call's overhead once).
    # Sides of one dimension, side and other dimension do the same work: one of each is built
    # and run that many times inside the function.
    cost_model = rule.split_cost()
    works, keys = [], []
    for dim, members in sorted(by_dim.items()):
        shapes = {}
        for s in members:
            shapes.setdefault((s.side, s.other_dim), []).append(s)
        for b in candidates_for(dim, max_split):
            made = [(cost_model.side_work(group[0].factor, group[0].previous, b, other, side),
                     len(group)) for (side, other), group in sorted(shapes.items())]
            for kind in ("step", "refresh"):
                works.append(_joined([(getattr(w, kind), count) for w, count in made]))
                keys.append((dim, b, kind))
    # A call of a traced function costs ~0.1-0.4 ms on a CPU whatever it does; training runs
    # all of this inside one step, so that cost is measured on an empty function and taken off.
    empty = (tf.function(lambda: tf.constant(0.0), autograph=False), ())
    *seconds, overhead = timer(works + [empty], repeats=repeats, warmup=warmup)
    seconds = [max(0.0, t - overhead) for t in seconds]
    per_dim = {}
    for (dim, b, kind), t in zip(keys, seconds):
        per_dim.setdefault(dim, {}).setdefault(b, {})[kind] = t
    dims, plan = {}, {}
    for dim, members in sorted(by_dim.items()):
        cands = candidates_for(dim, max_split)
        step = [per_dim[dim][b]["step"] for b in cands]
        refresh = [per_dim[dim][b]["refresh"] for b in cands]
        cost = [s + refresh_rate * r for s, r in zip(step, refresh)]
        # A difference of work below SPEED_RESOLUTION of the step is timing noise, not speed:
        # those candidates are equally fast (else noise of a few µs picks the split of a
        # 32-wide side).
        cheapest = min(cost)
        speed = [1.0 if c - cheapest < SPEED_RESOLUTION * base_seconds
                 else (base_seconds + cheapest) / (base_seconds + c) for c in cost]
        info = [float(v) for v in cost_model.information_curve(
            [(s.previous, s.factor) for s in members], cands)]
        found = find_crossing(cands, info, speed)
        fallback = cost_model.fallback
        if (found.crossing is None and fallback != "largest"
                and all(i < v for i, v in zip(info, speed))):
            if fallback == "cheapest":
                chosen, why = cands[int(np.argmin(cost))], "the cheapest split"
            else:
                target = split_size(default, dim)
                chosen = max([c for c in cands if c <= target] or cands[:1])
                why = f"the default split ({target})"
            found = Crossing(None, chosen,
                             f"no crossing: information < speed at every candidate (at most "
                             f"{max(info):.2f} kept); {why} {chosen}")
        plan[dim] = found.split_dim
        dims[dim] = {"candidates": cands, "information": info, "step_seconds": step,
                     "refresh_seconds": refresh, "cost_seconds": cost, "speed": speed,
                     "crossing": found.crossing, "split": found.split_dim,
                     "reason": found.reason, "sides": [s.label for s in members]}
    layers = {s.label: {"dim": s.dim, "other_dim": s.other_dim, "split": plan[s.dim]}
              for s in sides}
    base = default if isinstance(default, SplitPlan) else SplitPlan(int(default))
    plan = SplitPlan(base.default, tuple(plan.items()), base.diagonal_above)
    return {"plan": plan, "dims": dims, "layers": layers,
            "base_seconds": float(base_seconds), "refresh_rate": float(refresh_rate),
            "rule": rule.name}


def _joined(works):
    """One ``(tf.function, args)`` running each ``(fn, args)`` of ``[((fn, args), count)]``
    ``count`` times."""
    flat = [arg for (_, args), _ in works for arg in args]
    sizes = [len(args) for (_, args), _ in works]

    def run(*tensors):
        out, k = [], 0
        for ((fn, _), count), size in zip(works, sizes):
            for _ in range(count):
                out.append(fn(*tensors[k:k + size]))
            k += size
        return out

    return tf.function(run, autograph=False), tuple(flat)


def forward_backward_seconds(model, batch, repeats: int = 3) -> float:
    """Median seconds of the model's traced forward pass and gradient on ``batch`` (``T``)."""
    x, y = batch
    variables = model.trainable_variables

    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        return tape.gradient(loss, variables)

    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = None if y is None else tf.nest.map_structure(tf.convert_to_tensor, y)
    with untouched(model):
        return time_round_robin([(step, (x, y))], repeats=repeats, warmup=1)[0]


def step_base_seconds(model, batch, rule, repeats: int = 3) -> dict:
    """``T``: the seconds of the step every split pays: the model's forward and backward pass
    on ``batch`` and the rule's split-independent work on its blocks
    (:meth:`~thor_tf.rules.base.SplitCost.fixed_work`: the eigenbasis rule's moments and
    Newton–Schulz). ``{"forward_backward": s, "rule_fixed": s, "total": s}``."""
    forward_backward = forward_backward_seconds(model, batch, repeats=repeats)
    shapes = [(b.a_dim, b.g_dim) for b in model.thor.blocks]
    works = [_adamw_work(shapes)]
    work = rule.split_cost().fixed_work(shapes)
    if work is not None:
        works.append((tf.function(work[0], autograph=False), work[1]))
    seconds = time_round_robin(works, repeats=repeats)
    fixed = seconds[1] if work is not None else 0.0
    return {"forward_backward": forward_backward, "rule_fixed": fixed,
            "first_order": seconds[0], "total": forward_backward + fixed}


def _adamw_work(shapes):
    """AdamW's update of every block's ``[a_dim, g_dim]`` matrix (moments, division, decay):
    what a first-order step costs the same weights."""
    grads = tuple(tf.constant(np.full((a, g), 0.5, np.float32)) for a, g in shapes)

    def step(*grads):
        out = []
        for g in grads:
            m = 0.9 * g + 0.1 * g
            v = 0.999 * tf.square(g) + 0.001 * tf.square(g)
            out.append(g - 1e-3 * (m / (tf.sqrt(v) + 1e-7) + 4e-3 * g))
        return out

    return tf.function(step, autograph=False), grads


def layer_costs(report, blocks) -> dict:
    """Per block, what THOR's step costs it beside a first-order step, in seconds per step:
    ``{"split": (A's, G's), "rotations": s, "fixed": s, "first_order": s}``. Rotations: its
    sides' share of their dimension's measured work at the chosen split (shared by the other
    side's width, which the work is linear in); fixed: its share of the rule's
    split-independent work (by ``min(a, g)²·max(a, g)``, Newton–Schulz's products); first order:
    its share of AdamW's update of all blocks (by size). Estimates from the calibration's
    timings: a block's own work is not timed alone."""
    parts = report.get("base_parts", {})
    sizes = {b.name: b.a_dim * b.g_dim for b in blocks}
    flops = {b.name: min(b.a_dim, b.g_dim) ** 2 * max(b.a_dim, b.g_dim) for b in blocks}
    out = {}
    for b in blocks:
        rotations = 0.0
        for side, dim, other in (("A", b.a_dim, b.g_dim), ("G", b.g_dim, b.a_dim)):
            entry = report["dims"].get(dim)
            if entry is None or f"{b.name}/{side}" not in entry["sides"]:
                continue
            widths = [report["layers"][label]["other_dim"] for label in entry["sides"]]
            chosen = entry["candidates"].index(entry["split"])
            rotations += entry["cost_seconds"][chosen] * other / sum(widths)
        out[b.name] = {
            "split": tuple(report["plan"].size(d) if report["plan"] is not None else None
                           for d in (b.a_dim, b.g_dim)),
            "rotations": rotations,
            "fixed": parts.get("rule_fixed", 0.0) * flops[b.name] / max(1, sum(flops.values())),
            "first_order": parts.get("first_order", 0.0) * sizes[b.name] / max(1, sum(sizes.values())),
        }
    return out


def auto_split(model, batches, refresh_rate: Optional[float] = None,
               max_split: int = DEFAULT_MAX_SPLIT, repeats: int = 3, verbose: bool = True):
    """Calibrate a wrapped, compiled model's split for its rule on two ``(x, y)`` batches.

    ``refresh_rate`` None: ``1/frequency`` (every block refreshed at every cadence point: the
    rate at the start of training, an upper bound after). Returns ``(plan, report)``; prints
    :func:`format_report` when ``verbose``."""
    start = time.perf_counter()
    config = model.thor_optimizer.config
    if refresh_rate is None:
        refresh_rate = 1.0 / max(1, int(config.cadence.interval_base()))
    batches = list(batches)
    sides = probe_sides(model, batches)
    base = step_base_seconds(model, batches[0], config.rule, repeats=repeats)
    report = calibrate_rule(sides, config.rule, base["total"], refresh_rate,
                            max_split=max_split, repeats=repeats)
    report["base_parts"] = base
    report["layer_costs"] = layer_costs(report, model.thor.blocks)
    report["calibration_seconds"] = time.perf_counter() - start
    report["load_average_1min"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    if verbose:
        print(format_report(report))
    return report["plan"], report


def format_report(report) -> str:
    """The calibration as a few lines: per dimension, the chosen split and its cost beside the
    other candidates'."""
    ms = lambda s: f"{1e3 * s:.2f}"
    lines = [f"thor_tf: split calibrated for the {report['rule']} rule: split_dim="
             f"{report['plan']} (step without the splits' work {ms(report['base_seconds'])} ms, "
             f"refresh rate {report['refresh_rate']:.3g}/step"
             + (f", {report['calibration_seconds']:.1f} s" if "calibration_seconds" in report
                else "") + ")",
             "  dim  sides  split  ms/step at split  per candidate (split: ms/step, information)"]
    for dim, d in sorted(report["dims"].items()):
        chosen = d["candidates"].index(d["split"])
        per = ", ".join(f"{'none' if b == 1 else b}: {ms(c)} {i:.2f}" for b, c, i in
                        zip(d["candidates"], d["cost_seconds"], d["information"]))
        split = "none" if d["split"] == 1 else str(d["split"])
        lines.append(f"  {dim:>4}  {len(d['sides']):>5}  {split:>5}  "
                     f"{ms(d['cost_seconds'][chosen]):>16}  {per}")
    costs = report.get("layer_costs")
    if costs:
        name = max(len("layer"), *(len(k) for k in costs))
        lines.append(f"  {'layer'.ljust(name)}  split A  split G  THOR ms/step (rotations + "
                     f"moments/orthogonalization)  AdamW ms/step")
        for layer, c in costs.items():
            a, g = ("none" if v == 1 else str(v) for v in c["split"])
            lines.append(f"  {layer.ljust(name)}  {a:>7}  {g:>7}  "
                         f"{ms(c['rotations'] + c['fixed']):>8} ({ms(c['rotations'])} + "
                         f"{ms(c['fixed'])}){'':>21}{ms(c['first_order']):>8}")
    return "\n".join(lines)
