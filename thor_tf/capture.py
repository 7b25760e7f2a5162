"""Layer capture: record the inputs and pre-activations of the layers that have blocks.

Keras 3 has no forward or backward hooks, and ``layer.output`` is a symbolic tensor from model
construction, so ``tape.gradient(loss, layer.output)`` gives None. What works (DESIGN.md §6) is to
replace ``call`` on the layer *instance* with a wrapper that computes the pre-activation ``z``
itself, records ``(inputs, z)`` and returns ``activation(z)``. The train step then asks the tape for
``d loss / d z`` next to the parameter gradients, in the same single backward pass.

Capture is generic: what ``z`` is for a layer type is its block's business
(:meth:`thor_tf.blocks.KroneckerBlock.pre_activation`).

Conventions
-----------
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


def patch(block, store: CaptureStore) -> None:
    """Replace ``block.layer.call`` on the instance with a recording wrapper.

    The wrapper computes ``z = block.pre_activation(inputs)``, records ``(inputs, z)`` under the
    block's name while the store is recording, and returns ``block.activate(z)``. Keras decides
    which keyword arguments (``training``, ``mask``) to pass from the class's ``call`` signature,
    captured when the layer was built, so the wrapper accepts and ignores them.
    """
    layer = block.layer
    key = block.name

    def call(inputs, *args, **kwargs):
        z = block.pre_activation(inputs)
        store.add(key, inputs, z)
        return block.activate(z)

    # object.__setattr__ keeps the closure out of Keras attribute tracking.
    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "_thor_patched", True)


def unpatch(layer) -> None:
    """Restore the class ``call`` of a patched layer."""
    if layer.__dict__.get("_thor_patched"):
        del layer.__dict__["call"]
        del layer.__dict__["_thor_patched"]
