"""`crowdtrain coordinator`: start a run (first DHT peer, HTTP service, auxiliary peer)."""

from __future__ import annotations


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
    p.add_argument("--public-url", default=None, metavar="URL",
                   help="the address every URL handed out starts with (install line, join information, shards, "
                        "checkpoints, notebooks, pages), e.g. https://run.example.org behind Caddy; default: "
                        "http://PUBLIC_HOST:PORT, or https:// with --tls-cert")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve HTTPS directly with this certificate (chain); give --tls-key too")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--trusted-proxy", default=None, metavar="IP[,IP]",
                   help="addresses of reverse proxies in front of this coordinator (e.g. 127.0.0.1 for Caddy on "
                        "this machine): their X-Forwarded-For names the client, for rate limits; nobody else's is "
                        "believed")
    p.add_argument("--dht-host", default="0.0.0.0", help="DHT listen address")
    p.add_argument("--dht-port", type=int, default=31337, help="DHT port (fixed, so peers can find the run again)")
    p.add_argument("--identity", default=None, help="private key file of the first peer (default RUN_DIR/identity.key)")
    p.add_argument("--run-dir", default=None, help="folder for run state, metrics and logs (default runs/RUN_ID)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default RUN_DIR/checkpoints)")
    p.add_argument("--keep-checkpoints", type=int, default=3,
                   help="how many recent checkpoints to keep (the one with the lowest validation loss is kept too)")
    p.add_argument("--valid-rows", type=int, default=512, metavar="N",
                   help="rows of each held-out split (valid, heldout, ...) the validation loss is measured on at "
                        "every checkpoint, by the auxiliary peer on one CPU thread: fewer if checkpoints take too "
                        "long, more if the figure is noisy (0: none; default: 512)")
    p.add_argument("--swarm-preset", default="default", help="swarm settings: default (the paper's), demo (sync mode, short epochs, "
                        "for tests on one machine) or laptop (DiLoCo, what `crowdtrain demo` runs)")
    p.add_argument("--swarm", action="append", metavar="KEY=VALUE",
                   help="override a swarm setting, e.g. --swarm target_batch_size=1024 (see SwarmConfig)")
    p.add_argument("--time-budget", default=None, metavar="DURATION",
                   help="train for this long (e.g. 2h, 90m, 1h30m) instead of a guessed --swarm total_epochs: "
                        "once training is under way the run sizes total_epochs from the swarm's measured pace, "
                        "and the learning rate reaches zero at the end. Restart with a longer budget (or a larger "
                        "total_epochs) to extend a live run")
    p.add_argument("--model", action="append", metavar="KEY=VALUE", help="override a model preset field")
    p.add_argument("--db", default=None,
                   help="SQLAlchemy database URL, e.g. postgresql://user:pw@host/db (default: a SQLite file in "
                        "RUN_DIR)")
    p.add_argument("--auth", choices=["open", "allowlist"], default="open",
                   help="open: anyone may join (each peer still gets its own token); allowlist: only users "
                        "added with `crowdtrain users add NAME`, who join with --key")
    p.add_argument("--token-lifetime-s", type=float, default=600.0,
                   help="lifetime of peers' access tokens: a revoked user's peers are out within this time")
    p.add_argument("--token-requests-per-minute", type=int, default=120,
                   help="rate limit on token requests per API key (per client address without a valid key)")
    p.add_argument("--samples-every", type=int, default=1, metavar="N",
                   help="generate gallery samples from every N-th checkpoint (0: never)")
    p.add_argument("--collect-every-s", type=float, default=2.0, metavar="S",
                   help="how often the auxiliary peer reads the volunteers' records into the dashboard, the "
                        "leaderboard and /api/status (0.2-30 s); each read fetches every volunteer's record: "
                        "raise it for swarms of hundreds")
    p.add_argument("--sample-prompts", default=None, metavar="FILE",
                   help="prompts of the gallery samples: one a line, optionally tagged ('[held-out] a blue "
                        "apple'); default: the shapes data's seen and held-out prompts, or for other data "
                        "the first captions of its valid split, drawn next to their real images")
    p.add_argument("--text-tokenizer", default=None, metavar="FILE",
                   help="the run's text tokenizer (a tokenizers JSON file, `crowdtrain tokenizer train-text`); "
                        "default: the shipped one for the shapes captions")
    p.add_argument("--image-tokenizer", default=None, metavar="FILE",
                   help="the image tokenizer the shards were made with (.safetensors, `crowdtrain tokenizer "
                        "train`, or a VQGAN); default: the shipped one the shards record")
    p.set_defaults(handler=_coordinator)

    u = subparsers.add_parser(
        "users", help="manage who may join an allowlist run: add, list, revoke",
        description="Users of a run and their API keys, stored in the coordinator's database. `add` prints "
                    "the new key once (only its hash is stored); hand it to the volunteer, who joins with "
                    "`crowdtrain join URL --key KEY`. `revoke` takes effect within one token lifetime.")
    u.add_argument("action", choices=["add", "list", "revoke"])
    u.add_argument("name", nargs="?", help="user name (add, revoke)")
    u.add_argument("--run-id", default="crowdtrain", help="the run (its folder is runs/RUN_ID unless --run-dir)")
    u.add_argument("--run-dir", default=None, help="the run folder (default runs/RUN_ID)")
    u.add_argument("--db", default=None, help="database URL, if the coordinator was started with --db")
    u.set_defaults(handler=_users)


def _coordinator(args) -> int:
    from crowdtrain.coordinator.run import CoordinatorConfig, run_coordinator
    from crowdtrain.runspec.overrides import parse_overrides
    from crowdtrain.runspec.schedule import parse_duration

    config = CoordinatorConfig(
        run_id=args.run_id, preset=args.preset, data=args.data, host=args.host, port=args.port,
        public_host=args.public_host, public_url=args.public_url, tls_cert=args.tls_cert, tls_key=args.tls_key,
        trusted_proxy=args.trusted_proxy, dht_host=args.dht_host, dht_port=args.dht_port, run_dir=args.run_dir,
        identity=args.identity, checkpoint_dir=args.checkpoint_dir, keep_checkpoints=args.keep_checkpoints,
        valid_rows=args.valid_rows,
        swarm_preset=args.swarm_preset, swarm_overrides=parse_overrides(args.swarm, flag="--swarm"),
        model_overrides=parse_overrides(args.model, flag="--model"), db=args.db, auth=args.auth,
        token_lifetime_s=args.token_lifetime_s, token_requests_per_minute=args.token_requests_per_minute,
        samples_every_checkpoints=args.samples_every, collect_every_s=args.collect_every_s,
        sample_prompts=args.sample_prompts,
        text_tokenizer=args.text_tokenizer, image_tokenizer=args.image_tokenizer,
        time_budget_s=parse_duration(args.time_budget) if args.time_budget is not None else None)
    return run_coordinator(config)


def _join_target(run_dir) -> str:
    """``URL --pin SHA256:...`` of the run in ``run_dir`` as its last start handed it out."""
    import json

    from crowdtrain.runspec.trust import fingerprint

    try:
        auth = json.loads((run_dir / "coordinator.json").read_text())["auth"]
        return f"{auth['token_url'].removesuffix('/api/token')} --pin {fingerprint(auth['coordinator_public_key'])}"
    except (OSError, ValueError, KeyError, TypeError):
        return "https://COORDINATOR --pin SHA256:...   # both as the run's join page shows them"


def _users(args) -> int:
    from pathlib import Path

    from crowdtrain.coordinator.db import Store, default_url

    run_dir = Path(args.run_dir or f"runs/{args.run_id}")
    if args.db is None and not (run_dir / "coordinator.sqlite").is_file() and args.action != "add":
        raise ValueError(f"no run database at {run_dir / 'coordinator.sqlite'}: pass --run-id or --run-dir of a "
                         "run (or --db URL)")
    if args.action in ("add", "revoke") and not args.name:
        raise ValueError(f"`crowdtrain users {args.action}` needs a user name")
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store(args.db or default_url(run_dir))
    try:
        if args.action == "add":
            key = store.add_user(args.name)
            # The key stays out of the join line: a command line lands in shell history and in
            # `ps` for every user of the machine; an environment variable does neither.
            print(f"user {args.name} added. Their API key (shown once; send it to them privately):\n\n    {key}\n\n"
                  "They join with the key in the environment, not on the command line:\n\n"
                  "    read -rs CROWDTRAIN_KEY && export CROWDTRAIN_KEY   # paste the key, then Enter\n"
                  f"    crowdtrain join {_join_target(run_dir)}")
        elif args.action == "revoke":
            store.revoke_user(args.name)
            print(f"user {args.name} revoked: their peers are refused once their current tokens expire")
        else:
            users = store.list_users()
            if not users:
                print("no users yet: add one with `crowdtrain users add NAME`")
            for u in users:
                state = "revoked" if u["revoked"] else ("active" if u["has_key"] else "open-run name, no key")
                print(f"{u['name']:<24} {state}")
    finally:
        store.close()
    return 0
