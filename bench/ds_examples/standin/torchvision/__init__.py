"""Stand-in for the few torchvision pieces DeepSpeedExamples' scripts use (torchvision from PyPI needs CUDA torch)."""
from . import datasets, models, transforms, utils  # noqa: F401
