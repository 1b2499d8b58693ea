"""What the coordinator and the volunteers share, with no dependency on either: the access-token
format (``tokens``), user names (``names``) and ``KEY=VALUE`` settings (``overrides``).

The package graph reads as the architecture: ``crowdtrain.swarm`` (a volunteer's training and
averaging) imports ``runspec`` and never ``crowdtrain.coordinator``; the coordinator (the web
service and its auxiliary peer, ``crowdtrain.coordinator.aux_peer``) imports ``swarm`` for the
averagers it runs. ``tests/test_package_graph.py`` keeps it so.
"""
