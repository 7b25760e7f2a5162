"""experiments.train: the harness's one training loop."""

import keras
import numpy as np

from experiments import timing, train


def _model():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_segments_train_in_order_and_evaluations_follow_each():
    """Each segment is one fit epoch on exactly its rows (the optimizer's step count after it
    is the segment's end), evaluations come after step 0 and after each segment, untimed."""
    train.fresh_session(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype("float32")
    model, clock, seen = _model(), timing.RunClock(), []

    def evaluate(step, train_loss, seconds):
        seen.append((step, int(model.optimizer.iterations.numpy()), train_loss, seconds))

    segments = ((stop, x[start:stop * 8], y[start:stop * 8])
                for start, stop in ((0, 4), (32, 8), (64, 12)))  # batch 8: 4 steps each
    train.train_in_segments(model, clock, segments, 8, evaluate)
    assert [s[0] for s in seen] == [0, 4, 8, 12]
    assert [s[1] for s in seen] == [0, 4, 8, 12]
    assert seen[0][2:] == (None, 0.0)
    losses = [s[2] for s in seen[1:]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # it learns the linear map
    assert all(s[3] > 0 for s in seen[1:])
    assert abs(clock.seconds - sum(s[3] for s in seen[1:])) < 1e-6


def test_fresh_session_gives_every_run_of_a_seed_the_same_weights():
    train.fresh_session(3)
    first = _model().get_layer("out").kernel.numpy()
    train.fresh_session(3)
    again = _model().get_layer("out").kernel.numpy()
    train.fresh_session(4)
    other = _model().get_layer("out").kernel.numpy()
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
