"""How TensorFlow optimizes the graph of a wrapped model's train step.

TensorFlow runs its graph optimizer (grappler) over a ``tf.function``'s graph when the function
is first called. Its cost grows with the graph, and THOR's train step is a large graph (the
model's forward and backward plus capture, factor statistics, refresh, preconditioning and
Newton–Schulz: on ResNet-20 ~16k nodes before optimization against a few thousand for Adam's
step). On a 2-core CPU grappler's default passes took ~3.4 s of ResNet-20's first call under THOR
(~21 s of DenseNet121's) and bought at most ~3 % of the steady step (DenseNet121 1.03×, nothing
measurable on the suite's models), except the remapper, which fuses ``Conv2D + BiasAdd + Relu``
and ``MatMul + BiasAdd`` into oneDNN kernels (without it the Fashion-MNIST CNN's step is ~25 %
slower). See docs/overhead.md ("Graph optimization of the first call").

It swaps ``FunctionCallOptions`` on TensorFlow's eager context (``tensorflow.python.eager``, not
public API; tested on TF 2.16 and 2.21): in a TensorFlow without them the train step runs as
plain Keras's (:data:`SUPPORTED`).

``graph_optimization`` (an argument of :func:`thor_tf.wrap`):

* ``"light"``: the train step's calls run with grappler reduced to the remapper, one iteration;
* ``"full"``: TensorFlow's default passes, as plain Keras runs them;
* ``"auto"`` (default): ``"light"`` when TensorFlow sees no GPU, ``"full"`` otherwise (on a GPU
  the layout optimizer and mixed-precision rewrites matter, and were not measured here).

The setting applies only to the calls of the wrapped model's train function, by swapping the
eager context's function-call options around each call; every other function in the process
(the user's, ``evaluate``/``predict``, tf.data) keeps TensorFlow's options. When the process
already sets its own rewrite options (``tf.config.optimizer.set_experimental_options`` or a
``ConfigProto``), they are respected and ``"light"`` changes nothing.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

GRAPH_OPTIMIZATIONS = ("auto", "full", "light")

#: Grappler's passes under ``"light"`` (grappler's own names for them).
LIGHT_PASSES = ("remap",)

#: Whether this TensorFlow has the eager context's call options ``"light"`` swaps.
SUPPORTED = (hasattr(context, "FunctionCallOptions")
             and isinstance(getattr(context.Context, "function_call_options", None), property))


def check_graph_optimization(value):
    """``value`` if it is one of :data:`GRAPH_OPTIMIZATIONS`, else ``ValueError`` naming them."""
    if not isinstance(value, str) or value not in GRAPH_OPTIMIZATIONS:
        raise ValueError(f"`graph_optimization` must be one of {list(GRAPH_OPTIMIZATIONS)}; "
                         f"got {value!r}.")
    return value


def resolve(value):
    """``"light"`` or ``"full"``: what ``value`` means on this machine."""
    check_graph_optimization(value)
    if value != "auto":
        return value
    return "full" if tf.config.list_logical_devices("GPU") else "light"


def light_config(base):
    """A copy of ``base`` (a ``ConfigProto``) whose grappler runs only :data:`LIGHT_PASSES`, one
    iteration; None when ``base`` already carries rewrite options of the user's."""
    if base.graph_options.rewrite_options != rewriter_config_pb2.RewriterConfig():
        return None
    config = config_pb2.ConfigProto()
    config.CopyFrom(base)
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.extend(LIGHT_PASSES)
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    return config


class LightGraphFunction:
    """``fn`` (a Keras train function) whose calls run with :func:`light_config`'s options.

    The options are swapped in on the calling thread for the call only: tracing and the first
    call's graph optimization happen inside it, and later calls reuse the instantiated graph
    (the options are part of the call, so every call passes the same ones).
    """

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())
        self._cache = (None, None)  # (the context's options it was built from, the light ones)

    def _light_options(self, current):
        base, light = self._cache
        if base is not current:
            config = light_config(config_pb2.ConfigProto.FromString(
                current.config_proto_serialized or b""))
            light = None if config is None else context.FunctionCallOptions(
                executor_type=current.executor_type, config_proto=config)
            self._cache = (current, light)
        return light

    def __call__(self, *args, **kwargs):
        ctx = context.context()
        current = ctx.function_call_options
        light = self._light_options(current)
        if light is None:
            return self.fn(*args, **kwargs)
        ctx.function_call_options = light
        try:
            return self.fn(*args, **kwargs)
        finally:
            ctx.function_call_options = current


def apply(fn, value):
    """``fn`` as the train function under ``graph_optimization=value``."""
    if (fn is None or resolve(value) == "full" or not SUPPORTED
            or isinstance(fn, LightGraphFunction)):
        return fn
    return LightGraphFunction(fn)
