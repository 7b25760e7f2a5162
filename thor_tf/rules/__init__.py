"""Update rules: how a block's factors become its step (:class:`UpdateRule`).

* ``"eigenbasis"`` (:class:`Eigenbasis`, the default): Adam in the eigenbasis of each split
  factor block, bases renewed when THOR's trace rule refreshes the block (a power step and QR
  from the basis in use, ``refresh="power_qr"``), the step then orthogonalized by Newton–Schulz
  at its own norm (``step="orthogonal"``).
* ``"eigenbasis_adam"``: the same without the orthogonalization (``Eigenbasis(step="adam")``,
  the default of the previous release).
* ``"inverse"`` (:class:`Inverse`): THOR's damped split inverses, KL clip, momentum.

``thor_tf.wrap(model, update_rule="inverse")`` or ``update_rule=thor_tf.rules.Eigenbasis(
beta_2=0.99)``. A new rule: one file with an :class:`UpdateRule` subclass, added to :data:`RULES`.
"""

from __future__ import annotations

import functools

import keras

from thor_tf.rules.base import UpdateRule
from thor_tf.rules.eigenbasis import Eigenbasis
from thor_tf.rules.inverse import Inverse

#: The rules by name (``update_rule="..."``): a factory of the rule with those settings.
RULES = {"eigenbasis": Eigenbasis, "eigenbasis_adam": functools.partial(Eigenbasis, step="adam"),
         "inverse": Inverse}
DEFAULT_RULE = "eigenbasis"
#: What a name meant in configs saved by earlier releases, where it differs from today's: the
#: Adam step before step="orthogonal" was the default, and both names refreshed by float64 eigh
#: before refresh="power_qr" was.
_SAVED_NAMES = {"eigenbasis": functools.partial(Eigenbasis, step="adam", refresh="eigh"),
                "eigenbasis_adam": functools.partial(Eigenbasis, step="adam", refresh="eigh")}

__all__ = ["UpdateRule", "Eigenbasis", "Inverse", "RULES", "DEFAULT_RULE", "resolve", "serialize",
           "from_saved", "with_options", "takes_option"]


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
    """The rule's name when it is a named rule whose name has meant the same settings in every
    release (``"inverse"``), else Keras' serialized dict (all its options)."""
    for name, make in RULES.items():
        if name not in _SAVED_NAMES and rule == make():
            return name
    return keras.saving.serialize_keras_object(rule)


def from_saved(rule):
    """``update_rule`` as a saved config holds it → what :func:`resolve` takes: a bare name
    saved when it meant other settings (``"eigenbasis"``: the Adam step; it and
    ``"eigenbasis_adam"``: ``refresh="eigh"``) becomes a rule with them."""
    if isinstance(rule, str) and rule in _SAVED_NAMES:
        return _SAVED_NAMES[rule]()
    return rule


def takes_option(rule, name):
    """Whether ``rule`` (an instance) has option ``name`` (a key of its ``get_config``)."""
    return name in rule.get_config()


def _owners(name):
    """The names of the rules in :data:`RULES` that take option ``name``."""
    return [n for n, make in RULES.items() if takes_option(make(), name)]


def with_options(rule, options):
    """``rule`` with ``options`` (``{name: value}``, given to ``wrap`` / ``ThorOptimizer`` by
    name) set on it: ``wrap(model, update_rule="inverse", kl_clip=None)`` is
    ``update_rule=Inverse(kl_clip=None)``.

    Raises ``ValueError`` naming the option and the rule when the rule in use does not take it
    (with the rule's reason, e.g. the eigenbasis rule keeps Adam's moments instead of
    ``momentum``), and when the rule instance already sets it to another value. None for an
    option the rule does not take is accepted (nothing to turn off: e.g. ``kl_clip=None``)."""
    if not options:
        return rule
    config = rule.get_config()
    defaults = type(rule)().get_config()
    changed = {}
    for name, value in options.items():
        if name not in config:
            if value is None:
                continue
            owners = _owners(name)
            reason = getattr(rule, "ignored_options", {}).get(name)
            raise ValueError(
                f"`{name}` is an option of the {' and '.join(owners) or 'no'} rule; the update "
                f"rule in use, {rule.name!r} ({rule!r}), does not use it"
                f"{': ' + reason if reason else ''}. Remove `{name}`, or choose a rule that "
                f"takes it (update_rule={owners[0]!r} or thor_tf.rules."
                f"{type(RULES[owners[0]]()).__name__}({name}=...))." if owners else
                f"`{name}` is not an option of the update rule {rule!r}.")
        if config[name] != defaults[name] and config[name] != value:
            raise ValueError(
                f"`{name}` is given twice, {value!r} to wrap/ThorOptimizer and {config[name]!r} "
                f"on update_rule={rule!r}; give it once (on the rule).")
        changed[name] = value
    if all(config[k] == v for k, v in changed.items()):
        return rule
    return type(rule).from_config({**config, **changed})
