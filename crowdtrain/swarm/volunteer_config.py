"""What `crowdtrain join` was asked, checked before anything slow: this module imports neither
torch nor hivemind, so a wrong option is said at once, before the coordinator is asked anything
(crowdtrain.swarm.cli)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class VolunteerConfig:
    coordinator_url: str
    # "auto": sized for the run's model from this device's free memory (crowdtrain.swarm.machine).
    batch_size: int | str = "auto"
    device: str = "auto"  # auto (CUDA if torch sees a device, else cpu), cpu, cuda or cuda:N
    client_mode: bool = False  # behind NAT: outbound connections only
    max_epochs: int | None = None  # leave once the swarm reaches this global epoch
    max_minutes: float | None = None
    host: str = "0.0.0.0"  # where to listen for other peers (ignored in client mode)
    simulated_step_s: float = 0.0  # pad each step's computation to at least this long (emulate a slower device)
    precision: str = "fp32"
    user: str = "anonymous"
    api_key: str | None = None  # for allowlist runs: `crowdtrain users add NAME` prints it
    # The coordinator key's fingerprint (SHA256:..., on its join page): answers signed by any other
    # key are refused. None: the key seen on first contact is remembered (crowdtrain.runspec.trust).
    pin: str | None = None
    identity: str | None = None  # private key file of this peer (default: a fresh one, deleted on exit)
    cache_dir: str = "~/.cache/crowdtrain"
    summary_file: str | None = None  # write a JSON summary here when leaving
    save_final: str | None = None  # write the final parameters (safetensors) here when leaving
    model_overrides: dict = field(default_factory=dict)  # only to test refusal of a different model
    # Fault injection for tests: "nan-every=K" makes every K-th local loss NaN (its gradients too);
    # "attack=NAME" sends crafted tensors in every averaging round (crowdtrain.swarm.attacks);
    # "slow-upload=S" holds every state this peer sends S seconds (crowdtrain.swarm.hivemind_seam.state.StateUploadLimit).
    fault: str | None = None
    # None: a fair share of this machine's cores among the volunteers on it, registered under
    # cache_dir/volunteers (crowdtrain.swarm.machine.TorchThreads).
    torch_threads: int | None = None
    # How long the run's data source (the coordinator's shards) may stay unreachable before this
    # peer gives up; meanwhile it retries and trains on rows already read (crowdtrain.data.config.StreamConfig).
    data_outage_patience_s: float = 600.0
    # Rows of the stream held to shuffle it (crowdtrain.data.config.StreamConfig.shuffle_buffer).
    shuffle_buffer: int = 2048
    # After Ctrl-C, SIGTERM or SIGHUP this peer leaves cleanly (finishes its step and round, says
    # goodbye) but exits within this many seconds whatever it waits on. 90 s: systemd's stop
    # timeout; a round's averaging timeout plus the goodbye fit in it. Lower it under `docker stop`
    # (10 s by default, then SIGKILL) to leave through this path rather than be killed.
    leave_within_s: float = 90.0
    verbose: bool = False

    def __post_init__(self):
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(f"the coordinator address must be an http(s) URL such as http://HOST:8000, "
                             f"got {self.coordinator_url!r}")
        if self.pin is not None:
            from crowdtrain.runspec.trust import check_pin

            self.pin = check_pin(self.pin)
        if self.batch_size != "auto" and not (type(self.batch_size) is int and self.batch_size >= 1):
            raise ValueError(f"--batch-size must be auto or an integer >= 1, got {self.batch_size!r}")
        if self.torch_threads is not None and not self.torch_threads >= 1:
            raise ValueError(f"--threads must be >= 1, got {self.torch_threads}")
        from crowdtrain.swarm.machine import check_device_name

        check_device_name(self.device)
        if self.precision not in ("fp32", "bf16", "fp16"):  # crowdtrain.train.local.PRECISIONS, without its imports
            raise ValueError(f"--precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if not self.data_outage_patience_s >= 0:
            raise ValueError(f"--data-outage-patience-s must be >= 0 seconds, got {self.data_outage_patience_s}")
        if not self.leave_within_s > 0:
            raise ValueError(f"--leave-within must be > 0 seconds, got {self.leave_within_s}")
        if not (type(self.shuffle_buffer) is int and self.shuffle_buffer >= 1):
            raise ValueError(f"--shuffle-buffer must be an integer >= 1 (1: no shuffling), got {self.shuffle_buffer!r}")
        from crowdtrain.runspec.names import USER_NAME_RULE, valid_user_name

        if not valid_user_name(self.user) or self.user == "coordinator":  # the coordinator refuses it too
            raise ValueError(f"--user must be {USER_NAME_RULE} (and not 'coordinator'), got {self.user!r}")
        if self.fault is not None:  # a test's option; checking it imports torch
            from crowdtrain.swarm.attacks import parse_fault

            parse_fault(self.fault)
        if self.client_mode and self.host not in ("0.0.0.0", "127.0.0.1"):
            logger.warning("--host is ignored in --client-mode: client peers accept no connections")
