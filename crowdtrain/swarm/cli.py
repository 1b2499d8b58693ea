"""`crowdtrain join`: volunteer your machine to a run."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "join", help="join a run as a volunteer: one command",
        description="Fetch a run's configuration from its coordinator, check this machine builds the same "
                    "model, download the current state from peers, stream data and train with the swarm, until "
                    "the run's last epoch (the organizer may extend it while you train). Ctrl-C leaves cleanly. One "
                    "progress line per step: epoch, local loss, samples/s, samples contributed, peers in the last "
                    "averaging round.")
    p.add_argument("url", help="the coordinator's address, e.g. http://HOST:8000")
    p.add_argument("--batch-size", type=_batch_size, default="auto",
                   help="samples per local step. auto (default): the largest power of two whose estimated memory "
                        "(for this run's model, by the memory calculator) fits 85%% of the GPU's free memory, or of "
                        "the available RAM on the CPU; at most 64 on a GPU and 16 on the CPU (and in DiLoCo mode), "
                        "never above the swarm's target batch. Lower it if out of memory")
    p.add_argument("--device", default="auto",
                   help="auto (default: the GPU if torch sees one, else the CPU; the log says which and why), cpu, "
                        "cuda or cuda:N")
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (fp16 needs a GPU)")
    p.add_argument("--client-mode", action="store_true",
                   help="behind NAT or a firewall: only make outbound connections")
    p.add_argument("--host", default="0.0.0.0", help="address to accept peer connections on")
    p.add_argument("--max-epochs", type=int, default=None, help="leave when the swarm reaches this global epoch")
    p.add_argument("--minutes", type=float, default=None, help="leave after this much time")
    p.add_argument("--key", default=None,
                   help="your API key for runs that admit only invited users (or set CROWDTRAIN_KEY); the "
                        "organizer makes one with `crowdtrain users add NAME`")
    p.add_argument("--pin", default=None, metavar="SHA256:...",
                   help="the coordinator key's fingerprint, as its join page shows it: join only a coordinator "
                        "holding that key (without it, the key seen on first contact is remembered and a changed "
                        "one refused)")
    p.add_argument("--user", default="anonymous",
                   help="name shown for your contributions in open runs: 1-64 ASCII letters, digits, '-', '_', '.' "
                        "(with --key, the key's user is used)")
    p.add_argument("--identity", default=None,
                   help="file of this peer's private key (made if missing); default: a fresh one per process")
    p.add_argument("--leave-within", type=float, default=90.0, metavar="SECONDS",
                   help="after Ctrl-C or SIGTERM, leave cleanly but exit within this many seconds whatever this "
                        "peer waits on (default 90, systemd's stop timeout; under `docker stop`, below its 10 s)")
    p.add_argument("--simulated-step-s", type=float, default=0.0,
                   help="pad each step's computation (not its waiting for peers) to at least this many seconds "
                        "(emulates a slower device)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads. Default: this machine's usable cores shared evenly among the volunteers "
                        "running on it (each `crowdtrain join` registers under ~/.cache/crowdtrain/volunteers/), "
                        "recounted every 5 s as volunteers come and go")
    p.add_argument("--data-outage-patience-s", type=float, default=600.0,
                   help="how long the run's data source (the coordinator's shards) may stay unreachable before "
                        "this peer gives up; meanwhile it retries with back-off and trains on rows already read")
    p.add_argument("--shuffle-buffer", type=int, default=2048, metavar="ROWS",
                   help="rows of the stream held in memory to shuffle it (about 2 KB each at the paper's 32x32 "
                        "codes); it refills half at a time, and a smaller one reads the shards in smaller, "
                        "more frequent pieces")
    p.add_argument("--summary-file", default=None, help="write a JSON summary of this peer's run here")
    p.add_argument("--save-final", default=None, help="save the final parameters (safetensors) here")
    p.add_argument("--model", action="append", metavar="KEY=VALUE",
                   help="override the run's model config (only to test that a different model is refused)")
    p.add_argument("--inject-fault", default=None, metavar="nan-every=K|attack=NAME|slow-upload=S",
                   help="testing aid: make every K-th local gradient NaN, to check it is never sent; or send "
                        "crafted tensors in every averaging round (NAME: scale, sign_flip, noise, nan, bias, weight)")
    p.set_defaults(handler=_join)


def _batch_size(value: str):
    if value == "auto":
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be auto or an integer >= 1, got {value!r}")
    return size


def _join(args) -> int:
    import os

    from crowdtrain.runspec.overrides import parse_overrides
    from crowdtrain.swarm.join_info import check_same_protocol, fetch_json, join_url
    from crowdtrain.swarm.volunteer_config import VolunteerConfig

    # The options first, then the coordinator's protocol, both before torch's import (seconds; a
    # minute on a busy machine): a wrong option, or a coordinator of another protocol (which
    # answers with the line that installs its own), is said at once.
    from crowdtrain.runspec.trust import CoordinatorTrust

    config = VolunteerConfig(
        coordinator_url=args.url, pin=args.pin, batch_size=args.batch_size, device=args.device, precision=args.precision,
        client_mode=args.client_mode, host=args.host, max_epochs=args.max_epochs, max_minutes=args.minutes,
        user=args.user, api_key=args.key or os.environ.get("CROWDTRAIN_KEY"), identity=args.identity,
        simulated_step_s=args.simulated_step_s, torch_threads=args.threads,
        data_outage_patience_s=args.data_outage_patience_s, shuffle_buffer=args.shuffle_buffer,
        summary_file=args.summary_file, save_final=args.save_final, leave_within_s=args.leave_within,
        model_overrides=parse_overrides(args.model, flag="--model"), fault=args.inject_fault, verbose=args.verbose)
    base = config.coordinator_url.rstrip("/")
    trust = CoordinatorTrust(base, pin=config.pin)
    info = fetch_json(join_url(base), api_key=config.api_key, trust=trust)
    check_same_protocol(info, base)

    from crowdtrain.lifecycle import forks_die_with_this_process
    from crowdtrain.swarm.peer import run_volunteer

    forks_die_with_this_process()  # hivemind's DHT and averager processes end with this one
    summary = run_volunteer(config, info=info, trust=trust)
    return 1 if summary.get("process_died") else 0  # a failure, for the supervisor that restarts it
