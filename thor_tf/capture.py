"""Layer hooks: observe each registered layer's input ``a``, pre-activation ``z`` and ``dL/dz``.

Keras 3 has no forward or backward hooks, so thor_tf makes them, under one invariant: **capture
observes, it never replaces**. After :func:`install`, a layer computes exactly what it computed
before (its own ``call``, a user's override included): outputs are bit-identical, in training and
inference, and the user's ``train_step``, custom loop or GAN runs unchanged (DESIGN.md §6).

* forward: an instance-level wrapper of ``call`` records the input and then runs the layer's own
  ``call``. ``z`` is observed where the layer's own computation produces it
  (:attr:`KroneckerBlock.observe <thor_tf.blocks.KroneckerBlock.observe>`): ``"activation"``
  (Dense, Conv, EinsumDense pass ``z`` to ``self.activation``, which is swapped for the duration
  of the call for a function that observes ``z`` and then applies the activation) or
  ``"output"`` (the call's output is ``z``: Embedding, layers without an activation).
* backward: ``z`` passes through a ``tf.custom_gradient`` identity whose gradient function hands
  the incoming ``dL/dz`` to the record. It fires inside whatever tape computes the gradients (a
  Keras ``train_step``, the user's own, a custom loop), in the same traced function as the
  optimizer's ``apply``; parameter gradients are unchanged. ``ThorModel.fit``'s own train step
  (:meth:`CaptureStore.step`) records ``z`` as it is instead and asks its tape for ``dL/dz`` with
  the parameter gradients: the same numbers, and the forward graph exactly the layers' own.

Records are kept only while a gradient tape could record (or inside :meth:`CaptureStore.step`):
``predict``/``evaluate`` observe nothing and run the layer's own ``call`` alone. The store is
thread-local (``MirroredStrategy`` runs each replica in its own thread) and per graph (records
of one trace never leak into another). The optimizer *takes* the records of its blocks when it
applies gradients; a record whose forward and backward both happened but that nobody took is
dropped at the layer's next call (e.g. a discriminator's records made while the generator
trained), so a step sees only its own.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from thor_tf import _keras_compat

#: More calls than this of one layer without a step taking them: the oldest are dropped (a loop
#: that runs the model under a tape and never applies gradients must not grow without bound).
MAX_RECORDS_PER_LAYER = 64


class Record:
    """One call of a registered layer.

    ``inputs``: the layer input as the layer's ``call`` received it (compute dtype).
    ``z``: the pre-activation output as the layer computed it (after the identity hook, so that a
    tape can differentiate against it); None when the hook did not fire.
    ``grad``: ``dL/dz`` handed over by the backward hook (the first backward pass through it);
    None before.
    ``observed``: how many times ``z`` was observed in this call (exactly 1 is usable).
    """

    __slots__ = ("inputs", "z", "grad", "observed")

    def __init__(self, inputs, z=None, grad=None):
        self.inputs = inputs
        self.z = z
        self.grad = grad
        self.observed = 0 if z is None else 1

    @property
    def usable(self):
        """``z`` was observed exactly once in the call."""
        return self.observed == 1 and self.z is not None

    def observe(self, z, backward_hook=True):
        """``z`` through the backward hook (the same values; its gradient is recorded), or as it
        is (``backward_hook=False``: the caller asks its tape for ``dL/dz`` itself)."""
        record = self
        if not backward_hook:
            self.observed += 1
            self.z = z
            return z

        @tf.custom_gradient
        def hook(x):
            def grad(dy):
                if record.grad is None:  # the first backward pass (the loss's) is the one kept
                    record.grad = dy
                return dy

            return tf.identity(x), grad

        out = hook(z)
        self.observed += 1
        self.z = out
        return out


class CaptureStore:
    """Per-thread, per-graph lists of :class:`Record` keyed by block name.

    Held outside Keras attribute tracking on purpose: a list assigned to a Keras object becomes
    tracked state and raises when appended inside ``call``.
    """

    def __init__(self):
        self._local = threading.local()

    def _records(self):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        local = self._local
        if getattr(local, "graph", None) is not graph or not hasattr(local, "records"):
            local.graph, local.records = graph, {}
        return local.records

    @property
    def in_step(self) -> bool:
        """Inside :meth:`step` (``ThorModel.fit``'s own train step)."""
        return getattr(self._local, "forced", False)

    @property
    def observing(self) -> bool:
        """Whether a layer call now is recorded: inside :meth:`step`, or while a tape records."""
        return self.in_step or _keras_compat.tape_could_record()

    @contextlib.contextmanager
    def step(self):
        """A fresh set of records for one training step (``ThorModel``'s train step): what was
        recorded before in this thread and graph is dropped, and calls are recorded whether or not
        a tape is watching. ``z`` is recorded without the backward hook there: that step asks its
        own tape for ``dL/dz`` with the parameter gradients, in the same backward pass, and leaves
        the forward graph exactly as the layer builds it (nothing between ``z`` and the
        activation for graph optimizations to trip on)."""
        self._records().clear()
        previous = getattr(self._local, "forced", False)
        self._local.forced = True
        try:
            yield
        finally:
            self._local.forced = previous

    def add(self, key: str, inputs, record=None) -> Record:
        """A new record of one call of ``key`` (see the module docstring for stale records);
        ``record``: an existing record to file under ``key`` too (a block that reads another
        block's records: both keys hold the same object, so ``z`` and ``dL/dz`` are shared)."""
        records = self._records().setdefault(key, [])
        if records and all(r.grad is not None for r in records):
            records.clear()  # a finished forward and backward that no step took
        if len(records) >= MAX_RECORDS_PER_LAYER:
            del records[0]
        record = Record(inputs) if record is None else record
        records.append(record)
        return record

    def take(self, keys):
        """``{key: [Record]}`` for the ``keys`` that have records; they are removed from the store."""
        records = self._records()
        out = {}
        for key in keys:
            taken = records.pop(key, None)
            if taken:
                out[key] = taken
        return out


def _first_input(args, kwargs):
    if args:
        return args[0]
    if "inputs" in kwargs:
        return kwargs["inputs"]
    return next(iter(kwargs.values()))


def install(block, store: CaptureStore) -> None:
    """Put the observing wrapper on ``block.layer`` (an instance attribute ``call``).

    The wrapper runs the layer's own ``call`` with the same arguments. While the store observes,
    it records the input and observes ``z`` where ``block.observe`` says; ``activation`` is
    swapped only for the duration of the call, under a per-layer lock (replica threads of a
    strategy may call the same layer at once). ``block`` may be a list of blocks on one layer (a
    tied embedding's lookup and head): each call is recorded for the first block that
    :meth:`~thor_tf.blocks.KroneckerBlock.accepts_call` it (the first block if none does), and
    filed too under every block whose ``shares_records_of`` is that block (one record, two keys).
    """
    blocks = list(block) if isinstance(block, (list, tuple)) else [block]
    layer = blocks[0].layer
    own_call = layer.call  # bound: the class's call, or an instance attribute the user set
    previous = layer.__dict__.get("call")
    lock = threading.RLock()
    # Blocks that read another block's records (a LoRA layer's B side) get no calls routed.
    routed = [b for b in blocks if getattr(b, "shares_records_of", None) is None] or blocks

    def route(args, kwargs):
        if len(routed) == 1:
            return routed[0]
        return next((b for b in routed if b.accepts_call(args, kwargs)), routed[0])

    def call(*args, **kwargs):
        return observing_call(own_call, args, kwargs)

    def observing_call(own_call, args, kwargs):
        if not store.observing:
            return own_call(*args, **kwargs)
        chosen = route(args, kwargs)
        key, observe = chosen.name, chosen.observe_point()
        record = store.add(key, _first_input(args, kwargs))
        for reader in blocks:
            if getattr(reader, "shares_records_of", None) is chosen:
                store.add(reader.name, record.inputs, record=record)  # the same Record object
        hook = not store.in_step
        if observe == "output":
            return record.observe(own_call(*args, **kwargs), hook)
        with lock:
            activation = layer.__dict__.get("activation")
            if activation is None:
                return own_call(*args, **kwargs)  # nothing to observe: the record stays unusable

            def observed(z):
                return activation(record.observe(z, hook))

            object.__setattr__(layer, "activation", observed)
            try:
                return own_call(*args, **kwargs)
            finally:
                object.__setattr__(layer, "activation", activation)

    # object.__setattr__ keeps the closure out of Keras attribute tracking.
    object.__setattr__(layer, "call", call)
    # A quantized layer is run through ``quantized_call`` (Keras' Operation.__call__), not
    # ``call``: observed the same way (its int8/int4 calls pass z to ``self.activation`` too).
    # Only blocks that accept quantized layers (a QLoRA layer's adapters) see such calls.
    previous_quantized = layer.__dict__.get("quantized_call")
    if getattr(layer, "quantization_mode", None) is not None and hasattr(layer, "quantized_call"):
        own_quantized = layer.quantized_call

        def quantized_call(*args, **kwargs):
            return observing_call(own_quantized, args, kwargs)

        object.__setattr__(layer, "quantized_call", quantized_call)
        object.__setattr__(layer, "_thor_hooked", (previous, previous_quantized, True))
    else:
        object.__setattr__(layer, "_thor_hooked", (previous, None, False))


def is_installed(layer) -> bool:
    return "_thor_hooked" in layer.__dict__


def uninstall(layer) -> None:
    """Restore the layer's own ``call`` (and the instance ``call`` the user had set, if any)."""
    hooked = layer.__dict__.pop("_thor_hooked", None)
    if hooked is None:
        return
    previous, previous_quantized, quantized = hooked
    if previous is None:
        layer.__dict__.pop("call", None)
    else:
        object.__setattr__(layer, "call", previous)
    if quantized:
        if previous_quantized is None:
            layer.__dict__.pop("quantized_call", None)
        else:
            object.__setattr__(layer, "quantized_call", previous_quantized)
