"""Where a THOR step spends its time: capture + backward, traces, factors, the update rule's
refresh, preconditioning.

``profile_step(model, x, y)`` times each part of the train step as its own ``tf.function`` on one
batch (median of repeats after a warm-up run), per registered layer where the work is per layer.
The parts are what the fused train step does; timing them apart shows what a refresh costs
(factors + the rule's products from them) against what every step costs (forward/backward +
preconditioning).

A layer's ``refresh`` is the work of the rule the model trains with, on this batch's factors at
the block's split: the inverse rule's damped batched Cholesky, the eigenbasis rule's basis
renewal (``eigh``, or a power step and QR from the basis in use), as the rule states it for the
split calibration (:meth:`thor_tf.rules.base.SplitCost.side_work`, its ``refresh`` part, both sides
in one ``tf.function``). Timing it there leaves the optimizer's state as it is.
"""

from __future__ import annotations


import tensorflow as tf

from thor_tf import fisher, loss_terms
from thor_tf.block_diagonal import BlockDiagonal
from thor_tf.split.timing import time_round_robin


def _median_seconds(fn, repeats):
    """Median seconds of ``fn()`` after one untimed call (its trace), by the split calibration's
    timer (:func:`thor_tf.split.timing.time_round_robin`: each call waits for its results)."""
    return time_round_robin([(fn, ())], repeats=repeats, warmup=0)[0]


def _layer_functions(block, recs, gs, split_dim):
    """tf.functions (no arguments: the captured tensors are constants) for one layer's traces and
    factors."""
    traces = tf.function(lambda: (block.trace_a(recs), block.trace_g(gs)))
    factors = tf.function(lambda: (block.factor_a(recs, split_dim), block.factor_g(gs, split_dim)))
    return traces, factors


def _refresh_function(rule, block, factors, in_use, split_dim):
    """A no-argument callable running ``rule``'s refresh of both of ``block``'s factors.

    ``factors`` / ``in_use``: ``(A, G)`` split blocks ``[nb, d, d]``, this batch's and those the
    products in use came from (a refresh may start from them). The rule's
    :meth:`~thor_tf.rules.base.SplitCost.side_work` takes each side's dense ``[n, n]`` factor
    and its split; the two ``refresh`` works are traced into one ``tf.function`` taking their tensors as
    arguments (nothing folded into constants), as the split calibration times them."""
    sides = []
    for side, factor, previous, dim, other, split in (
            ("A", factors[0], in_use[0], block.a_dim, block.g_dim, block.split_sizes(split_dim)[0]),
            ("G", factors[1], in_use[1], block.g_dim, block.a_dim, block.split_sizes(split_dim)[1])):
        dense = BlockDiagonal(factor, dim).to_dense().numpy()
        previous = BlockDiagonal(tf.convert_to_tensor(previous), dim).to_dense().numpy()
        sides.append(rule.split_cost().side_work(dense, previous, split, other, side).refresh)
    (fn_a, args_a), (fn_g, args_g) = sides
    cut = len(args_a)
    both = tf.function(lambda *t: (fn_a(*t[:cut]), fn_g(*t[cut:])), autograph=False)
    args = tuple(args_a) + tuple(args_g)
    return lambda: both(*args)


def profile_step(model, x, y, repeats=5):
    """Seconds per part of a THOR step for one batch ``(x, y)``.

    Args:
      model: a compiled model returned by :func:`thor_tf.wrap`.
      x, y: one batch.
      repeats: timed repetitions per part (median reported).

    Returns:
      ``{"rule": name, "forward_backward": s, "precondition": s, "layers": {name: {"traces": s,
      "factors": s, "refresh": s}}, "refresh_total": s}`` where ``refresh`` is the update rule's
      work from the layer's new factors (``rule`` names the rule: see the module docstring) and
      ``refresh_total`` sums factors + refresh over layers (the cost of refreshing every block
      once).
    """
    engine = model.thor
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    optimizer = model.thor_optimizer  # also inside a LossScaleOptimizer
    x = tf.convert_to_tensor(x)
    y = tf.convert_to_tensor(y)
    variables = model.trainable_variables

    def forward_backward():
        with tf.GradientTape() as tape:
            with engine.store.step():
                y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        records = engine.store.take([b.name for b in engine.blocks])
        zs = [r.z for b in engine.blocks for r in records.get(b.name, [])]
        grads = tape.gradient(loss, list(variables) + zs)  # fit's step: one backward for both
        return records, grads[: len(variables)], grads[len(variables):]

    @tf.function
    def fb():
        _, grads, z_grads = forward_backward()
        return [g for g in grads + z_grads if g is not None]

    rule = engine.config.rule
    result = {"rule": rule.name, "forward_backward": _median_seconds(fb, repeats), "layers": {}}
    # Per-layer work timed on one concrete batch of captured tensors (no forward pass inside).
    loss_terms.clear()
    records, grads, z_grads = forward_backward()
    terms = engine.loss_terms(loss_terms.take(), tf.shape(x)[0], user_code=False)
    scale = fisher.term_scale(terms.scale, optimizer.loss_scale_factor)
    rows_per_term = {b.name: b.positions(records[b.name]) / terms.per_example
                     for b in engine.blocks if records.get(b.name)}
    refresh_total, k = 0.0, 0
    for block in engine.blocks:
        count = len(records.get(block.name, []))
        if not count:
            continue
        recs = records[block.name]
        gs = [g * scale for g in z_grads[k:k + count]]
        k += count
        split = optimizer.split_dim
        factor_a, factor_g = block.factor_a(recs, split), block.factor_g(gs, split)
        held = engine.state.layers[engine.block_position(block.name)]
        traces, factors = _layer_functions(block, recs, gs, split)
        refresh = _refresh_function(rule, block, (factor_a, factor_g), (held.A, held.G), split)
        timings = {
            "traces": _median_seconds(traces, repeats),
            "factors": _median_seconds(factors, repeats),
            "refresh": _median_seconds(refresh, repeats),
        }
        refresh_total += timings["factors"] + timings["refresh"]
        result["layers"][block.name] = timings
    result["refresh_total"] = refresh_total

    active = [b for b in engine.blocks if records.get(b.name)]
    precondition = tf.function(lambda: [
        g for g in engine.precondition(active, rows_per_term, grads, variables)[0]
        if g is not None])
    result["precondition"] = _median_seconds(precondition, repeats)
    return result
