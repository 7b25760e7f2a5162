"""Collectives of data-parallel THOR: what replicas exchange so that R replicas take the
single-device step on the same global batch.

Under a ``tf.distribute`` strategy with ``R > 1`` replicas in sync, each replica sees its local
batch. THOR's step needs global quantities, so it exchanges (DESIGN §3.7):

* every step: the gradients (``SUM`` of Keras' replica-divided gradients = the global batch's
  gradient, as Keras' own optimizers get it), before preconditioning; the KL clip then sees global
  quantities and every replica computes the same update;
* at a cadence point: the traces of the live layers (one packed collective, so every replica
  takes the same refresh / reuse / freeze decisions), then, only if some layer refreshes, the
  factors of the refreshing layers (one packed collective; rows weighted by each replica's batch
  size, so the result is the factor of the global batch), and with ``inverse_assignment=
  "balanced"`` the inverses each replica computed for the layers assigned to it (one packed
  collective).

TF forbids collectives inside a ``tf.cond`` taken in a replica context (they synchronize through
``merge_call``). :func:`run_if` runs a replica function under a condition the replicas agree on by
leaving the replica context (``merge_call``), branching in the cross-replica context and entering
every replica again (``call_for_each_replica``): the pattern of Keras' ``LossScaleOptimizer``.
Nothing here adds a collective on one replica.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def replica_context():
    """The replica context when more than one replica trains in sync, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return None
    return context


def num_replicas():
    """Replicas training in sync (1 without a strategy)."""
    context = tf.distribute.get_replica_context()
    return 1 if context is None else int(context.num_replicas_in_sync)


def replica_id():
    """This replica's index in its sync group (int32 scalar tensor; 0 on one replica)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return tf.constant(0, tf.int32)
    return tf.cast(context.replica_id_in_sync_group, tf.int32)


def sum_gradients(grads):
    """All-reduce (SUM) the gradients over replicas; ``None`` entries stay None.

    Keras divides each replica's loss by ``R``, so the sum is the gradient of the global batch.
    ``IndexedSlices`` (an embedding lookup's gradient) are reduced as such.
    """
    context = replica_context()
    if context is None:
        return list(grads)
    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    reduced = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present))
    return [None if g is None else next(reduced) for g in grads]


def weighted_mean(tensors, weight):
    """``Σ_r w_r·t_r / Σ_r w_r`` of each tensor over replicas, packed into one collective.

    Args:
      tensors: float32 tensors (any shapes).
      weight: this replica's weight (its local batch size): factors and traces are means over
        rows, so weighting by the rows makes the result the global batch's mean even when the
        replicas' batches differ in size (the last batch of an epoch). A list gives each tensor
        its own weight (a scalar, or a tensor broadcastable to it): the valid rows of each layer
        under a masked loss.

    Returns:
      The reduced tensors, shaped as given (the inputs themselves on one replica).
    """
    context = replica_context()
    if context is None or not tensors:
        return list(tensors)
    if not isinstance(weight, (list, tuple)):
        weight = tf.cast(weight, tf.float32)
        packed = pack([t * weight for t in tensors] + [tf.reshape(weight, [1])])
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, packed)
        *values, weights = unpack(total, [t.shape for t in tensors] + [tf.TensorShape([1])])
        return [v / weights[0] for v in values]
    weights = [tf.cast(w, tf.float32) for w in weight]
    packed = pack([t * w for t, w in zip(tensors, weights)] + weights)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, packed)
    reduced = unpack(total, [t.shape for t in tensors] + [w.shape for w in weights])
    n = len(tensors)
    return [v / tf.maximum(w, 1e-30) for v, w in zip(reduced[:n], reduced[n:])]


def sum_packed(tensors):
    """``Σ_r t_r`` of each tensor over replicas, packed into one collective."""
    context = replica_context()
    if context is None or not tensors:
        return list(tensors)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, pack(tensors))
    return unpack(total, [t.shape for t in tensors])


def pack(tensors):
    """Flatten and concatenate float32 tensors of static shape into one vector."""
    return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)


def unpack(vector, shapes):
    """Inverse of :func:`pack` for the given static shapes."""
    sizes = [int(np.prod(s.as_list() if isinstance(s, tf.TensorShape) else s)) for s in shapes]
    parts = tf.split(vector, sizes) if len(sizes) > 1 else [vector]
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def run_if(flag, fn):
    """Run ``fn()`` on every replica where the replica-consistent boolean ``flag`` holds; ``fn``
    may use collectives (and :func:`run_if` again). ``fn`` returns nothing: it writes variables.

    On one replica (or where the strategy needs no ``merge_call``, e.g. XLA on GPUs) this is a
    ``tf.cond``. Otherwise ``fn`` is this replica's closure: each replica hands its own to
    ``merge_call``, which regroups them, and the cross-replica branch calls each replica's.
    """
    def branch():
        fn()
        return tf.constant(0)

    context = tf.distribute.get_replica_context()
    if (context is None or context.num_replicas_in_sync <= 1
            or tf.__internal__.distribute.strategy_supports_no_merge_call()):
        tf.cond(flag, branch, lambda: tf.constant(0))
        return

    def cross_replica(strategy, flag, fn):
        # The replicas agree on ``flag``: the first local value stands for all.
        flag = strategy.experimental_local_results(flag)[0]

        def each_replica():
            strategy.extended.call_for_each_replica(lambda f: f(), args=(fn,))
            return tf.constant(0)

        tf.cond(flag, each_replica, lambda: tf.constant(0))

    context.merge_call(cross_replica, args=(flag, fn))


def balanced_owners(costs, replicas):
    """Assign items of the given costs to ``replicas`` owners, greedily balancing the load.

    Longest-processing-time first (KAISA's and kfac-jax's choice): the costliest item goes to the
    least-loaded owner. Returns a list of owner indices aligned with ``costs``; deterministic
    (ties by index), so every replica computes the same assignment.
    """
    loads = [0.0] * max(int(replicas), 1)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        target = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = target
        loads[target] += costs[i]
    return owners


def balanced_block_owners(block_costs, replicas):
    """Assign every diagonal block of every layer to one of ``replicas`` owners (longest-processing-
    time over all blocks at once).

    :func:`balanced_owners` makes a layer the unit: one layer holding most of the inversion work
    (the CNN's dense1, 83 % of it in 25 blocks of 128) caps the cut at that share. Blocks of one
    size cost the same, so spreading them over replicas takes the slowest replica's load to
    ``~max(total / R, largest block)``.

    Args:
      block_costs: per layer, the cost of each of its blocks (e.g. ``d³``, A's blocks then G's).
      replicas: number of owners.

    Returns:
      Per layer, a list of owner indices aligned with its blocks. Deterministic (ties by layer,
      then block index, then owner index), so every replica computes the same assignment.
    """
    flat = [(float(cost), layer, k) for layer, costs in enumerate(block_costs)
            for k, cost in enumerate(costs)]
    owners = balanced_owners([cost for cost, _, _ in flat], replicas)
    out = [[0] * len(costs) for costs in block_costs]
    for (_, layer, k), owner in zip(flat, owners):
        out[layer][k] = owner
    return out
