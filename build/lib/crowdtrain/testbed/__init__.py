"""An Internet testbed on one machine: every peer in its own network namespace, on a shaped link.

``netns`` builds the namespaces, bridge and token-bucket shaped links (root only); ``linkcheck``
measures a link with a real transfer; ``swarm`` runs a coordinator and volunteers inside them;
``analysis`` turns their summaries and byte counters into round times, utilization and
throughput; ``suite`` runs the benchmark matrix; ``plot`` draws it.
"""
