"""Layer capture: find the layers THOR can precondition and record their inputs and outputs.

Keras 3 has no forward or backward hooks, and ``layer.output`` is a symbolic tensor from model
construction, so ``tape.gradient(loss, layer.output)`` gives None. What works (DESIGN.md §6) is to
replace ``call`` on the layer *instance* with a wrapper that computes the pre-activation ``z``
itself, records ``(inputs, z)`` and returns ``activation(z)``. The train step then asks the tape for
``d loss / d z`` next to the parameter gradients, in the same single backward pass.

Conventions
-----------
* Dense: ``z = x @ kernel (+ bias)``; ``x`` is ``[..., in]``, ``z`` is ``[..., out]``.
* Conv2D (channels_last, groups=1): ``z = conv(x, kernel) (+ bias)``; ``x`` is ``[N, H, W, Cin]``,
  ``z`` is ``[N, Ho, Wo, Cout]``.
* Only while a :class:`CaptureStore` is *recording* (inside THOR's train step) are tensors kept;
  ``predict``/``evaluate`` run the same arithmetic and record nothing.
* The store is thread-local because ``tf.distribute.MirroredStrategy`` runs each replica's train
  step in its own thread.
* The wrapper computes exactly what the layer's own ``call`` computes, so wrapping does not change
  predictions; ``unpatch`` deletes the instance attribute and restores the class method.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import keras
from keras import ops


@dataclass
class Record:
    """One call of a registered layer in the current forward pass.

    ``inputs``: the layer input as the layer saw it (compute dtype).
    ``z``: the pre-activation output (compute dtype) that the tape differentiates against.
    """

    inputs: object
    z: object


class CaptureStore:
    """Per-thread store of :class:`Record` lists keyed by block name.

    Held outside Keras attribute tracking on purpose: a list assigned to a Keras object becomes
    tracked state and raises when appended inside ``call``.
    """

    def __init__(self):
        self._local = threading.local()

    @property
    def recording(self) -> bool:
        return getattr(self._local, "records", None) is not None

    @contextlib.contextmanager
    def record(self):
        """Context in which patched layers append their ``(inputs, z)``; yields the dict."""
        previous = getattr(self._local, "records", None)
        self._local.records = {}
        try:
            yield self._local.records
        finally:
            self._local.records = previous

    def add(self, key: str, inputs, z) -> None:
        records = getattr(self._local, "records", None)
        if records is not None:
            records.setdefault(key, []).append(Record(inputs, z))


def unsupported_reason(layer, check_trainable=True) -> str | None:
    """Why ``layer`` (a Dense or Conv2D) cannot get a Kronecker block, or None if it can.

    With ``check_trainable=False`` only structural reasons count (a frozen layer can be unfrozen
    later; the engine decides per compile which layers train).
    """
    if layer.kernel is None:
        return "not built"
    if check_trainable and not layer.trainable:
        return "not trainable"
    if check_trainable and not getattr(layer.kernel, "trainable", True):
        return "kernel not trainable"
    if getattr(layer, "lora_enabled", False):
        return "LoRA enabled"
    policy = getattr(layer, "dtype_policy", None)
    if getattr(policy, "quantization_mode", None):
        return "quantized"
    if isinstance(layer, keras.layers.Conv2D):
        if getattr(layer, "groups", 1) != 1:
            return f"groups={layer.groups}"
        if layer.data_format != "channels_last":
            return "channels_first"
    return None


def _dense_call(layer, store: CaptureStore, key: str):
    def call(inputs, training=None):
        z = ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = ops.add(z, layer.bias)
        store.add(key, inputs, z)
        return layer.activation(z) if layer.activation is not None else z

    return call


def _conv2d_call(layer, store: CaptureStore, key: str):
    def call(inputs):
        z = layer.convolution_op(inputs, layer.kernel)
        if layer.use_bias:
            z = ops.add(z, ops.reshape(layer.bias, (1, 1, 1, layer.filters)))
        store.add(key, inputs, z)
        return layer.activation(z) if layer.activation is not None else z

    return call


def patch(layer, store: CaptureStore, key: str) -> None:
    """Replace ``layer.call`` on the instance with a recording wrapper (same signature)."""
    if isinstance(layer, keras.layers.Conv2D):
        wrapper = _conv2d_call(layer, store, key)
    elif isinstance(layer, keras.layers.Dense):
        wrapper = _dense_call(layer, store, key)
    else:  # pragma: no cover - guarded by the registry
        raise TypeError(f"cannot patch layer {layer.name!r} of type {type(layer).__name__}")
    # object.__setattr__ keeps the closure out of Keras attribute tracking.
    object.__setattr__(layer, "call", wrapper)
    object.__setattr__(layer, "_thor_patched", True)


def unpatch(layer) -> None:
    """Restore the class ``call`` of a patched layer."""
    if layer.__dict__.get("_thor_patched"):
        del layer.__dict__["call"]
        del layer.__dict__["_thor_patched"]


def iter_layers(model):
    """All layers of ``model`` depth first (nested models and layers of subclassed models)."""
    seen = set()

    def visit(layer):
        for sub in getattr(layer, "_flatten_layers", lambda **k: [])(include_self=False, recursive=False):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            yield sub
            yield from visit(sub)

    yield from visit(model)
