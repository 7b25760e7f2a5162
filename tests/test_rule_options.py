"""Options on the rule they act on: the inverse rule's ``momentum``, ``damping_split``,
``kl_clip`` and ``inverse_assignment`` live on :class:`thor_tf.rules.Inverse`; ``wrap`` and
``ThorOptimizer`` still take them by name and hand them to it, refuse them (naming the rule) under
a rule that has no use for them, and load configs saved when they were top-level options."""

import dataclasses
import warnings

import keras
import numpy as np
import pytest

import thor_tf
from thor_tf.config import RULE_OPTIONS, ThorConfig, split_options
from thor_tf.rules import Eigenbasis, Inverse

NON_DEFAULT = {"momentum": 0.5, "kl_clip": 0.01, "damping_split": "pi",
               "inverse_assignment": "balanced"}


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3, activation="softmax")])


@pytest.mark.parametrize("name", RULE_OPTIONS)
def test_an_inverse_option_under_the_eigenbasis_rule_is_refused_naming_both(name):
    value = NON_DEFAULT[name]
    for make in (lambda: thor_tf.ThorOptimizer(**{name: value}),
                 lambda: thor_tf.wrap(_model(), verbose=False, **{name: value}),
                 lambda: split_options({"update_rule": Eigenbasis(beta_2=0.99), name: value})):
        with pytest.raises(ValueError) as err:
            make()
        text = str(err.value)
        assert f"`{name}`" in text and "inverse" in text and "'eigenbasis'" in text, text
        # The eigenbasis rule says why it has no use for the option.
        assert Eigenbasis.ignored_options[name] in text


def test_none_is_accepted_where_there_is_nothing_to_turn_off():
    opt = thor_tf.ThorOptimizer(kl_clip=None)
    assert opt.update_rule == Eigenbasis() and opt.kl_clip is None and opt.momentum is None


@pytest.mark.parametrize("name", RULE_OPTIONS)
def test_an_option_by_name_is_the_rule_holding_it(name):
    value = NON_DEFAULT[name]
    by_name = thor_tf.ThorOptimizer(update_rule="inverse", **{name: value})
    on_rule = thor_tf.ThorOptimizer(update_rule=Inverse(**{name: value}))
    assert by_name.update_rule == on_rule.update_rule == Inverse(**{name: value})
    assert getattr(by_name, name) == getattr(on_rule, name) == value
    assert by_name.get_config() == on_rule.get_config()
    assert name not in by_name.get_config()               # one home: the rule's config
    assert by_name.get_config()["update_rule"]["config"][name] == value


def test_an_option_given_twice_with_two_values_is_refused():
    with pytest.raises(ValueError, match="`momentum` is given twice"):
        thor_tf.ThorOptimizer(update_rule=Inverse(momentum=0.5), momentum=0.8)
    # The same value twice, or the rule's default by name, is one setting.
    assert thor_tf.ThorOptimizer(update_rule=Inverse(momentum=0.5), momentum=0.5).momentum == 0.5


@pytest.mark.parametrize("bad, match", [(dict(momentum=1.0), r"`momentum` must be a float in"),
                                        (dict(kl_clip=0.0), r"`kl_clip` must be None or"),
                                        (dict(damping_split="PI"), r"`damping_split` must be"),
                                        (dict(inverse_assignment="x"), "`inverse_assignment`")])
def test_bad_values_name_the_option(bad, match):
    with pytest.raises(ValueError, match=match):
        Inverse(**bad)
    with pytest.raises(ValueError, match=match):
        thor_tf.ThorOptimizer(update_rule="inverse", **bad)


def _old_config(**rule_options):
    """An optimizer config as releases before this change saved it: the four options top-level,
    whatever the rule (here: today's config with them added back)."""
    config = thor_tf.ThorOptimizer(update_rule=rule_options.pop("rule", None)).get_config()
    config.update({"momentum": 0.9, "kl_clip": 0.001, "inverse_assignment": "all",
                   "damping_split": "sqrt"})
    config.update(rule_options)
    return config


def _steps(optimizer, seed=0, steps=3):
    """Weights after ``steps`` steps of a small classifier (float64 copies)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    model = thor_tf.wrap(_model(), verbose=False)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    for _ in range(steps):
        model.train_on_batch(x, y)
    return [w.astype(np.float64) for w in model.get_weights()]


def test_old_configs_load_and_give_the_same_steps():
    # The inverse rule (saved by name) with a momentum of its own, top-level as it was saved.
    old = _old_config(rule="inverse", momentum=0.5)
    old["update_rule"] = "inverse"
    loaded = thor_tf.ThorOptimizer.from_config(old)
    assert loaded.update_rule == Inverse(momentum=0.5)
    for a, b in zip(_steps(loaded), _steps(thor_tf.ThorOptimizer(update_rule=Inverse(
            momentum=0.5)))):
        np.testing.assert_array_equal(a, b)
    # The eigenbasis rule with the four at their old defaults: they did nothing and are dropped.
    old = _old_config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # no warning: they were at their defaults
        loaded = thor_tf.ThorOptimizer.from_config(old)
    assert loaded.update_rule == Eigenbasis() and loaded.momentum is None
    for a, b in zip(_steps(loaded), _steps(thor_tf.ThorOptimizer())):
        np.testing.assert_array_equal(a, b)
    # Not at its default: still dropped (it never acted under this rule), with a warning.
    with pytest.warns(UserWarning, match=r"kl_clip=0.05 is not used by the 'eigenbasis'"):
        loaded = thor_tf.ThorOptimizer.from_config(_old_config(kl_clip=0.05))
    assert loaded.kl_clip is None
    # ThorConfig's own config (what ThorModel saves) the same way.
    cfg = ThorConfig.from_config({**ThorConfig().get_config(), "momentum": 0.9})
    assert cfg.rule == Eigenbasis()
    cfg = ThorConfig.from_config({**ThorConfig(update_rule="inverse").get_config(),
                                  "update_rule": "inverse", "momentum": 0.5})
    assert cfg.rule == Inverse(momentum=0.5)


@pytest.mark.parametrize("name", RULE_OPTIONS)
def test_the_rules_options_live_on_the_rule_only(name):
    """One home: ThorConfig has no field for a rule's option (it takes none by that name)."""
    assert name not in {f.name for f in dataclasses.fields(ThorConfig)}
    with pytest.raises(TypeError):
        ThorConfig(update_rule="inverse", **{name: NON_DEFAULT[name]})
    assert ThorConfig(update_rule=Inverse(**{name: NON_DEFAULT[name]})).rule == Inverse(
        **{name: NON_DEFAULT[name]})


@pytest.mark.parametrize("name, rule", [("inverse_momentum", Inverse(momentum=0.5, kl_clip=0.01)),
                                        ("eigenbasis", Eigenbasis(relative_epsilon=1e-2))])
def test_models_saved_by_the_release_before_load_and_continue_its_steps(name, rule):
    """``tests/data/saved_before_rule_options``: a model trained one step and saved by the code
    before the options moved (commit f346bef; the inverse rule with ``momentum=0.5,
    kl_clip=0.01`` given to ``wrap``, and the default rule, whose saved config held the four at
    their defaults, relative_epsilon 1e-2 then), and its weights after two more steps there.
    Loaded here, it has the rule with those options and its next two steps give the same
    weights."""
    import os

    here = os.path.join(os.path.dirname(__file__), "data", "saved_before_rule_options")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)     # nothing dropped that was set
        loaded = keras.models.load_model(os.path.join(here, f"{name}.keras"))
    assert loaded.optimizer.update_rule == rule
    before = loaded.get_weights()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    for _ in range(2):
        loaded.train_on_batch(x, y)
    expected = np.load(os.path.join(here, f"{name}_after_2_steps.npz"))
    # The steps were saved from one CPU's kernels: elsewhere the batch's sums round differently
    # (~sqrt(32)·eps ≈ 3e-7 relative), grown up to 1/ε_r = 100 by the eigenbasis rule's Adam
    # step: 1e-4 of the distance the two steps moved the weights (measured up to 1.2e-5 of it
    # with oneDNN off or its ISA capped, 1e-6 under the inverse rule; bitwise where saved).
    moved = max(np.abs(expected[f"arr_{k}"] - w).max() for k, w in enumerate(before))
    for k, w in enumerate(loaded.get_weights()):
        np.testing.assert_allclose(w, expected[f"arr_{k}"], rtol=0, atol=1e-4 * moved)
