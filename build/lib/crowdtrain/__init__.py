"""crowdtrain: train one transformer together over the Internet."""

from crowdtrain.noise import drop_known_noise

__version__ = "0.1.0"

drop_known_noise()  # before bitsandbytes and hivemind are imported, in every crowdtrain process
