"""``UpdateRule``: how a block's refreshed factors become its step, as one class.

THOR's engine (:mod:`thor_tf.engine`) owns everything a rule does not: the layer hooks, the
factors ``A`` and ``G`` of every block (split into diagonal blocks, :mod:`thor_tf.state`), the
trace rule that decides per block when they are refreshed, distribution, non-finite checks and
checkpoints. A rule says, in four places, what happens with them:

* :meth:`create_layer_state`: the per-block variables the rule keeps next to the factors
  (the inverse rule: split inverses; the eigenbasis rule: bases, eigenvalues, moments),
  created on the optimizer so that they are saved with it.
* :meth:`refresh`: at a cadence point, from the refreshing blocks' new factors (the global
  batch's, identical on every replica), the rule's per-block products (inverses, bases).
* :meth:`precondition`: every step, the blocks' gradients (the global batch's, unscaled)
  → the steps the optimizer applies.
* :meth:`build_slots` / :meth:`update_step`: the optimizer's per-variable chain (momentum, or
  Adam's moments for the variables without a block).
* :meth:`create_model_state` (optional): model-wide variables of the rule, created on the
  optimizer after the blocks' state (the eigenbasis rule's largest rate so far).

And :meth:`split_cost`: one small :class:`SplitCost` object, what a split costs the rule and
what it keeps, for the split calibration (:mod:`thor_tf.split.calibrate`, the H of THOR).

A rule is chosen with ``thor_tf.wrap(model, update_rule=...)`` (a name from
:data:`thor_tf.rules.RULES` or an instance); a new rule is one new file with a subclass,
registered in :data:`thor_tf.rules.RULES`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import keras
import numpy as np
import tensorflow as tf

from thor_tf.block_diagonal import diagonal_blocks, split_layout
from thor_tf.buckets import batched_layout


@dataclasses.dataclass(frozen=True)
class SideWork:
    """The work one factor side of a block costs a rule at one split (:meth:`SplitCost.
    side_work`): ``step`` runs every step, ``refresh`` when the block's products are renewed.
    Each is ``(fn, args)``: the rule's own ops as a Python function of tensors, and the tensors
    it is called with. The calibration traces the works of one candidate into one
    ``tf.function`` taking the tensors as arguments (not captured constants: nothing is folded
    away when the graph is optimized), as training runs them inside one step."""

    step: Tuple[Callable, tuple]
    refresh: Tuple[Callable, tuple]


def split_blocks(factor, split):
    """``(blocks [nb, d, d] float32, mask [nb, d] float32)``: the diagonal blocks of a dense
    ``[n, n]`` factor at ``split`` as training stores them (zero padding past ``n``) and the 1/0
    mask of their true entries."""
    factor = np.asarray(factor, np.float32)
    n = factor.shape[0]
    nb, d = split_layout(n, int(split))
    blocks = diagonal_blocks(factor, d)
    _, mask, _ = batched_layout([(0, nb, d, n)], d)
    return tf.constant(blocks), tf.constant(mask)


def side_matrix(dim, other_dim, side, seed=0):
    """A random ``[dim, other_dim]`` (side ``"A"``) or ``[other_dim, dim]`` (``"G"``) float32
    gradient matrix: what a step's work on one side is timed on (timing does not depend on
    the values)."""
    if side not in ("A", "G"):
        raise ValueError(f"`side` must be 'A' or 'G'; got {side!r}.")
    shape = (dim, other_dim) if side == "A" else (other_dim, dim)
    return tf.constant(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


class SplitCost:
    """What a split costs an update rule and what it keeps: the split calibration's view of a
    rule (:meth:`UpdateRule.split_cost`), built with the rule's options.

    * :meth:`side_work`: the work that depends on one factor side's split, per step and per
      refresh, as the traced functions training runs (the inverse rule: the product by the split
      inverse and the batched Cholesky; the eigenbasis rule: the rotations in and out and the
      basis refresh);
    * :meth:`fixed_work`: the rule's per-step work that no split changes;
    * :meth:`information_curve`: per candidate split, how much of what the rule uses of a factor
      the split keeps, in [0, 1];
    * :attr:`fallback`: the choice when the information curve stays below the speed curve at
      every candidate.
    """

    #: ``"largest"`` (the seed's: the most exact split timed), ``"cheapest"`` (no candidate
    #: keeps enough to pay for its work: the least work) or ``"default"`` (the curves cannot
    #: decide: the largest candidate up to the rule's default split).
    fallback = "largest"

    def side_work(self, factor, previous, split, other_dim, side):
        """:class:`SideWork` of one factor side at ``split``.

        Args:
          factor: ``[n, n]`` the factor a refresh sees (NumPy, undamped).
          previous: ``[n, n]`` the factor the products in use came from (a refresh that starts
            from them, e.g. a power step from the bases in use, is timed from there).
          split: the candidate split ``b`` (int >= 1).
          other_dim: the block's other side (the gradient matrix is ``[n, other_dim]`` for side
            ``"A"``, ``[other_dim, n]`` for ``"G"``).
          side: ``"A"`` or ``"G"``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not say what a split costs")

    def fixed_work(self, shapes):
        """The rule's per-step work that no split changes, on blocks of ``shapes``
        (``[(a_dim, g_dim)]``): ``(fn, args)`` as :attr:`SideWork.step`, or None (nothing worth
        timing). Part of the step the speed curve weighs a side's work against."""
        del shapes
        return None

    def information_curve(self, pairs, cands):
        """Per candidate split, what the split keeps of the factors ``pairs``
        (``[(F_batch1, F_batch2)]``, NumPy ``[n, n]``, one dimension), in [0, 1]."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a split keeps")


class UpdateRule:
    """Base class of update rules (see the module docstring). Subclasses set ``name`` and
    ``default_learning_rate`` (the peak rate the suite measured best for the rule; what
    ``learning_rate=None`` and ``WarmupCosine(steps)`` without a peak become) and, optionally,
    ``reference_steps`` (the run length that rate holds up to)."""

    name = None
    default_learning_rate = None
    #: The run length (optimizer steps) ``default_learning_rate`` was measured best at: a longer
    #: run of the default schedule takes the peak ``default_learning_rate·sqrt(reference_steps/T)``
    #: (:class:`thor_tf.schedules.WarmupCosine`'s ``reference_steps``). None: one peak for every
    #: length.
    reference_steps = None
    #: Whether the rule's step depends on ``damping`` (the "G below the damping" warning).
    uses_damping = False
    #: ``split_dim`` when none is given (an int or a :class:`thor_tf.split.plan.SplitPlan`).
    default_split = 128

    # -- state -------------------------------------------------------------------------------------
    def create_layer_state(self, optimizer, block, prefix, layout_a, layout_g):
        """The per-block state, factors included: an object with attributes ``A`` and ``G``
        (``[nb, d, d]`` float32 optimizer variables, created here in a fixed order with fixed
        names: checkpoints match by them) and a ``shapes()`` method. ``layout_a`` /
        ``layout_g``: ``(nb, d)`` of each factor's split."""
        raise NotImplementedError

    def create_model_state(self, optimizer):
        """The rule's model-wide state (optimizer variables created here, after every block's,
        in a fixed order with fixed names), kept as ``ThorState.rule_state`` and read by the
        rule through ``step.state.rule_state``; None (the default) for none."""
        return None

    def build_slots(self, optimizer, var_list):
        """The rule's per-variable slots, created with ``optimizer.add_variable_from_reference``
        (called in ``ThorOptimizer.build``, saved with the optimizer): ``{name: [one per
        variable of var_list]}``, which the optimizer keeps as ``optimizer.slots``
        (:meth:`thor_tf.ThorOptimizer.slot` reads one); ``{}`` for none."""
        raise NotImplementedError

    # -- the step ----------------------------------------------------------------------------------
    def refresh(self, step, layers, refresh, factors, damping):
        """Write the refreshing layers' products from their new ``factors`` (``[(A, G)]``
        aligned with ``layers``; the factors in use for the layers whose ``refresh`` flag is
        False) into their state (``step.state.layers[layer.index]``; ``step``: the
        :class:`~thor_tf.rules.step.Step`, all the rule sees of the engine). Called inside the
        cadence branch, on every replica with identical inputs."""
        raise NotImplementedError

    def precondition(self, step, active, rows_per_term, grads, variables, use_grads):
        """``(gradients, marked)``: the gradients list with each active block's kernel/bias
        gradients replaced by its step, and the positions (in ``variables``) the rule marks for
        its own :meth:`update_step` (``optimizer.marked(variable)``: e.g. "already a step").
        ``step`` (:class:`~thor_tf.rules.step.Step`): each block's state (``step.layer(b)``),
        the step count, rate and clip, and ``step.ok`` (bool scalar): False means the step is
        skipped, no state may change."""
        raise NotImplementedError

    def update_step(self, optimizer, gradient, variable, learning_rate):
        """Apply one variable's (preconditioned or raw) gradient (``ThorOptimizer.update_step``);
        ``optimizer.step_ok`` masks every change of a skipped step, ``optimizer.marked(variable)``
        says whether :meth:`precondition` marked it in this step."""
        raise NotImplementedError

    # -- what a split costs and keeps (the split calibration) -----------------------------------
    def split_cost(self):
        """The :class:`SplitCost` of this rule (with its options)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a split costs it")

    # -- config ------------------------------------------------------------------------------------
    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))

    def __repr__(self):
        options = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({options})"


def keras_serializable(cls):
    """Register a rule class with Keras' serialization (``package="thor_tf"``)."""
    return keras.saving.register_keras_serializable(package="thor_tf")(cls)
