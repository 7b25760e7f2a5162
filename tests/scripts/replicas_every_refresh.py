"""Two replicas against one device under the default rule with a refresh at every step.

argv: model (``"pool"``: Conv2D → max-pool → Dense → Dense, the test's; ``"conv"``: the conv
model of ``_dist_common``, whose hidden Dense has more inputs than a batch has rows), steps,
global batch. Each run takes ``steps`` steps on the same global batches (frequency 1,
``max_block_age=1``: every layer refreshes its bases at every step). Runs:

* ``one``: one device; ``many``: 2 replicas (MirroredStrategy over 2 logical CPUs);
* ``swapped`` and ``reversed``: one device, each batch's two halves swapped or its rows
  reversed: the same sums in other orders, which is all the replicas change (the one device's
  own sensitivity to summation order on this CPU's kernels);
* ``other``: one device with one example of the first batch replaced (a real difference).

Reports each run's largest weight difference to ``one`` relative to ``one``'s largest weight
change (``moved``), and the relative differences of the factors after the first step.
"""

import sys

import _dist_common as common

model_name, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tf = common.setup(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import thor_tf  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    if model_name == "pool":
        layers = [keras.layers.Conv2D(6, 3, activation="relu", name="conv"),
                  keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                  keras.layers.Dense(16, activation="tanh", name="hidden"),
                  keras.layers.Dense(10, activation="softmax", name="out")]
    else:
        layers = [keras.layers.Conv2D(6, 3, activation="relu", name="conv"),
                  keras.layers.Flatten(),
                  keras.layers.Dense(16, activation="tanh", name="hidden"),
                  keras.layers.Dense(10, activation="softmax", name="out")]
    model = thor_tf.wrap(keras.Sequential([keras.Input((8, 8, 1))] + layers),
                         frequency=1, max_block_age=1, verbose=False)
    model.compile(loss="sparse_categorical_crossentropy")
    return model


x, y = common.digits(steps * batch + 1)
x, y, spare = x[:-1], y[:-1], (x[-1:], y[-1:])


def train(x, y, strategy=None):
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    start = [v.numpy().copy() for v in model.trainable_variables]
    first = {}

    class FirstFactors(keras.callbacks.Callback):
        def on_train_batch_end(self, index, logs=None):
            if index == 0:
                first.update({b.name: model.thor.factors(b.name) for b in model.thor.blocks})

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[FirstFactors()])
    refreshes = [s["refreshes"] for s in model.thor.layer_stats()]
    return [v.numpy() for v in model.trainable_variables], start, first, refreshes


one, start, one_factors, refreshes = train(x, y)
moved = max(float(np.abs(a - s).max()) for a, s in zip(one, start))
half = batch // 2
order = np.concatenate([np.r_[k + half:k + batch, k:k + half] for k in range(0, len(x), batch)])
backwards = np.concatenate([np.arange(k + batch - 1, k - 1, -1) for k in range(0, len(x), batch)])
other_x, other_y = x.copy(), y.copy()
other_x[0], other_y[0] = spare[0][0], spare[1][0]
runs = {"many": (x, y, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])),
        "swapped": (x[order], y[order], None), "reversed": (x[backwards], y[backwards], None),
        "other": (other_x, other_y, None)}
result = {"moved": moved, "refreshes": refreshes, "steps": steps}
for name, (xs, ys, strategy) in runs.items():
    weights, _, factors, _ = train(xs, ys, strategy)
    result[name] = float(max(np.abs(a - b).max() for a, b in zip(one, weights)) / moved)
    result[name + "_factors"] = float(max(
        np.abs(one_factors[n][k] - factors[n][k]).max() / np.abs(one_factors[n][k]).max()
        for n in one_factors for k in ("A", "G")))
common.report(result)
