"""crowdtrain: train one transformer together over the Internet."""

__version__ = "0.1.0"
