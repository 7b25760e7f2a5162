"""THOR and a baseline trained in one process, segment by segment in turn, so both see the same
host (``scripts/bench_interleaved.py``'s seconds, ``batch_scaling.py --interleave``).

Per seed, both models are built on the same weights and batches (the suite's recipe:
``suite.compiled_model``, ``suite.batch_order``) and trained through the suite's segments (one
Keras ``fit`` epoch between two evaluations, timed by ``timing.fit_segment``), alternating:
segment 1 of one, segment 1 of the other, segment 2 of the first... (which goes first alternates
by segment and seed). Evaluations are not timed. The rows are the suite's (``suite.FIELDS``).
"""

from __future__ import annotations


def segment_order(index, seed):
    """Which of (THOR, baseline) trains first in segment ``index`` of seed ``seed``."""
    return (0, 1) if (index + seed) % 2 == 0 else (1, 0)


def interleaved_rows(workload, data, baseline, rate, seed, evals, thor_options=(), quick=False):
    """The suite's metric rows of THOR (defaults, or ``thor_options``: ``[(name, value)]`` as
    the suite's ``--thor-option``) and ``baseline`` at ``rate`` on ``workload`` / ``data``, seed
    ``seed``, trained segment by segment in turn."""
    import keras

    from thor_tf_experiments import suite, timing

    keras.backend.clear_session()
    order = suite.batch_order(data.num_train, workload.batch_size, workload.epochs, seed,
                              workload.single_pass)
    runs = []
    for optimizer, lr in (("thor", 0.0), (baseline, rate)):
        keras.utils.set_random_seed(seed)
        model = suite.compiled_model(optimizer, lr, workload, data, quick, len(order),
                                     list(thor_options) if optimizer == "thor" else [])
        runs.append({"optimizer": optimizer, "lr": float(lr), "model": model,
                     "clock": timing.RunClock(), "rows": []})
    x_eval, y_eval = ((data.x_train, data.y_train) if workload.eval_split == "train"
                      else (data.x_test, data.y_test))

    def evaluate(run, step, train_loss):
        result = run["model"].evaluate(x_eval, y_eval, batch_size=512, verbose=0,
                                       return_dict=True)
        run["rows"].append({"workload": workload.name, "optimizer": run["optimizer"],
                            "lr": run["lr"], "seed": int(seed), "step": step,
                            "seconds": round(run["clock"].seconds, 4),
                            "metric": float(result[workload.metric]), "train_loss": train_loss,
                            **run["clock"].fields()})

    for run in runs:
        evaluate(run, 0, None)
    done = 0
    for index, stop in enumerate(suite.eval_steps(len(order), evals)):
        idx = order[done:stop].reshape(-1)
        for k in segment_order(index, seed):
            _, loss = timing.fit_segment(runs[k]["model"], runs[k]["clock"], index,
                                         data.x_train[idx], data.y_train[idx],
                                         workload.batch_size)
            evaluate(runs[k], stop, loss)
        done = stop
    for run in runs:
        last = run["rows"][-1]
        print(f"[{workload.name} batch {workload.batch_size} {run['optimizer']} seed={seed}] "
              f"{len(order)} steps  {workload.metric} {last['metric']:.4f}  "
              f"{run['clock'].seconds:.1f}s (first {run['clock'].first_seconds:.1f}s)",
              flush=True)
    return runs[0]["rows"] + runs[1]["rows"]
