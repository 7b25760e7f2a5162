"""R replicas (MirroredStrategy over logical CPUs) against one device on the same global batches.

argv: replicas, inverse_assignment, models (comma list), update rule (default: thor_tf's; a name,
or Keras' serialized dict as JSON).
Reports, per model, the largest weight difference relative
to the run's largest weight change, the KL-clip ν of both runs, the decisions (refreshes, reuses,
frozen per layer), factor/inverse differences to the one-device run, and whether every optimizer
variable (momentum, factors, inverses, trace state, counters) is identical on all replicas.
"""

import json
import sys

import _dist_common as common

replicas, assignment = int(sys.argv[1]), sys.argv[2]
tf = common.setup(replicas)
import numpy as np  # noqa: E402

keras_models = {"conv": (common.conv_model, common.digits()),
                "tokens": (common.token_model, common.tokens()),
                "lora": (common.lora_model, common.tokens())}
which = sys.argv[3].split(",") if len(sys.argv) > 3 else ["conv", "tokens"]


options = {} if assignment == "all" else {"inverse_assignment": assignment}  # "all": default
if len(sys.argv) > 4:
    options["update_rule"] = json.loads(sys.argv[4]) if sys.argv[4].startswith("{") else sys.argv[4]


def products(model, name):
    """The update rule's per-block arrays: split inverses, or eigenvalues and second moments (the
    bases and the first moment are compared through the weights: an eigenvector's sign, and with
    it its coordinate of m, may flip between two runs; v does not see a sign)."""
    try:
        found = model.thor.inverses(name)
    except ValueError:
        found = {k: v for k, v in model.thor.bases(name).items() if k in ("w_A", "w_G", "v")}
    return [found[k] for k in sorted(found)]


def train(build, data, strategy):
    x, y = data
    if strategy is None:
        model = build(**options)
    else:
        with strategy.scope():
            model = build(**options)
    start = [v.numpy().copy() for v in model.trainable_variables]
    # 128 examples, global batch 32: 4 steps an epoch, cadence every 2 steps, 3 epochs.
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    return model, start


result = {}
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
for name in which:
    build, data = keras_models[name]
    one, start = train(build, data, None)
    many, _ = train(build, data, strategy)
    moved = max(np.abs(a.numpy() - s).max() for a, s in zip(one.trainable_variables, start))
    diff = max(np.abs(a.numpy() - b.numpy()).max()
               for a, b in zip(one.trainable_variables, many.trainable_variables))
    factor_diff = 0.0
    for block in one.thor.blocks:
        f1, f2 = one.thor.factors(block.name), many.thor.factors(block.name)
        pairs = [(f1["A"], f2["A"]), (f1["G"], f2["G"])]
        pairs += list(zip(products(one, block.name), products(many, block.name)))
        for a, b in pairs:
            factor_diff = max(factor_diff, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    identical = all(all(np.array_equal(copies[0], c) for c in copies[1:])
                    for copies in map(common.replica_values, many.optimizer.variables))
    copies = len(common.replica_values(many.optimizer.variables[0]))

    def decisions(model):
        return [[s["refreshes"], s["reuses"], int(s["frozen"])] for s in model.thor.layer_stats()]

    result[name] = {
        "relative_weight_diff": float(diff / moved), "moved": float(moved),
        "nu_one": one.thor.counters()["kl_scale"], "nu_many": many.thor.counters()["kl_scale"],
        "decisions_one": decisions(one), "decisions_many": decisions(many),
        "factor_inverse_diff": factor_diff, "replicas_identical": bool(identical),
        "copies": copies, "replicas": strategy.num_replicas_in_sync,
    }
common.report(result)
