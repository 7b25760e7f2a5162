"""One worker of a MultiWorkerMirroredStrategy cluster on 127.0.0.1 (TF_CONFIG set by the test).

argv: out_dir. First the documented custom-loop recipe (``strategy.run(model.train_step, ...)``
in a ``tf.function`` over ``distribute_datasets_from_function``, each worker taking its half of
every global batch) and ``ThorModel.fit`` on a sharded dataset, 8 steps each; worker 0 also trains
one process without a strategy on the same global batches. Weights are saved to
``out_dir/worker<i>.npz`` and the result is reported. Then the same cluster goes on with the
custom loop and worker 1 exits abruptly before its third step there (exit code 3): worker 0 must
fail with an error, not hang. Its stdout says when that phase began (``DEAD_PHASE <time>``).
One cluster for both checks: starting one costs each worker its imports and traces.
"""

import json
import os
import sys
import time

import _dist_common as common

out_dir = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
tf = common.setup(1)
import numpy as np  # noqa: E402

GLOBAL_BATCH = 32
x, y = common.digits()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
workers = strategy.num_replicas_in_sync  # one replica per worker here

with strategy.scope():
    looped = common.conv_model()


def dataset_fn(context):
    # Worker i takes rows [i·b, (i+1)·b) of every global batch: the global batch is the
    # one-process batch, whatever the number of workers.
    b = context.get_per_replica_batch_size(GLOBAL_BATCH)
    i = context.input_pipeline_id
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    return batches.map(lambda a, t: (a[i * b:(i + 1) * b], t[i * b:(i + 1) * b]))


@tf.function
def train_step(batch):
    strategy.run(looped.train_step, args=(batch,))


steps = 0
for epoch in range(2):
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        train_step(batch)
        steps += 1
        print(f"worker {task} step {steps} at {time.time():.1f}", flush=True)

with strategy.scope():
    fitted = common.conv_model()
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
history = fitted.fit(dataset, epochs=2, verbose=0)

arrays = {f"loop_{k}": v.numpy() for k, v in enumerate(looped.trainable_variables)}
arrays.update({f"fit_{k}": v.numpy() for k, v in enumerate(fitted.trainable_variables)})
import keras  # noqa: E402

result = {"keras": keras.__version__, "workers": workers, "loop_iterations": int(looped.optimizer.iterations.numpy()),
          "fit_iterations": int(fitted.optimizer.iterations.numpy()),
          "fit_loss": history.history["loss"],
          "loop_refreshes": [s["refreshes"] for s in looped.thor.layer_stats()]}
if task == 0:
    alone = common.conv_model()  # one process, no strategy, same global batches
    start = [v.numpy().copy() for v in alone.trainable_variables]
    alone_history = alone.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    arrays.update({f"alone_{k}": v.numpy() for k, v in enumerate(alone.trainable_variables)})
    arrays.update({f"start_{k}": s for k, s in enumerate(start)})
    result["alone_loss"] = alone_history.history["loss"]
    result["alone_refreshes"] = [s["refreshes"] for s in alone.thor.layer_stats()]
np.savez(os.path.join(out_dir, f"worker{task}.npz"), **arrays)
common.report(result)

# The dead worker: the same traced step on, until worker 1 leaves before its third step.
print(f"DEAD_PHASE {time.time():.3f}", flush=True)
steps = 0
for batch in strategy.distribute_datasets_from_function(dataset_fn):
    if task == 1 and steps == 2:
        os._exit(3)  # no cleanup, no goodbye: as a killed process
    train_step(batch)
    steps += 1
print(f"worker {task}: the dead worker's steps ended without an error", flush=True)
