"""Where a THOR step spends its time: capture + backward, traces, factors, inversion, preconditioning.

``profile_step(model, x, y)`` times each part of the train step as its own ``tf.function`` on one
batch (median of repeats after a warm-up run), per registered layer where the work is per layer.
The parts are what the fused train step does; timing them apart shows what a refresh costs
(factors + inversion) against what every step costs (forward/backward + preconditioning).
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from thor_tf import fisher, loss_terms
from thor_tf.rules.inverse_ops import factor_dampings, invert_blocks


def _median_seconds(fn, repeats):
    fn()  # trace + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _layer_functions(block, recs, gs, factor_a, factor_g, dampings, split_dim):
    """tf.functions (no arguments: the captured tensors are constants) for one layer's work."""
    traces = tf.function(lambda: (block.trace_a(recs), block.trace_g(gs)))
    factors = tf.function(lambda: (block.factor_a(recs, split_dim), block.factor_g(gs, split_dim)))
    inverse = tf.function(lambda: (invert_blocks(factor_a, dampings[0], block.a_dim),
                                   invert_blocks(factor_g, dampings[1], block.g_dim)))
    return traces, factors, inverse


def profile_step(model, x, y, repeats=5):
    """Seconds per part of a THOR step for one batch ``(x, y)``.

    Args:
      model: a compiled model returned by :func:`thor_tf.wrap`.
      x, y: one batch.
      repeats: timed repetitions per part (median reported).

    Returns:
      ``{"forward_backward": s, "precondition": s, "layers": {name: {"traces": s, "factors": s,
      "inverse": s}}, "refresh_total": s}`` where ``refresh_total`` sums factors + inverse over
      layers (the cost of refreshing every block once).
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

    result = {"forward_backward": _median_seconds(fb, repeats), "layers": {}}
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
        # Each factor's damping as the step's refresh takes it (``damping_split``).
        damping = factor_dampings(optimizer.current_damping() / rows_per_term[block.name], factor_a,
                                  factor_g, block.a_dim, block.g_dim, optimizer.damping_split)
        traces, factors, inverse = _layer_functions(block, recs, gs, factor_a, factor_g, damping,
                                                    split)
        timings = {
            "traces": _median_seconds(traces, repeats),
            "factors": _median_seconds(factors, repeats),
            "inverse": _median_seconds(inverse, repeats),
        }
        refresh_total += timings["factors"] + timings["inverse"]
        result["layers"][block.name] = timings
    result["refresh_total"] = refresh_total

    active = [b for b in engine.blocks if records.get(b.name)]
    precondition = tf.function(lambda: [
        g for g in engine.precondition(active, rows_per_term, grads, variables) if g is not None])
    result["precondition"] = _median_seconds(precondition, repeats)
    return result
