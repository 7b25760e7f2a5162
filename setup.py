"""thor_tf: THOR / K-FAC Kronecker-factored natural gradient for Keras 3 on TensorFlow 2.

TensorFlow itself is not a hard requirement, as with TensorFlow Probability: `tensorflow`,
`tensorflow-cpu` and the CUDA builds all provide the same `tensorflow` module, and pip cannot tell
that one satisfies a requirement on another, so requiring any of them by name pulls a second,
conflicting copy over the build the user chose. Install one first (the README uses
`tensorflow-cpu`), or use the extras `thor_tf[cpu]` / `thor_tf[gpu]`. `import thor_tf` checks that
TensorFlow >= 2.16 (Keras 3) is present and says what to install otherwise.
"""

from setuptools import find_packages, setup

setup(
    name="thor_tf",
    version="0.1.0",
    description=(
        "Layer-oriented second-order optimizer (THOR / K-FAC) for TensorFlow 2 / Keras 3: "
        "thor_tf.wrap(model) trains with Kronecker-factored natural gradient."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The library is the optimizer (thor_tf); the benchmarks' harness (datasets, workloads,
    # training runs, timing, records, reports) is a second package, experiments, needing the extra
    # below. scripts/ holds entry points only and is not installed.
    packages=find_packages(include=["thor_tf", "thor_tf.*"]) + ["experiments"],
    python_requires=">=3.10",
    install_requires=[
        "keras>=3.8",  # the oldest tested (.ci/floor: with tensorflow 2.16.1)
        "numpy",
        "scipy",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        "plots": ["matplotlib"],
        # scikit-learn: load_digits, the embedded offline dataset of the experiments and tests
        "experiments": ["scikit-learn", "matplotlib"],
        "tensorboard": ["tensorboard"],  # TraceRuleLogger(log_dir=...)
        # KerasHub tasks (tests/test_keras_hub.py). keras-hub needs tensorflow-text, which
        # requires the full `tensorflow` by name: with `tensorflow` (or [gpu]) this extra installs
        # cleanly; over tensorflow-cpu pip would add `tensorflow` on top of it, so use .ci/hub
        # (keras-hub and tensorflow-text without that dependency; what CI runs).
        "hub": ["keras-hub>=0.32"],
        "test": ["pytest", "pytest-xdist", "scikit-learn", "matplotlib", "tensorboard"],
    },
)
