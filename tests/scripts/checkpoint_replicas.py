"""A 2-replica run saved mid-training resumes on 1 and on 2 replicas as if never interrupted.

One device trains 8 steps (2 epochs) as the reference. A 2-replica run trains epoch 1 and is
saved three ways: ``model.save`` (.keras, resumed on 1 device and on 2 replicas),
``tf.train.Checkpoint`` of the model and its optimizer, and ``BackupAndRestore`` (the run is
killed by an exception in epoch 2, after the epoch-1 backup), both resumed on 1 device. Reports each resumed run's largest
weight difference to the reference (relative to the reference's largest weight change) and its
counters against the reference's; and the same 2 epochs on 2 replicas uninterrupted: its distance
to the reference, and the 2-replica resume's distance to it. argv (optional): the update rule, a name or Keras'
serialized dict as JSON (default: thor_tf's).
"""

import json
import os
import sys
import tempfile

import _dist_common as common

tf = common.setup(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

x, y = common.digits()
root = tempfile.mkdtemp()
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
options = {}
if len(sys.argv) > 1:
    options["update_rule"] = (json.loads(sys.argv[1]) if sys.argv[1].startswith("{")
                              else sys.argv[1])


def fit(model, epochs, initial_epoch=0, callbacks=()):
    model.fit(x, y, batch_size=32, epochs=epochs, initial_epoch=initial_epoch, shuffle=False,
              verbose=0, callbacks=list(callbacks))


def in_scope(replicas, fn):
    if replicas == 1:
        return fn()
    with strategy.scope():
        return fn()


reference = common.conv_model(**options)
start = [v.numpy().copy() for v in reference.trainable_variables]
fit(reference, 2)
moved = max(np.abs(r.numpy() - s).max() for r, s in zip(reference.trainable_variables, start))


def weight_diff(model, other):
    return float(max(np.abs(a.numpy() - b.numpy()).max() for a, b in
                     zip(model.trainable_variables, other.trainable_variables)) / moved)


# The same 2 epochs on 2 replicas, uninterrupted: how far 2 replicas land from 1 device by
# round-off alone (the default rule amplifies it, docs/distributed.md), the yardstick of a
# resume that changes the replica count.
uninterrupted = in_scope(2, lambda: common.conv_model(**options))
fit(uninterrupted, 2)
two_replicas = {"relative_weight_diff": weight_diff(uninterrupted, reference)}


def compare(model):
    diff = max(np.abs(a.numpy() - b.numpy()).max()
               for a, b in zip(model.trainable_variables, reference.trainable_variables))
    same_counters = {k: v for k, v in model.thor.counters().items() if k != "kl_scale"} == {
        k: v for k, v in reference.thor.counters().items() if k != "kl_scale"}
    same_decisions = [(s["refreshes"], s["reuses"]) for s in model.thor.layer_stats()] == [
        (s["refreshes"], s["reuses"]) for s in reference.thor.layer_stats()]
    return {"relative_weight_diff": float(diff / moved), "counters_equal": bool(same_counters),
            "decisions_equal": bool(same_decisions),
            "iterations": int(model.optimizer.iterations.numpy())}


# Epoch 1 on 2 replicas, saved as .keras and as a tf.train.Checkpoint.
first = in_scope(2, lambda: common.conv_model(**options))
fit(first, 1)
keras_path = os.path.join(root, "model.keras")
first.save(keras_path)
checkpoint_prefix = tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(
    os.path.join(root, "ckpt"))

result = {}
for replicas in (1, 2):
    loaded = in_scope(replicas, lambda: keras.models.load_model(keras_path))
    fit(loaded, 2, initial_epoch=1)
    result[f"keras_save_onto_{replicas}"] = compare(loaded)
    if replicas == 2:
        two_replicas["resumed_on_2_diff"] = weight_diff(loaded, uninterrupted)

# (tf.train.Checkpoint and BackupAndRestore onto 1 device: the replica count that differs.)
fresh = common.conv_model(**options)
tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
    checkpoint_prefix).assert_existing_objects_matched()
fit(fresh, 2, initial_epoch=1)
result["checkpoint_onto_1"] = compare(fresh)


class Preempted(Exception):
    pass


class PreemptAt(keras.callbacks.Callback):
    """Raises at the given (epoch, batch): the process 'dies' after the epoch-1 backup."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Preempted()


backup = os.path.join(root, "backup")
interrupted = in_scope(2, lambda: common.conv_model(**options))
try:
    fit(interrupted, 2, callbacks=[keras.callbacks.BackupAndRestore(backup), PreemptAt(1, 2)])
except Preempted:
    pass
resumed = common.conv_model(**options)
fit(resumed, 2, callbacks=[keras.callbacks.BackupAndRestore(backup)])
result["backup_onto_1"] = compare(resumed)
result["uninterrupted_on_2"] = two_replicas
common.report(result)
