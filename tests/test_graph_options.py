"""``graph_optimization``: the passes TensorFlow's graph optimizer runs over THOR's train step.

The option changes how the step's graph is optimized, never what it computes: a run under
``"light"`` and one under ``"full"`` give the same weights (to float32 round-off), and both match
SGD's arithmetic where THOR reduces to it. The swap of the context's call options is checked
directly (what a call sees, and that it is restored), and a process that sets its own rewrite
options keeps them.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import thor_tf
from digits_models import digits, small_cnn
from thor_tf import graph_options

LOSS = "sparse_categorical_crossentropy"


def _seen_config():
    """The ``ConfigProto`` that a function called now would be optimized with."""
    return config_pb2.ConfigProto.FromString(
        context.context().function_call_options.config_proto_serialized)


def test_bad_value_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"`graph_optimization` must be one of \['auto', "
                                         r"'full', 'light'\]; got 'fast'"):
        thor_tf.wrap(small_cnn(), graph_optimization="fast", verbose=False)
    with pytest.raises(ValueError, match="graph_optimization"):
        graph_options.resolve(None)


def test_auto_means_light_without_a_gpu():
    assert not tf.config.list_logical_devices("GPU")  # this test machine
    assert graph_options.SUPPORTED  # TF 2.16 (the floor) and 2.21 have the context's options
    assert graph_options.resolve("auto") == "light"
    assert graph_options.resolve("full") == "full"


def test_light_config_keeps_the_rest_of_the_config():
    base = config_pb2.ConfigProto(intra_op_parallelism_threads=3, allow_soft_placement=True)
    light = graph_options.light_config(base)
    rewrite = light.graph_options.rewrite_options
    assert list(rewrite.optimizers) == ["remap"]
    assert rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.ONE
    assert light.intra_op_parallelism_threads == 3 and light.allow_soft_placement
    assert base.graph_options.rewrite_options == rewriter_config_pb2.RewriterConfig()  # a copy
    # A config with rewrite options of the user's is left to them.
    user = config_pb2.ConfigProto()
    user.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    assert graph_options.light_config(user) is None


def test_calls_see_the_light_options_and_the_context_is_restored():
    seen = []
    wrapped = graph_options.apply(lambda x: seen.append(_seen_config()) or x + 1, "light")
    before = context.context().function_call_options
    assert wrapped(1) == 2
    assert list(seen[0].graph_options.rewrite_options.optimizers) == ["remap"]
    assert context.context().function_call_options is before
    assert list(_seen_config().graph_options.rewrite_options.optimizers) == []

    def failing(_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        graph_options.apply(failing, "light")(0)
    assert context.context().function_call_options is before
    assert graph_options.apply(failing, "full") is failing


def test_user_rewrite_options_are_kept():
    seen = []
    wrapped = graph_options.apply(lambda: seen.append(_seen_config()), "light")
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    try:
        wrapped()
    finally:
        tf.config.optimizer.set_experimental_options({"constant_folding": True})
        context.context()._optimizer_experimental_options.pop("constant_folding", None)
        context.context()._thread_local_data.function_call_options = None
    rewrite = seen[0].graph_options.rewrite_options
    assert list(rewrite.optimizers) == []
    assert rewrite.constant_folding == rewriter_config_pb2.RewriterConfig.OFF


def _train(mode, steps=8):
    x, y = digits(32 * steps)
    model = thor_tf.wrap(small_cnn(), learning_rate=0.01, frequency=2, graph_optimization=mode,
                         verbose=False)
    model.compile(loss=LOSS)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return model


def test_light_and_full_train_the_same_weights():
    light, full = _train("light"), _train("full")
    assert isinstance(light.train_function, graph_options.LightGraphFunction)
    assert not isinstance(full.train_function, graph_options.LightGraphFunction)
    refreshes = sum(s["refreshes"] for s in light.thor.layer_stats())
    assert refreshes >= 6  # several refreshes happened inside the compared steps
    start = [w.numpy() for w in small_cnn().weights]
    for a, b, w0 in zip(light.model.weights, full.model.weights, start):
        moved = np.abs(b.numpy() - w0).max()
        assert moved > 1e-3  # the runs trained
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-5 + 1e-4 * moved)


def test_config_round_trip_and_old_configs():
    model = thor_tf.wrap(small_cnn(), graph_optimization="full", verbose=False)
    config = model.get_config()
    assert config["graph_optimization"] == "full"
    again = thor_tf.ThorModel.from_config(config)
    assert again._graph_optimization == "full"
    config.pop("graph_optimization")  # saved before the option existed
    assert thor_tf.ThorModel.from_config(config)._graph_optimization == "auto"
