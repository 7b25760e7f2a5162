"""``Step``: what an update rule sees of the training step it works in, and nothing else.

The engine builds one per call of :meth:`~thor_tf.rules.UpdateRule.refresh` and
:meth:`~thor_tf.rules.UpdateRule.precondition` (inside the traced train step). A rule reads its
blocks' state and the step's scalars from it; it never receives the engine, the refresher or the
optimizer there, so what a rule depends on is this class's attributes: a rule that reaches for
anything else fails with an ``AttributeError`` naming it (``__slots__``, no instance dict).
"""

from __future__ import annotations

__all__ = ["Step"]


class Step:
    """One step as a rule sees it.

    Attributes:
      state: the curvature state (:class:`thor_tf.state.ThorState`): ``state.layers[i]`` is the
        object the rule's ``create_layer_state`` made for block ``i`` (:meth:`layer` finds it
        by block), next to the model-wide counters (``kl_scale``, ...).
      iterations: the steps taken before this one (the optimizer's int64 counter variable).
      clip_norm: the configured clip of a block's step (``ThorConfig.clip_norm``; None: none).
      ok: bool scalar tensor, False in a step that is skipped (non-finite loss or gradients):
        the rule changes no state then. Always True at a cadence point (one runs only in a
        finite step).
      learning_rate: this step's rate (float32 scalar tensor; read when asked, so a rule that
        does not use it adds no op).
    """

    __slots__ = ("state", "iterations", "clip_norm", "ok", "_positions", "_slot", "_rate")

    def __init__(self, state, positions, iterations, rate, slot, clip_norm=None, ok=True):
        self.state = state
        self.iterations = iterations
        self.clip_norm = clip_norm
        self.ok = ok
        self._positions = positions   # {block name: index in state.layers}
        self._slot = slot             # (name, variable) -> the rule's slot of that variable
        self._rate = rate             # () -> the step's learning rate

    def layer(self, block):
        """The rule's state of ``block`` (a registered block: its ``create_layer_state``)."""
        return self.state.layers[self._positions[block.name]]

    def slot(self, name, variable):
        """The rule's slot ``name`` of ``variable`` (what its ``build_slots`` made)."""
        return self._slot(name, variable)

    @property
    def learning_rate(self):
        return self._rate()

    def __setattr__(self, name, value):
        if hasattr(self, "_rate"):  # set once, in __init__
            raise AttributeError(f"Step is read-only: cannot set {name!r}")
        object.__setattr__(self, name, value)
