"""thor_tf: THOR / K-FAC Kronecker-factored natural gradient for Keras 3 on TensorFlow 2."""

from importlib import metadata

from setuptools import find_packages, setup


def tensorflow_requirement():
    """Require TensorFlow only if no TensorFlow build is installed yet.

    `tensorflow`, `tensorflow-cpu` and the GPU builds all provide the `tensorflow` module; requiring
    one by name would pull a second copy over the one the user chose (CPU-only here and in CI).
    """
    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", "tf-nightly-cpu"):
        try:
            metadata.version(dist)
            return [f"{dist}>=2.16"]
        except metadata.PackageNotFoundError:
            continue
    return ["tensorflow>=2.16"]


setup(
    name="thor_tf",
    version="0.1.0",
    description=(
        "Layer-oriented second-order optimizer (THOR / K-FAC) for TensorFlow 2 / Keras 3: "
        "thor_tf.wrap(model) trains with Kronecker-factored natural gradient."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["thor_tf", "thor_tf.*"]),
    python_requires=">=3.10",
    install_requires=[
        # TF >= 2.16 ships Keras 3 as `keras`.
        *tensorflow_requirement(),
        "keras>=3.0",
        "numpy",
        "scipy",
        "scikit-learn",  # load_digits: the embedded offline dataset
    ],
    extras_require={
        "plots": ["matplotlib"],
        "tensorboard": ["tensorboard"],  # TraceRuleLogger(log_dir=...)
        "test": ["pytest", "matplotlib", "tensorboard"],
    },
)
