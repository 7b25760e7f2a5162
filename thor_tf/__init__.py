"""thor_tf: Kronecker-factored natural gradient (THOR / K-FAC) for Keras 3 on TensorFlow 2.

One line turns a Keras model into one that trains with THOR::

    model = thor_tf.wrap(model)          # prints the registration table
    model.compile(loss=..., metrics=...) # THOR is the default optimizer
    model.fit(...)

Public API: :func:`wrap`, :class:`ThorModel`, :class:`ThorOptimizer`, the schedules
(:mod:`thor_tf.schedules`), the trace-rule presets (:data:`PRESETS`), the block algebra
(:mod:`thor_tf.algebra`) and the dataset loaders (:mod:`thor_tf.data`).
"""

from thor_tf import algebra
from thor_tf.model import ThorModel, wrap
from thor_tf.optimizer import ThorOptimizer
from thor_tf.scheduler import PRESETS
from thor_tf import schedules

__all__ = ["wrap", "ThorModel", "ThorOptimizer", "PRESETS", "algebra", "schedules"]
__version__ = "0.1.0"
