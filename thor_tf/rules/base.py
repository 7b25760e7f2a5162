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

A rule is chosen with ``thor_tf.wrap(model, update_rule=...)`` (a name from
:data:`thor_tf.rules.RULES` or an instance); a new rule is one new file with a subclass,
registered in :data:`thor_tf.rules.RULES`.
"""

from __future__ import annotations

import keras


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

    # -- state -------------------------------------------------------------------------------------
    def create_layer_state(self, optimizer, block, prefix, layout_a, layout_g):
        """The per-block state, factors included: an object with attributes ``A`` and ``G``
        (``[nb, d, d]`` float32 optimizer variables, created here in a fixed order with fixed
        names: checkpoints match by them) and a ``shapes()`` method. ``layout_a`` /
        ``layout_g``: ``(nb, d)`` of each factor's split."""
        raise NotImplementedError

    def build_slots(self, optimizer, var_list):
        """Create the optimizer's per-variable slots (called in ``ThorOptimizer.build``)."""
        raise NotImplementedError

    # -- the step ----------------------------------------------------------------------------------
    def refresh(self, refresher, layers, refresh, factors, damping):
        """Write the refreshing layers' products from their new ``factors`` (``[(A, G)]``
        aligned with ``layers``; the factors in use for the layers whose ``refresh`` flag is
        False). Called inside the cadence branch, on every replica with identical inputs."""
        raise NotImplementedError

    def precondition(self, engine, active, rows_per_term, grads, variables, ok, use_grads):
        """The gradients list with each active block's kernel/bias gradients replaced by its
        step; ``ok`` (bool scalar) False means the step is skipped: no state may change."""
        raise NotImplementedError

    def update_step(self, optimizer, gradient, variable, learning_rate):
        """Apply one variable's (preconditioned or raw) gradient (``ThorOptimizer.update_step``);
        ``optimizer.step_ok`` masks every change of a skipped step."""
        raise NotImplementedError

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
