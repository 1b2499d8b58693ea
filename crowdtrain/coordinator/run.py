"""`crowdtrain coordinator`: start a run in one command.

The coordinator process serves HTTP (uvicorn) and supervises a child process, the auxiliary
peer (``crowdtrain.auxpeer``), which is the run's first DHT peer. They share the run
folder: the coordinator writes ``coordinator.json`` (the run's spec), the child answers with
``run.json`` (join information with initial peers), ``status.json``, ``metrics.jsonl`` and
checkpoints. This process never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.ports import Port, check_ports, cmdline, parent_pid
from crowdtrain.coordinator.restart import compare_specs
from crowdtrain.data.sample_prompts import RUN_FILE as RUN_PROMPTS_FILE
from crowdtrain.lifecycle import die_with_parent, exit_on_signals
from crowdtrain.model.config import get_preset
from crowdtrain.runspec import files
from crowdtrain.runspec.schedule import RunSchedule, read_schedule, schedule_at_start, write_schedule
from crowdtrain.runspec.swarm import SwarmConfig, demo_swarm_config, laptop_swarm_config
from crowdtrain.runspec.tokens import CoordinatorKey

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SWARM_PRESETS = {"default": SwarmConfig, "demo": demo_swarm_config, "laptop": laptop_swarm_config}


@dataclass
class CoordinatorConfig:
    run_id: str = "crowdtrain"
    preset: str = "demo"
    data: str = "shapes"  # a shard folder (served over HTTP), an http(s) URL, a hub id, or pattern/synthetic
    host: str = "0.0.0.0"
    port: int = 8000
    public_host: str = "127.0.0.1"  # the address volunteers use to reach this machine (its DHT peer)
    # The address every URL handed out starts with (install line, join info, shards, checkpoints,
    # notebooks, pages): https://run.example.org behind a TLS proxy; default: http(s)://PUBLIC_HOST:PORT.
    public_url: str | None = None
    tls_cert: str | None = None  # serve HTTPS itself: a PEM certificate (chain) and its private key
    tls_key: str | None = None
    # Addresses of reverse proxies in front (comma-separated, e.g. 127.0.0.1 for Caddy on this machine):
    # only their X-Forwarded-For is believed, so rate limits see the real clients. None: no proxy.
    trusted_proxy: str | None = None
    dht_host: str = "0.0.0.0"
    dht_port: int = 31337
    run_dir: str | None = None  # default: runs/RUN_ID
    identity: str | None = None  # default: RUN_DIR/identity.key (created on first start, then reused)
    checkpoint_dir: str | None = None  # default: RUN_DIR/checkpoints
    keep_checkpoints: int = 3  # the newest ones; the one with the lowest validation loss is kept too
    valid_rows: int = 512  # rows per held-out split for the validation loss at each checkpoint (0: none)
    swarm_preset: str = "default"
    swarm_overrides: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    text_tokenizer: str | None = None  # default: the shipped shapes tokenizer
    image_tokenizer: str | None = None
    startup_timeout_s: float = 180.0
    db: str | None = None  # SQLAlchemy URL; default: a SQLite file in the run folder
    auth: str = "open"  # open: anyone joins (still with a per-peer token); allowlist: only users with a key
    token_lifetime_s: float = 600.0  # a revoked user's peers are out within this time
    token_requests_per_minute: int = 120  # per API key (per address without one), on /api/token
    samples_every_checkpoints: int = 1  # gallery images from every N-th checkpoint (0: never)
    # How often the auxiliary peer reads the volunteers' records (the dashboard's, leaderboard's and
    # /api/status's freshness). Each read fetches every volunteer's record, about 2.8 kB, from each
    # of the metrics key's replicas: raise it for swarms of hundreds (docs/road-to-a-thousand.md).
    collect_every_s: float = 2.0
    sample_prompts: str | None = None  # a prompts file (crowdtrain.data.sample_prompts); default: from the data
    # Train for this long instead of a given total_epochs: the auxiliary peer sizes the total from
    # the swarm's measured pace (crowdtrain.runspec.schedule).
    time_budget_s: float | None = None

    def __post_init__(self):
        if self.time_budget_s is not None and "total_epochs" in self.swarm_overrides:
            raise ValueError("--time-budget and --swarm total_epochs both set the schedule's length: give one of them")
        if self.time_budget_s is not None and not 0 < self.time_budget_s <= 366 * 86400:
            raise ValueError(f"--time-budget must be longer than 0 and at most a year, got {self.time_budget_s} s")
        if self.auth not in ("open", "allowlist"):
            raise ValueError(f"--auth must be open or allowlist, got {self.auth!r}")
        if not 10 <= self.token_lifetime_s <= 7 * 86400:
            raise ValueError(f"--token-lifetime-s must be between 10 s and a week, got {self.token_lifetime_s}")
        if self.token_requests_per_minute < 1:
            raise ValueError("--token-requests-per-minute must be >= 1")
        if self.swarm_preset not in SWARM_PRESETS:
            raise ValueError(f"--swarm-preset must be one of {sorted(SWARM_PRESETS)}, got {self.swarm_preset!r}")
        if self.keep_checkpoints < 1:
            raise ValueError("--keep-checkpoints must be >= 1")
        # A leaving volunteer's last record lives a minute in the DHT: read within that, twice.
        if not 0.2 <= self.collect_every_s <= 30:
            raise ValueError(f"--collect-every-s must be between 0.2 and 30 s, got {self.collect_every_s}")
        if self.valid_rows < 0:
            raise ValueError("--valid-rows must be >= 0 (0: no validation loss at checkpoints)")
        self._check_web_settings()
        if self.port == self.dht_port:
            raise ValueError(f"--port and --dht-port are both {self.port}: the HTTP service and the DHT peer need "
                             "a port each")
        self.run_dir = self.run_dir or f"runs/{self.run_id}"
        self.identity = self.identity or str(Path(self.run_dir) / "identity.key")
        self.checkpoint_dir = self.checkpoint_dir or str(Path(self.run_dir) / "checkpoints")
        self.db = self.db or default_url(self.run_dir)
        for flag, path in (("--text-tokenizer", self.text_tokenizer), ("--image-tokenizer", self.image_tokenizer)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
        if self.sample_prompts is not None:
            from crowdtrain.data.sample_prompts import read_prompt_file
            read_prompt_file(self.sample_prompts)  # a bad file stops the start, before anything is created

    def _check_web_settings(self) -> None:
        import urllib.parse

        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: the certificate and its private key")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
        if self.public_url is None:
            return
        parts = urllib.parse.urlsplit(self.public_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment or parts.username:
            raise ValueError(f"--public-url must be the run's address alone, e.g. https://run.example.org or "
                             f"https://run.example.org:8443 (no path), got {self.public_url!r}")
        if self.tls_cert is not None and parts.scheme != "https":
            raise ValueError(f"--tls-cert serves HTTPS, but --public-url {self.public_url} says http://: "
                             "make it https://")
        if parts.scheme == "http" and self.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("--public-url %s is plain HTTP: anyone on the network path can change the install line "
                           "and read API keys. Serve HTTPS (--tls-cert/--tls-key, or a proxy such as Caddy: "
                           "docs/organize-a-run.md)", self.public_url)

    @property
    def key_path(self) -> Path:
        return Path(self.run_dir) / "coordinator_key.pem"

    def swarm_config(self) -> SwarmConfig:
        base = SWARM_PRESETS[self.swarm_preset]()
        overrides = dict(self.swarm_overrides)
        if self.time_budget_s is not None:
            # The total is sized later; until then the stored value only has to be a valid one.
            warmup = overrides.get("warmup_epochs", base.warmup_epochs)
            overrides["total_epochs"] = max(base.total_epochs, warmup + 1) if isinstance(warmup, int) \
                else base.total_epochs
        return dataclasses.replace(base, run_id=self.run_id, **overrides)

    @property
    def url(self) -> str:
        if self.public_url is not None:
            return self.public_url.rstrip("/")
        return f"{'https' if self.tls_cert else 'http'}://{self.public_host}:{self.port}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def image_tokenizer_layout(path) -> tuple[int, tuple[int, int] | None] | None:
    """(codebook size, code factors or None) of a ``.safetensors`` image tokenizer, read from its
    metadata (``crowdtrain.data.image_tokenizer_base.METADATA_KEY``) without importing torch, which the
    coordinator's process does without; None if not known."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        meta = json.loads(header.get("__metadata__", {}).get("crowdtrain_image_tokenizer", "null"))
        kind, config = meta["kind"], meta["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if kind == "palette_mask":
        factors = (int(config["n_masks"]), len(config["palette"]))
        return factors[0] * factors[1], factors
    if kind == "small_vq":
        return int(config.get("codebook_size", 512)), None
    if kind == "taming_vqgan":
        return int(config.get("n_embed", 8192)), None
    return None


def _default_image_tokenizer(shards_dir: Path | None) -> Path:
    """The shipped tokenizer the shards were made with, as their ``shards.json`` records it: the
    bundled shapes data's palette codes, or (anything else) the learned VQ, `data prepare`'s default."""
    kind = ((read_shards_manifest(shards_dir) or {}).get("image_tokenizer") or {}).get("kind")
    return ASSETS / ("shapes_palette.safetensors" if kind == "palette_mask" else "shapes_vq.safetensors")


def build_spec(config: CoordinatorConfig, shards_dir: Path | None) -> dict:
    model = get_preset(config.preset, **config.model_overrides)
    swarm = config.swarm_config()
    data = f"{config.url}/shards" if shards_dir is not None else config.data
    text_tokenizer = Path(config.text_tokenizer) if config.text_tokenizer else ASSETS / "shapes_text_tokenizer.json"
    image_tokenizer = Path(config.image_tokenizer) if config.image_tokenizer else _default_image_tokenizer(shards_dir)
    needs_tokenizer = data not in ("pattern", "synthetic")
    # The model's image vocabulary is the tokenizer's, unless the organizer set it: the `demo`
    # preset serves both the shapes data's palette codes and the learned VQ's 512. Generated data
    # (pattern, synthetic) has no tokenizer: the preset's vocabulary stands.
    layout = image_tokenizer_layout(image_tokenizer) if needs_tokenizer and image_tokenizer.suffix == ".safetensors" \
        else None
    if layout is not None and not {"image_vocab_size", "image_code_factors"} & set(config.model_overrides):
        model = dataclasses.replace(model, image_vocab_size=layout[0], image_code_factors=layout[1])
    if needs_tokenizer:
        check_tokenizers_fit(model, text_tokenizer=text_tokenizer, image_tokenizer=image_tokenizer, layout=layout,
                             shards_dir=shards_dir, explicit_image_tokenizer=config.image_tokenizer is not None)
    assets = {}
    if text_tokenizer.is_file():
        assets["text_tokenizer.json"] = str(text_tokenizer)
    if image_tokenizer.is_file():
        assets["image_tokenizer.safetensors"] = str(image_tokenizer)
    return {
        "preset": config.preset,
        "swarm": swarm.to_dict(),
        "task": {"name": "dalle", "model": model.to_dict(), "data": data},
        "dht_host": config.dht_host, "dht_port": config.dht_port, "public_host": config.public_host, "identity": str(Path(config.identity).resolve()),
        "checkpoint_dir": str(Path(config.checkpoint_dir).resolve()), "keep_checkpoints": config.keep_checkpoints,
        "valid_rows": config.valid_rows,
        "text_tokenizer": ({"url": f"{config.url}/assets/text_tokenizer.json", "sha256": _sha256(text_tokenizer),
                            "path": str(text_tokenizer)} if needs_tokenizer else None),
        "assets": assets,
        "db_url": config.db,
        "samples_every_checkpoints": config.samples_every_checkpoints,
        "collect_every_s": config.collect_every_s,
        "sample_prompts": sample_prompts_for(config, shards_dir) if needs_tokenizer else [],
        "auth": {"mode": config.auth, "key_path": str(config.key_path.resolve()),
                 "coordinator_public_key": CoordinatorKey.load_or_create(config.key_path).public_key.decode(),
                 "token_url": f"{config.url}/api/token", "token_lifetime_s": config.token_lifetime_s},
    }


def text_vocab_size(path: Path) -> int:
    """Token ids a tokenizers JSON file can produce (its largest id + 1)."""
    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in data.get("added_tokens") or []]
        return max(ids) + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--text-tokenizer {path} is not a tokenizers JSON file ({type(e).__name__}: {e}); make one "
                         "with `crowdtrain tokenizer train-text`") from e


def check_tokenizers_fit(model, *, text_tokenizer: Path, image_tokenizer: Path, layout, shards_dir: Path | None,
                         explicit_image_tokenizer: bool) -> None:
    """Refuse a run whose tokenizers or shards the model cannot read, naming the setting to change."""
    n_text = text_vocab_size(text_tokenizer)
    if n_text > model.text_vocab_size:
        raise ValueError(f"the text tokenizer {text_tokenizer} has {n_text} tokens but the model reads "
                         f"{model.text_vocab_size}: add --model text_vocab_size={n_text}")
    if layout is None and explicit_image_tokenizer:
        raise ValueError(f"--image-tokenizer {image_tokenizer} carries no crowdtrain tokenizer metadata, so its "
                         "codebook is unknown: make it with `crowdtrain tokenizer train` or `crowdtrain tokenizer "
                         "convert` (a taming VQGAN)")
    if layout is not None and layout[0] != model.image_vocab_size:
        raise ValueError(f"the image tokenizer {image_tokenizer} has {layout[0]} codes but the model draws "
                         f"{model.image_vocab_size}: use --model image_vocab_size={layout[0]} (or leave "
                         "image_vocab_size unset: it follows the tokenizer)")
    if layout is not None and layout[1] != model.image_code_factors:
        fix = "null" if layout[1] is None else json.dumps(list(layout[1]))
        raise ValueError(f"the image tokenizer {image_tokenizer} has code factors {layout[1]} but the model "
                         f"{model.image_code_factors}: use --model image_code_factors={fix}")
    recorded = (read_shards_manifest(shards_dir) or {}).get("image_tokenizer") or {}
    grid = recorded.get("grid")
    if grid and tuple(grid) != (model.image_height, model.image_width):
        raise ValueError(f"the shards in {shards_dir} hold {grid[0]}x{grid[1]} codes per image but the model draws "
                         f"{model.image_height}x{model.image_width}: add --model image_height={grid[0]} "
                         f"--model image_width={grid[1]}")
    if recorded.get("vocab_size") and layout is not None and recorded["vocab_size"] != layout[0]:
        raise ValueError(f"the shards in {shards_dir} were coded with a {recorded['vocab_size']}-code "
                         f"{recorded.get('kind', '')} tokenizer, but the run's image tokenizer {image_tokenizer} "
                         f"has {layout[0]} codes: pass --image-tokenizer FILE, the one the shards were made with")


def read_shards_manifest(shards_dir: Path | None) -> dict | None:
    try:
        manifest = json.loads((shards_dir / "shards.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def sample_prompts_for(config: CoordinatorConfig, shards_dir: Path | None) -> list[dict]:
    """What the gallery draws (crowdtrain.data.sample_prompts): the organizer's file, the shapes
    evaluation prompts for the shapes data, else captions of the data's valid split."""
    from crowdtrain.data import sample_prompts

    if config.sample_prompts is not None:
        return sample_prompts.read_prompt_file(config.sample_prompts)
    if config.data == "shapes" or (shards_dir is not None and (shards_dir / "demo.json").is_file()):
        return sample_prompts.shapes_prompts()
    try:
        return sample_prompts.data_prompts(shards_dir or config.data)
    except Exception as e:  # the data may be remote and down: the run starts, without a gallery
        logger.warning("no sample prompts: %s. The gallery stays empty; pass --sample-prompts FILE", e)
        return []


class ShapesBuildFailed(ValueError):
    """The bundled shapes data could not be made (its maker's error is in the log above it): a
    problem of this machine (disk, memory) the organizer can fix, told without a second traceback."""


def resolve_shards(config: CoordinatorConfig) -> Path | None:
    """The local shard folder to serve, making the bundled shapes data on first use."""
    if config.data == "shapes":
        # Made in a child process: the image tokenizer needs torch, which the coordinator does not
        # import. The first build on a machine takes minutes (later runs take the cached set): its
        # log lines and progress bar go to this process's stderr, so the organizer sees it work.
        target = Path(config.run_dir) / "data" / "shapes"
        code = ("import sys; from crowdtrain.cli import setup_logging; setup_logging(False); "
                "from crowdtrain.data import ensure_demo_shards; print(ensure_demo_shards(sys.argv[1]))")
        out = subprocess.run([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            raise ShapesBuildFailed(f"making the bundled shapes data in {target} failed (exit {out.returncode}; "
                                    "its error is above): fix that and start the coordinator again, or give --data "
                                    "a shard folder of your own (`crowdtrain data prepare`)")
        return Path(out.stdout.strip().splitlines()[-1])
    path = Path(config.data)
    if path.is_dir():
        if not (path / "shards.json").is_file():
            raise FileNotFoundError(f"{path} has no shards.json: make shards with `crowdtrain data prepare`")
        return path
    if config.data in ("pattern", "synthetic") or config.data.startswith(("http://", "https://")) or "/" in config.data:
        return None  # streamed from elsewhere (or generated by the peers)
    raise FileNotFoundError(f"--data {config.data!r} is neither a shard folder, a URL, a hub id nor 'shapes'")


def _run_has_trained(run_dir: Path, spec: dict) -> bool:
    """Whether a swarm may be training this run: a checkpoint or a metrics record exists. Before
    that, a restart may change anything (e.g. fix a setting the first start failed on)."""
    checkpoints = Path(spec.get("checkpoint_dir") or run_dir / "checkpoints")
    metrics = run_dir / files.METRICS
    return any(checkpoints.glob("step-*")) or (metrics.is_file() and metrics.stat().st_size > 0)


def settle_with_stored_run(run_dir: Path, config: CoordinatorConfig, spec: dict) -> RunSchedule:
    """Compare this start's settings with the stored run's (``coordinator.json`` of the last start)
    and log each change; refuse those a live swarm cannot take (``crowdtrain.coordinator.restart``),
    with an error naming the flag. Returns the schedule to start with (an extension continues from
    the current epoch; no flag keeps the stored one) and puts it into ``spec``'s swarm settings."""
    try:
        stored_spec = json.loads((run_dir / "coordinator.json").read_text())
    except (OSError, ValueError):
        stored_spec = None
    stored, problem = read_schedule(run_dir)
    if problem:
        logger.warning("%s; taking the schedule from the stored settings", problem)
    if stored is None and isinstance(stored_spec, dict):  # a run from before schedule.json
        old = stored_spec.get("swarm") or {}
        with contextlib.suppress(TypeError, ValueError):
            stored = RunSchedule(total_epochs=int(old["total_epochs"]), warmup_epochs=int(old["warmup_epochs"])).check()
    if isinstance(stored_spec, dict):
        trained = _run_has_trained(run_dir, stored_spec)
        changes = compare_specs(stored_spec, spec)
        if changes.refused and trained:
            raise ValueError(changes.error(run_dir))
        for line in changes.accepted + [f"{r} (accepted: the run has not trained yet)" for r in changes.refused]:
            logger.warning("changed from the stored run: %s", line)
        if not trained:
            stored = None  # nothing to continue: this start's schedule, as on a fresh run
    swarm = spec["swarm"]
    status, _ = files.read_status(run_dir)
    schedule, notes = schedule_at_start(
        stored, total_epochs=swarm["total_epochs"], warmup_epochs=swarm["warmup_epochs"],
        explicit_total="total_epochs" in config.swarm_overrides, explicit_warmup="warmup_epochs" in config.swarm_overrides,
        time_budget_s=config.time_budget_s, reached_epoch=status.epoch or None)
    for line in notes:
        logger.warning("schedule: %s", line)
    swarm["warmup_epochs"] = schedule.warmup_epochs
    swarm["total_epochs"] = (schedule.total_epochs if schedule.total_epochs is not None
                             else max(swarm["total_epochs"], schedule.warmup_epochs + 1))
    SwarmConfig.from_dict(swarm)  # still a valid setting for volunteers
    return schedule


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), whatever the umask: the run's
    spec can hold a database password (``--db postgresql://user:password@...``)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # an existing file keeps its mode through O_CREAT
    os.replace(tmp, path)


def _end_leftover_aux(run_dir: Path, timeout_s: float = 20.0) -> None:
    """An auxiliary peer of this run still alive holds the DHT port and identity; end it before
    starting a new one. It ends by itself within seconds of its coordinator's death (see
    ``crowdtrain.lifecycle``), so this finds one that is still leaving, stopped or hung."""
    import os
    import signal

    pid_file = run_dir / "aux.pid"
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (FileNotFoundError, ValueError, OSError):
        return
    if "crowdtrain.auxpeer" not in cmdline:
        return  # the pid was reused by something else
    logger.warning("ending the auxiliary peer left over from a previous start (pid %d)", pid)
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGCONT)  # a stopped one (Ctrl-Z, a debugger) handles SIGTERM only once resumed
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


def _aux_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "crowdtrain.auxpeer", str(run_dir)]


def _aux_processes(run_dir: Path) -> dict[int, int]:
    """This run's auxiliary peer processes (its forked workers, DHT and averager, share its command
    line) and their p2p daemons, alive now: pid -> parent pid."""
    command = _aux_command(run_dir)[1:]
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            table[pid] = (cmdline(pid), parent_pid(pid))
    workers = {pid for pid, (argv, _) in table.items() if argv[1:] == command}
    return {pid: ppid for pid, (_, ppid) in table.items() if pid in workers or ppid in workers}


def _leftover_aux(run_dir: Path) -> set[int]:
    """The processes of this run's auxiliary peer if its coordinator is gone (it crashed or was
    killed, or they are still exiting); they hold the DHT port until ended. Empty while the
    coordinator that started them is alive: that run is live, not left over."""
    procs = _aux_processes(run_dir)
    for ppid in set(procs.values()) - set(procs):
        argv = cmdline(ppid) if ppid else []
        if "coordinator" in argv and any("crowdtrain" in a for a in argv):
            return set()
    return set(procs)


def _end_orphans_of_aux(run_dir: Path) -> None:
    """What a killed auxiliary peer leaves running: its forked workers and their p2p daemons. A
    daemon still holds the DHT port, and a new peer on the same port would then get half of the
    connections; so they go before it starts."""
    import os
    import signal

    for pid in sorted(_aux_processes(run_dir)):
        logger.warning("ending pid %d, left over from a killed auxiliary peer", pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class AuxSupervisor:
    """Runs the auxiliary peer and starts it again whenever it exits while the coordinator serves.

    It is the run's first DHT peer: while it is down, newcomers cannot join (volunteers already in
    train on). A restart keeps its port and identity, so nobody needs new addresses. The pause
    before a restart doubles with each exit that comes within ``stable_s`` of its start (1 s up
    to ``max_pause_s``), so a peer that cannot start does not spin; its log is ``aux.log``.
    """

    def __init__(self, run_dir: Path, *, stable_s: float = 300.0, max_pause_s: float = 60.0):
        self.run_dir, self.stable_s, self.max_pause_s = run_dir, stable_s, max_pause_s
        self.log = open(run_dir / "aux.log", "a")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.proc = self._spawn()
        self._thread = threading.Thread(target=self._watch, name="aux-supervisor", daemon=True)

    def _spawn(self) -> subprocess.Popen:
        self._started = time.monotonic()
        # Ends with the coordinator even if it is killed (the forking thread, main or this
        # supervisor's, lives until stop()).
        return subprocess.Popen(_aux_command(self.run_dir), stdout=self.log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)

    def watch(self) -> None:
        """Restart from now on (before, a failing start is the caller's to report)."""
        self._thread.start()

    def _watch(self) -> None:
        pause = 1.0
        while True:
            code = self.proc.wait()
            if self._stop.is_set():
                return
            pause = 1.0 if time.monotonic() - self._started > self.stable_s else min(2 * pause, self.max_pause_s)
            logger.error("the auxiliary peer exited with code %s; starting it again in %.0f s (see %s)", code, pause,
                         self.run_dir / "aux.log")
            if self._stop.wait(pause):
                return
            with self._lock:
                if self._stop.is_set():
                    return
                _end_orphans_of_aux(self.run_dir)
                self.proc = self._spawn()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def run_coordinator(config: CoordinatorConfig) -> int:
    import uvicorn

    from crowdtrain.coordinator.service import AuthSettings, create_app

    run_dir = Path(config.run_dir)
    # SIGTERM/SIGHUP unwind to the `finally` below, which ends the auxiliary peer; uvicorn takes
    # SIGTERM over while it serves, shuts down, and raises it again once it returns.
    exit_on_signals()
    # Before the run folder, its keys and the DHT peer exist: a clash leaves no trace, and the run
    # that holds the port is not touched.
    check_ports([Port("HTTP port", config.host, config.port, "--port", "--host"),
                 Port("DHT port", config.dht_host, config.dht_port, "--dht-port", "--dht-host")],
                ignore_pids=_leftover_aux(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db)  # creates the tables before the auxiliary peer writes to them
    shards_dir = resolve_shards(config)
    spec = build_spec(config, shards_dir)
    schedule = settle_with_stored_run(run_dir, config, spec)
    write_private(run_dir / "coordinator.json", json.dumps(spec, indent=2))  # db_url may hold a password
    write_schedule(run_dir, schedule)
    (run_dir / RUN_PROMPTS_FILE).write_text(json.dumps(
        [{k: v for k, v in p.items() if k != "reference"} for p in spec["sample_prompts"]], indent=1))
    _end_leftover_aux(run_dir)
    _end_orphans_of_aux(run_dir)
    for stale in (files.RUN_INFO, files.STATUS):  # from a previous start: the new aux peer rewrites them
        (run_dir / stale).unlink(missing_ok=True)
    aux = AuxSupervisor(run_dir)
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        while not (run_dir / files.RUN_INFO).is_file():
            if aux.proc.poll() is not None:
                tail = (run_dir / "aux.log").read_text()[-2000:]
                raise RuntimeError(f"the auxiliary peer exited with code {aux.proc.returncode}; its log ends:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the auxiliary peer did not start within {config.startup_timeout_s:.0f}s; "
                                   f"see {run_dir / 'aux.log'}")
            time.sleep(0.2)
        aux.watch()
        info, problem = files.read_run_info(run_dir)
        if info is None:
            raise RuntimeError(f"the auxiliary peer wrote a broken {files.RUN_INFO}: {problem}; see {run_dir / 'aux.log'}")
        from crowdtrain.runspec.trust import fingerprint

        logger.info("run %s is up: volunteers join with\n\n    crowdtrain join %s --pin %s\n\nDHT peer %s",
                    config.run_id, config.url, fingerprint(spec["auth"]["coordinator_public_key"]),
                    info.coordinator_peer_id)
        logger.info("dashboard: %s/dashboard", config.url)
        app = create_app(run_dir, store=store, shards_dir=shards_dir,
                         text_tokenizer=spec["text_tokenizer"]["path"] if spec["text_tokenizer"] else None,
                         auth=AuthSettings(mode=config.auth, key_path=config.key_path,
                                           token_lifetime_s=config.token_lifetime_s,
                                           requests_per_minute=config.token_requests_per_minute),
                         public_url=config.url, checkpoint_dir=config.checkpoint_dir)
        proxies = {"proxy_headers": True, "forwarded_allow_ips": config.trusted_proxy} if config.trusted_proxy \
            else {"proxy_headers": False}
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", ssl_certfile=config.tls_cert,
                    ssl_keyfile=config.tls_key, **proxies)
    finally:
        aux.stop()
        store.close()
    return 0
