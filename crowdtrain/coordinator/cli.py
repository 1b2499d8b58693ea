"""`crowdtrain coordinator`: start a run (first DHT peer, HTTP service, auxiliary peer)."""

from __future__ import annotations


def parse_overrides(pairs: list[str] | None, *, flag: str) -> dict:
    """KEY=VALUE pairs; values are JSON when they parse as JSON (numbers, true/false, lists)."""
    import json

    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"{flag} takes KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "coordinator", help="start a run: the first peer, the join endpoint, data, checkpoints",
        description="Start a collaborative run in one command: the run's first DHT peer on a fixed address "
                    "with a persistent identity, an HTTP endpoint that hands volunteers the run as data, the "
                    "shards over HTTP, and an auxiliary peer that collects metrics, keeps the latest state and "
                    "writes checkpoints. Volunteers then run `crowdtrain join http://HOST:PORT`.")
    p.add_argument("--run-id", default="crowdtrain", help="name of the run (letters, digits, - and _)")
    p.add_argument("--preset", default="demo", help="model preset: tiny, demo or paper")
    p.add_argument("--data", default="shapes",
                   help="shard folder to serve, http(s) URL or hub id to stream from, or 'shapes' (bundled)")
    p.add_argument("--host", default="0.0.0.0", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--public-host", default="127.0.0.1",
                   help="address volunteers reach this machine at (used in the URLs handed out)")
    p.add_argument("--dht-host", default="0.0.0.0", help="DHT listen address")
    p.add_argument("--dht-port", type=int, default=31337, help="DHT port (fixed, so peers can find the run again)")
    p.add_argument("--identity", default=None, help="private key file of the first peer (default RUN_DIR/identity.key)")
    p.add_argument("--run-dir", default=None, help="folder for run state, metrics and logs (default runs/RUN_ID)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default RUN_DIR/checkpoints)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="how many recent checkpoints to keep")
    p.add_argument("--swarm-preset", default="default", help="swarm settings: default (the paper's) or demo")
    p.add_argument("--swarm", action="append", metavar="KEY=VALUE",
                   help="override a swarm setting, e.g. --swarm target_batch_size=1024 (see SwarmConfig)")
    p.add_argument("--model", action="append", metavar="KEY=VALUE", help="override a model preset field")
    p.set_defaults(handler=_coordinator)


def _coordinator(args) -> int:
    from crowdtrain.coordinator.run import CoordinatorConfig, run_coordinator

    config = CoordinatorConfig(
        run_id=args.run_id, preset=args.preset, data=args.data, host=args.host, port=args.port,
        public_host=args.public_host, dht_host=args.dht_host, dht_port=args.dht_port, run_dir=args.run_dir,
        identity=args.identity, checkpoint_dir=args.checkpoint_dir, keep_checkpoints=args.keep_checkpoints,
        swarm_preset=args.swarm_preset, swarm_overrides=parse_overrides(args.swarm, flag="--swarm"),
        model_overrides=parse_overrides(args.model, flag="--model"))
    return run_coordinator(config)
