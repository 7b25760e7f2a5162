"""The harness's one training loop: a Keras model trained through segments, one ``fit`` epoch
between two evaluations, the segments timed (:func:`experiments.timing.fit_segment` on a
:class:`~experiments.timing.RunClock`) and the evaluations not.

Every driver runs its models through it: the suite and the studies over it
(``suite.SegmentedRun``, two of them in turn in ``interleave.py``; the main job is the suite's
harness on one workload), the LM (``lm.train_run``) and the fine-tune (``finetune.train_run``).
What differs between them is what a segment holds and what an evaluation records.
"""

from __future__ import annotations

from experiments import timing


class _NoRetracingWarning:
    """Drops TF's "triggered tf.function retracing" warning: every run builds a fresh model, and
    TF counts their train functions together, so the warning is noise here."""

    @staticmethod
    def filter(record):
        return "triggered tf.function retracing" not in record.getMessage()


def quiet_retracing():
    """Install :class:`_NoRetracingWarning` on TensorFlow's logger (once)."""
    import tensorflow as tf

    logger = tf.get_logger()
    if not any(isinstance(f, _NoRetracingWarning) for f in logger.filters):
        logger.addFilter(_NoRetracingWarning())


def fresh_session(seed):
    """A run's start: Keras' session cleared and every generator seeded with ``seed`` (the same
    initial weights for every optimizer of a seed)."""
    import keras

    quiet_retracing()
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)


def train_in_segments(model, clock, segments, batch_size, evaluate, first_evaluation=True,
                      verbose=False, callbacks=()):
    """Train ``model`` through ``segments``: an iterable of ``(step, x, y)``, each fitted as one
    epoch of ``batch_size`` (``x`` an array or a dict of arrays; produced lazily, so a segment's
    data may be drawn when it comes), ``step`` the run's step count after it. After each,
    ``evaluate(step, train_loss, seconds)`` (the segment's mean training loss and its seconds);
    with ``first_evaluation``, ``evaluate(0, None, 0.0)`` first."""
    if first_evaluation:
        evaluate(0, None, 0.0)
    for index, (step, x, y) in enumerate(segments):
        seconds, train_loss = timing.fit_segment(model, clock, index, x, y, batch_size,
                                                 verbose=verbose, callbacks=callbacks)
        evaluate(step, train_loss, seconds)
