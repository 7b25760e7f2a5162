"""Update rules: how a block's factors become its step (:class:`UpdateRule`).

* ``"eigenbasis"`` (:class:`Eigenbasis`, the default): Adam in the eigenbasis of each split
  factor block, bases renewed when THOR's trace rule refreshes the block.
* ``"inverse"`` (:class:`Inverse`): THOR's damped split inverses, KL clip, momentum.

``thor_tf.wrap(model, update_rule="inverse")`` or ``update_rule=thor_tf.rules.Eigenbasis(
beta_2=0.99)``. A new rule: one file with an :class:`UpdateRule` subclass, added to :data:`RULES`.
"""

from __future__ import annotations

import keras

from thor_tf.rules.base import UpdateRule
from thor_tf.rules.eigenbasis import Eigenbasis
from thor_tf.rules.inverse import Inverse

#: The rules by name (``update_rule="..."``).
RULES = {"eigenbasis": Eigenbasis, "inverse": Inverse}
DEFAULT_RULE = "eigenbasis"

__all__ = ["UpdateRule", "Eigenbasis", "Inverse", "RULES", "DEFAULT_RULE", "resolve", "serialize"]


def resolve(rule):
    """An :class:`UpdateRule` from a name in :data:`RULES`, an instance, or a serialized dict."""
    if isinstance(rule, UpdateRule):
        return rule
    if isinstance(rule, str) and rule in RULES:
        return RULES[rule]()
    if isinstance(rule, dict):
        made = keras.saving.deserialize_keras_object(rule)
        if isinstance(made, UpdateRule):
            return made
    raise ValueError(f"`update_rule` must be one of {sorted(RULES)} or a thor_tf.rules.UpdateRule "
                     f"instance; got {rule!r}.")


def serialize(rule):
    """The rule's name when it has its class's default options, else Keras' serialized dict."""
    if type(rule) in RULES.values() and rule == type(rule)():
        return rule.name
    return keras.saving.serialize_keras_object(rule)
