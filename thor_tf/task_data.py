"""A KerasHub task's preprocessing under THOR (:class:`TaskData`, one of
:class:`~thor_tf.model.ThorModel`'s bases): a task with a preprocessor maps raw data through it
in its own ``fit``/``evaluate``/``predict``, and so does the wrapped one, as a ``tf.data``
pipeline.
"""

from __future__ import annotations

import keras
import tensorflow as tf


class TaskData:
    """``evaluate``/``predict`` and the data ``fit`` takes, preprocessed as the wrapped KerasHub
    task's own would be (a mixin over ``keras.Model``: it uses the model's ``model``)."""

    def evaluate(self, x=None, y=None, batch_size=None, *args, sample_weight=None, **kwargs):
        if self._preprocessing_task() is not None:
            x, y, sample_weight = self._preprocessed(x, y, sample_weight, batch_size), None, None
            batch_size = None
        return super().evaluate(x, y, batch_size, *args, sample_weight=sample_weight, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        task = self._preprocessing_task()
        if task is not None:
            x, batch_size = self._preprocessed(x, None, None, batch_size, inputs_only=True), None
        return super().predict(x, batch_size, *args, **kwargs)

    def _preprocessing_task(self):
        """The wrapped model when it is a KerasHub task with a preprocessor (keras_hub's
        ``PipelineModel`` preprocesses in its fit/evaluate/predict), else None."""
        model = self.model
        if (getattr(model, "preprocessor", None) is not None
                and callable(getattr(model, "preprocess_samples", None))):
            return model
        return None

    def _preprocessed(self, x, y, sample_weight, batch_size, inputs_only=False):
        """Raw data as the task's own fit feeds it: batched (``batch_size``, 32 by default) and
        mapped through ``task.preprocess_samples`` (the preprocessor), as a ``tf.data`` pipeline;
        a ``tf.data.Dataset`` is mapped as it is. ``inputs_only``: predict's (x only)."""
        task = self._preprocessing_task()
        if isinstance(x, tf.data.Dataset):
            data = x
        else:
            data = tf.data.Dataset.from_tensor_slices(
                keras.utils.pack_x_y_sample_weight(x, y, sample_weight)).batch(batch_size or 32)
        if inputs_only:
            def preprocess(*sample):
                out = task.preprocess_samples(*sample)
                return keras.utils.unpack_x_y_sample_weight(out)[0] if isinstance(out, tuple) else out
        else:
            preprocess = task.preprocess_samples
        return data.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE)


def _unpack_validation(validation_data):
    """``(x, y, sample_weight)`` of fit's ``validation_data`` (a dataset: ``(ds, None, None)``)."""
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None, None
    return keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
