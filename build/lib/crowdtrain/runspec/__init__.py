"""What the coordinator and the volunteers share, with no dependency on either: the run's swarm
settings (``swarm``), the access-token format (``tokens``), user names (``names``), ``KEY=VALUE``
settings (``overrides``), the files the auxiliary peer writes for the web side (``files``), the
run's schedule over its life: time budget, extensions, the end (``schedule``), and the rules both
read about held-out losses: the best checkpoint, the memorising warning (``validation``).

The package graph reads as the architecture: ``crowdtrain.swarm`` (a volunteer's training and
averaging) and ``crowdtrain.coordinator`` (the web service, its database, the process manager)
import ``runspec`` and never each other; ``crowdtrain.auxpeer`` (the coordinator's swarm peer,
spawned by the coordinator as a process) is the one module that imports both.
``tests/test_package_graph.py`` keeps it so.
"""
