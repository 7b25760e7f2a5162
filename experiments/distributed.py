"""Data-parallel THOR on the Fashion-MNIST CNN: MirroredStrategy in one process, or one worker of a
MultiWorkerMirroredStrategy cluster (TF_CONFIG), with ``fit`` or the custom-loop recipe.

One process, R replicas (the local GPUs, or R logical CPU devices when there are fewer GPUs)::

    python experiments/distributed.py --replicas 2

Two worker processes on this machine (each one replica; start both, worker 0 prints the
progress)::

    W='"worker":["127.0.0.1:20001","127.0.0.1:20002"]'
    TF_CONFIG="{\"cluster\":{$W},\"task\":{\"type\":\"worker\",\"index\":1}}" python experiments/distributed.py &
    TF_CONFIG="{\"cluster\":{$W},\"task\":{\"type\":\"worker\",\"index\":0}}" python experiments/distributed.py

``--loop`` trains with the custom-loop recipe instead of ``fit``: ``strategy.run(model.train_step,
...)`` in a ``tf.function`` over ``distribute_datasets_from_function``, each worker reading its
share of every global batch (README "Distributed training"). The global batch (``--batch``) is the
same whatever the number of replicas, and THOR's step on it is the single-device step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def strategy_for(replicas):
    """MultiWorkerMirroredStrategy when TF_CONFIG names a cluster, else MirroredStrategy over
    ``replicas`` local devices (GPUs if there are enough, else logical CPU devices)."""
    import tensorflow as tf

    if "TF_CONFIG" in os.environ:
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= replicas:
        return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
    cpu = tf.config.list_physical_devices("CPU")[0]
    if replicas > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def custom_loop(strategy, model, data, batch, epochs, chief):
    """The recipe for a custom loop: each worker reads rows [i·b, (i+1)·b) of every global batch."""
    import tensorflow as tf

    def dataset_fn(context):
        per_replica = context.get_per_replica_batch_size(batch)
        i = context.input_pipeline_id
        batches = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).batch(
            batch, drop_remainder=True)
        # One input pipeline per worker: it takes its worker's share of every global batch and
        # deals it to the worker's replicas as consecutive per-replica batches.
        local = per_replica * (strategy.num_replicas_in_sync // context.num_input_pipelines)
        share = batches.map(lambda x, y: (x[i * local:(i + 1) * local], y[i * local:(i + 1) * local]))
        return share.unbatch().batch(per_replica, drop_remainder=True)

    @tf.function
    def train_step(dist_batch):
        strategy.run(model.train_step, args=(dist_batch,))

    for epoch in range(epochs):
        start = time.time()
        model.reset_metrics()
        for dist_batch in strategy.distribute_datasets_from_function(dataset_fn):
            train_step(dist_batch)
        if chief:
            print(f"epoch {epoch + 1}/{epochs}: {time.time() - start:.1f}s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="local replicas (without TF_CONFIG)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--max-train", type=int, default=20000)
    p.add_argument("--inverse-assignment", default="all", choices=("all", "balanced"))
    p.add_argument("--loop", action="store_true", help="custom loop instead of fit")
    args = p.parse_args(argv)

    strategy = strategy_for(args.replicas)
    import keras
    import thor_tf
    from experiments import datasets, models

    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    chief = tf_config.get("task", {}).get("index", 0) == 0
    data = datasets.load_dataset("auto", max_train=args.max_train, verbose=chief, download=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = thor_tf.wrap(models.build("cnn", data.input_shape, data.num_classes),
                             learning_rate=0.02, verbose=chief,
                             # The assignment of inversions is the inverse rule's option.
                             **({} if args.inverse_assignment == "all" else dict(
                                 update_rule=thor_tf.rules.Inverse(inverse_assignment="balanced"))))
        # A custom loop tracks its own metrics (Keras builds compiled metrics lazily, inside
        # the first fit/evaluate, which a replica function cannot do): the loss only there.
        model.compile(loss="sparse_categorical_crossentropy",
                      metrics=None if args.loop else ["accuracy"])
    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas ({type(strategy).__name__}), global batch "
              f"{args.batch}, {'custom loop' if args.loop else 'fit'}", flush=True)
    start = time.time()
    if args.loop:
        custom_loop(strategy, model, data, args.batch, args.epochs, chief)
    else:
        import tensorflow as tf

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        train = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).batch(
            args.batch, drop_remainder=True).with_options(options)
        model.fit(train, epochs=args.epochs, verbose=2 if chief else 0)
    import numpy as np

    predicted = np.argmax(model.predict(data.x_test, batch_size=args.batch, verbose=0), axis=-1)
    accuracy = float(np.mean(predicted == data.y_test))
    if chief:
        print(f"test accuracy {accuracy:.4f} after {args.epochs} epochs, {time.time() - start:.1f}s; "
              f"THOR counters {model.thor.counters()}", flush=True)


if __name__ == "__main__":
    main()
