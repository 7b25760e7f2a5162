"""The trace rule's old home: its code lives in :mod:`thor_tf.trace_rule`.

Kept so that ``thor_tf.scheduler.AdaptiveCadence`` and the other public names written in user code
and older docs still import; new code imports :mod:`thor_tf.trace_rule`. (Learning-rate and damping
schedules are :mod:`thor_tf.schedules`.)
"""

from thor_tf.trace_rule import (  # noqa: F401
    FREEZE_AFTER, MIN_NOISE_SAMPLES, NOISE_CAP, NOISE_HORIZON, NOISE_Z, PRESETS, TRACE_FILTERS,
    TRACE_WINDOW, AdaptiveCadence, CadenceSchedule, FilterState, adapt_interval, decide,
    filter_delta, filter_noise, filter_observe, filter_refresh, filter_step, initial_filter_state,
    relative_trace_change, trace_product, window_mean)
