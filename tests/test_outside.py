"""experiments/workloads.py's OUTSIDE registry: five workloads kept out of the suite, each built at
its --quick sizes, and one --quick suite run on one of them (about 20 s on 2 CPU cores)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import suite, workloads as wl


def test_outside_is_apart_from_the_suite_and_the_default_run_is_unchanged():
    assert len(wl.OUTSIDE) == 5 and not set(wl.OUTSIDE) & set(wl.WORKLOADS)
    assert wl.ALL_WORKLOADS == {**wl.WORKLOADS, **wl.OUTSIDE}
    assert suite.parse_args([]).workloads == list(wl.WORKLOADS)
    assert suite.parse_args(["--workloads", "topics_bag,digits_cnn"]).workloads == [
        "topics_bag", "digits_cnn"]
    with pytest.raises(SystemExit):
        suite.parse_args(["--workloads", "no_such_workload"])


@pytest.mark.parametrize("name", sorted(wl.OUTSIDE))
def test_outside_workload_builds_at_quick_sizes(name):
    import keras

    w = wl.OUTSIDE[name].sized(True)
    assert w.name == name and f"``{name}``" in wl.__doc__     # described in the docstring
    data = w.load(True)
    again = w.load(True)                          # the data does not depend on the run's seed
    assert np.array_equal(data.x_train, again.x_train)
    assert len(data.x_train) == len(data.y_train) and len(data.x_test) == len(data.y_test)
    assert data.num_train // w.batch_size >= 1 and w.eval_split == "test"
    assert all(len(grid) >= 1 for grid in w.baselines.values())
    assert all(len(grid) == 3 for grid in wl.OUTSIDE[name].baselines.values())
    keras.utils.set_random_seed(0)
    model = w.build(data, True)
    assert model.get_layer(w.head) is model.layers[-1]   # Muon's AdamW-step layer is the head
    out = np.asarray(model(data.x_test[:4]))
    assert out.shape[0] == 4 and np.all(np.isfinite(out))
    if w.metric == "accuracy":                    # softmax over the classes of the labels
        assert out.shape[1] > int(np.max(data.y_train))
        assert np.allclose(out.sum(1), 1.0, atol=1e-5)


def test_quick_suite_on_an_outside_workload(tmp_path):
    out = tmp_path / "outside"
    suite.main(["--quick", "--workloads", "topics_bag", "--evals", "2", "--out", str(out)])
    summary = json.loads((out / "suite.json").read_text())
    (s,) = summary["workloads"]
    assert s["workload"] == "topics_bag"
    assert set(s["optimizers"]) == {"thor", "adam"}
    for info in s["optimizers"].values():
        assert info["total_steps"] == 1024 // 64 and math.isfinite(info["final"])
    again = tmp_path / "joined"
    suite.main(["--quick", "--combine", str(out), "--out", str(again)])
    assert json.loads((again / "suite.json").read_text())["workloads"][0]["target"] == s["target"]
