"""What `crowdtrain join` picks for this machine when not told: the device, the batch size and
torch's CPU threads. Each choice is logged once at start with its reason and the flag that
overrides it.

Device (``--device auto``): CUDA when torch sees a device, else the CPU. If a GPU is there but
the log says "training on the CPU", torch is a CPU-only build or the driver is not loaded.

Batch size (``--batch-size auto``): the largest power of two whose estimated peak memory fits
:data:`SAFETY_FRACTION` of the memory free at start (the GPU's, or this machine's available
RAM), sized for this run's model and swarm settings with the memory calculator
(:mod:`crowdtrain.memcalc`), up to a cap:

- on a GPU, :data:`GPU_BATCH_CAP`: in sync mode the swarm accumulates gradients up to its target
  batch whatever each peer's batch, so a bigger local batch buys only throughput, and only while
  the GPU is not yet busy; it also makes each step a coarser share of the epoch (the swarm's
  progress, and a step in flight when the epoch ends, move in bigger pieces). 64 sequences are
  5,120 tokens of ``demo`` and 82k of ``paper``. The cap is a ceiling, not a measured optimum:
  if the GPU is not busy at 64 (``nvidia-smi``), pass a larger ``--batch-size``;
- on a CPU, :data:`CPU_BATCH_CAP`: a bigger batch is no faster per sample there, and a step
  (one progress line, one metrics record) would take longer;
- never above the swarm's target batch size: one step would otherwise be more than a global
  batch;
- in DiLoCo mode, :data:`DILOCO_BATCH_CAP`: each local batch is an inner optimizer step there,
  so the batch changes the optimization the run's learning rate was set for, not only memory.

The estimate is the calculator's for fp32 activations (under ``--precision bf16/fp16`` most
are 16-bit, so it errs towards smaller batches), plus what the swarm's optimizer holds beside
the model (:func:`swarm_overhead_bytes`). If a peer runs out of memory anyway (another program
took some after start), pass a smaller ``--batch-size``; if the GPU sits at low utilization with
a batch below the cap, the estimate was cautious: try the next power of two.

Threads (no ``--threads``): torch's default of one thread per core made two volunteers on one
machine 3-4x slower than one thread each. Each ``crowdtrain join`` writes a file in a per-machine
directory (:class:`VolunteerRegistry`) and uses an equal share of the usable cores; the share is
recomputed every :data:`REBALANCE_EVERY_S` seconds between steps, so volunteers that join or
leave move the others' counts. Volunteers with ``--threads N`` register too, and their N cores
are left to them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

AUTO = "auto"
GIB = 2**30
# Of the memory free at start. The rest is for what the calculator does not model (allocator
# fragmentation, library workspaces, data loading) and its error (within 6% of measured peaks,
# docs/memcalc.md). A peer that runs out of memory at the suggestion: lower it.
SAFETY_FRACTION = 0.85
GPU_BATCH_CAP = 64
CPU_BATCH_CAP = 16
DILOCO_BATCH_CAP = 16
# A recount lists one small directory (about a millisecond). At 30 s, the first of three
# volunteers started together kept every core for its first half-minute beside the two that
# joined 3 and 6 s later, ran at half their speed, and reached the run's first sync point too
# late for its round (benchmarks/fresh_runs.py, docs/scale.md).
REBALANCE_EVERY_S = 5.0


# ---- device -----------------------------------------------------------------------------------
def check_device_name(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, else a ValueError naming them."""
    if device not in (AUTO, "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")


def resolve_device(requested: str) -> tuple[str, str]:
    """The device to train on (``cpu`` or ``cuda:N``) and the start-up line that says why.

    ``auto``: CUDA when torch sees a device (the current one, normally ``cuda:0``), else the CPU.
    An explicit ``cuda`` or ``cuda:N`` that torch cannot see is a ValueError."""
    import torch

    check_device_name(requested)
    if requested == "cpu":
        return "cpu", "training on the CPU (--device cpu)"
    available = torch.cuda.is_available()
    if requested == AUTO and not available:
        why = ("this torch is a CPU-only build (install a CUDA build of torch to use a GPU)"
               if torch.version.cuda is None else "no GPU here, or its driver is not loaded (check nvidia-smi)")
        return "cpu", f"training on the CPU: torch sees no CUDA device: {why}"
    if not available:
        raise ValueError(f"--device {requested} was given but torch sees no CUDA device; use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if requested in (AUTO, "cuda") else int(requested.split(":")[1])
    if index >= count:
        raise ValueError(f"--device {requested}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    props = torch.cuda.get_device_properties(index)
    line = f"training on cuda:{index} ({props.name}, {props.total_memory / GIB:.1f} GiB)"
    if requested == AUTO:
        others = f"; --device cuda:N for another of its {count} GPUs" if count > 1 else ""
        line += f": torch sees a CUDA device (--device cpu to train on the CPU{others})"
    return f"cuda:{index}", line


def available_ram_bytes() -> int | None:
    """RAM this machine can give a new process without swapping (Linux's MemAvailable; else its
    free pages), or None where the OS does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def free_memory(device: str) -> tuple[int | None, str]:
    """(bytes, where) of the memory a batch is sized against: free on the GPU for ``cuda:N``,
    available RAM for ``cpu``; (None, where) if it cannot be read."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        try:
            free, _total = torch.cuda.mem_get_info(index)
        except RuntimeError:
            return None, f"on {device}"
        return int(free), f"free on {device}"
    return available_ram_bytes(), "of available RAM"


# ---- batch size -------------------------------------------------------------------------------
def memcalc_options(swarm, model, *, device_type: str, batch_size: int = 1):
    """The calculator's options for this run's optimizer and memory settings on ``device_type``,
    as the coordinator's /memcalc/ page opens on the run (``crowdtrain.coordinator.service``)."""
    from crowdtrain.memcalc import Options

    sync = swarm.mode == "sync"
    lamb = sync or swarm.inner_optimizer == "lamb8bit"
    return Options(optimizer="8bit" if lamb else "fp32", offload=bool(sync and swarm.offload_optimizer),
                   reversible=model.reversible, checkpointing=model.checkpointing, batch_size=batch_size,
                   foreach=device_type == "cuda")  # torch's AdamW takes its multi-tensor step on CUDA only


def swarm_overhead_bytes(swarm, unique_params: int) -> tuple[int, int]:
    """(on the training device, in host RAM): what the swarm's optimizer holds beside the model.

    Sync mode: hivemind's gradient accumulators (fp32, on the parameters' device), and in host
    RAM its averaged gradients and the state averager's copy of the parameters (shared memory).
    DiLoCo mode: the global parameters, the outer momentum and the pseudo-gradient buffers, in
    host RAM."""
    if swarm.mode == "sync":
        return 4 * unique_params, 8 * unique_params
    return 0, 12 * unique_params


def estimated_bytes(arch, swarm, model, *, batch_size: int, device_type: str, precision: str = "fp32") -> int:
    """Peak bytes one training step of ``batch_size`` needs in the memory the batch is sized
    against: the GPU's (what the calculator puts on the GPU, and the swarm's accumulators), or on
    a CPU everything, since the device and the host are the same RAM. Under ``precision`` bf16
    or fp16, autocast also caches a 16-bit copy of the weights for the step."""
    from crowdtrain.memcalc import estimate

    est = estimate(arch, memcalc_options(swarm, model, device_type=device_type, batch_size=batch_size))
    on_device, on_host = swarm_overhead_bytes(swarm, est.unique_params)
    if precision != "fp32":
        on_device += 2 * est.unique_params
    if device_type == "cuda":
        return est.gpu_total + on_device
    return est.gpu_total + est.cpu_total + on_device + on_host


@dataclass(frozen=True)
class BatchChoice:
    batch_size: int
    cap: int
    needs: dict[int, int]  # estimated bytes by batch size tried (powers of two up to one past the choice)
    budget_bytes: int | None  # SAFETY_FRACTION of the memory; None: unknown, not checked
    message: str  # the start-up line


def batch_cap(swarm, device_type: str) -> tuple[int, str]:
    """The largest batch ``auto`` picks (a power of two) and why."""
    caps = [(GPU_BATCH_CAP, "the most auto picks on a GPU") if device_type == "cuda" else
            (CPU_BATCH_CAP, "the most auto picks on a CPU, where larger batches are no faster per sample")]
    if swarm.mode == "diloco":
        caps.append((DILOCO_BATCH_CAP, "the most auto picks in DiLoCo mode, where the batch is an inner-optimizer "
                                       "setting"))
    caps.append((swarm.target_batch_size, f"the swarm's target batch size being {swarm.target_batch_size}"))
    limit, reason = min(caps, key=lambda c: c[0])
    return 1 << (max(1, limit).bit_length() - 1), reason


def suggest_batch_size(model, swarm, *, device_type: str, memory_bytes: int | None, memory_name: str = "",
                       precision: str = "fp32", arch=None, memcalc_url: str | None = None) -> BatchChoice:
    """The largest power of two up to :func:`batch_cap` whose :func:`estimated_bytes` fit
    :data:`SAFETY_FRACTION` of ``memory_bytes`` (None: unknown, the cap). ``memory_name`` says
    what the memory is in the start-up line ("free on cuda:0"). ``arch``: the model's
    calculator architecture when already known (default: counted from ``model``).

    A ValueError when even batch 1 does not fit, naming the fix."""
    if arch is None:
        from crowdtrain.memcalc.calibrate import model_architecture

        arch = model_architecture(model)
    cap, cap_reason = batch_cap(swarm, device_type)
    override = "--batch-size N to choose"
    gib = lambda n: f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.0f} MiB"
    needs: dict[int, int] = {}

    def need(batch: int) -> int:
        needs[batch] = estimated_bytes(arch, swarm, model, batch_size=batch, device_type=device_type,
                                       precision=precision)
        return needs[batch]

    if memory_bytes is None:
        return BatchChoice(cap, cap, needs, None, f"batch size {cap} ({cap_reason}); not checked against memory, "
                                                  f"whose size is unknown here; {override}")
    budget = int(SAFETY_FRACTION * memory_bytes)
    usable = f"{gib(budget)} ({SAFETY_FRACTION:.0%} of the {gib(memory_bytes)} {memory_name})".replace(" )", ")")
    if need(1) > budget:
        bigger = "a GPU with more memory" if device_type == "cuda" else "a machine with more free memory (or a GPU)"
        sizes = f" (sizes: {memcalc_url})" if memcalc_url else ""
        raise ValueError(f"this run's model needs about {gib(needs[1])} to train at batch size 1 (the memory "
                         f"calculator's estimate), more than the {usable} it may use: join a run with a smaller "
                         f"model, or use {bigger}{sizes}")
    batch = 1
    while batch < cap and need(2 * batch) <= budget:
        batch *= 2
    if batch == cap:
        message = (f"batch size {batch} ({cap_reason}); its estimated peak, {gib(needs[batch])}, fits {usable}; "
                   f"{override}")
    else:
        message = (f"batch size {batch}: the largest power of two whose estimated peak, {gib(needs[batch])}, fits "
                   f"{usable}; {2 * batch} would need {gib(needs[2 * batch])}; {override}")
    return BatchChoice(batch, cap, needs, budget, message)


def choose_batch(model, swarm, *, device: str, batch_size, precision: str = "fp32",
                 memcalc_url: str | None = None) -> tuple[int, str]:
    """``batch_size`` as ``crowdtrain join`` will use it on ``device`` (``cpu`` or ``cuda:N``), and
    the start-up line that says why: ``auto`` is :func:`suggest_batch_size` against the device's
    free memory."""
    if batch_size != AUTO:
        return int(batch_size), f"batch size {batch_size} (--batch-size)"
    memory, memory_name = free_memory(device)
    choice = suggest_batch_size(model, swarm, device_type=device.split(":")[0], memory_bytes=memory,
                                memory_name=memory_name, precision=precision, memcalc_url=memcalc_url)
    return choice.batch_size, choice.message


def describe_device_and_batch(coordinator: str, *, device: str = AUTO, batch_size=AUTO,
                              precision: str = "fp32", pin: str | None = None) -> str:
    """The device and batch size ``crowdtrain join COORDINATOR`` would use here, as its start-up
    lines say them (the join notebook shows them before it starts the peer). ``pin``: the
    coordinator key's fingerprint (crowdtrain.runspec.trust)."""
    from crowdtrain.runspec.trust import CoordinatorTrust
    from crowdtrain.swarm.join_info import check_join_info, check_same_protocol, fetch_json, join_url

    base = coordinator.rstrip("/")
    info = fetch_json(join_url(base), patience_s=30, trust=CoordinatorTrust(base, pin=pin))
    check_same_protocol(info, base)
    device_name, device_line = resolve_device(device)
    checked = check_join_info(info, source=base, device=device_name)
    _, batch_line = choose_batch(checked.model, checked.swarm, device=device_name, batch_size=batch_size,
                                 precision=precision, memcalc_url=f"{base}/memcalc/")
    return f"{device_line}\n{batch_line}"


# ---- torch threads ----------------------------------------------------------------------------
def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat's 22nd field); None where
    there is no /proc. With the pid it names one process: a pid reused later starts later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # The command name (field 2) is in parentheses and may hold spaces: count after its end.
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None) -> bool:
    """``pid`` runs and, where its start time was recorded and can be read, is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    except OSError:
        return False
    if start is not None:
        now = process_start_time(pid)
        if now is not None and now != start:
            return False  # the pid was reused by another process
    return True


@dataclass(frozen=True)
class Volunteer:
    pid: int
    start: int | None  # process_start_time when it registered
    threads: int | None  # its --threads; None: a fair share


class VolunteerRegistry:
    """The volunteers on this machine: one ``PID.json`` file each in ``directory``, written when a
    volunteer starts and removed when it leaves. Files of processes that have ended (a killed
    peer leaves its file) or whose pid now names another process are skipped and removed. A file
    is input from another process: anything unreadable is skipped.

    One file per process: torch's threads are per process, so several volunteers run in one
    process (tests) count once."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, pid: int) -> Path:
        return self.directory / f"{pid}.json"

    def add(self, pid: int, *, threads: int | None = None, start: int | None = -1) -> Volunteer:
        """Register ``pid`` (``start`` -1: read its start time now)."""
        entry = Volunteer(pid, process_start_time(pid) if start == -1 else start, threads)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{pid}.json.tmp"
        tmp.write_text(json.dumps({"pid": entry.pid, "start": entry.start, "threads": entry.threads}))
        tmp.replace(self.path(pid))  # readers never see half a file
        return entry

    def remove(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            self.path(pid).unlink()

    def _read(self, path: Path) -> Volunteer | None:
        try:
            d = json.loads(path.read_text())
            pid, start, threads = d["pid"], d.get("start"), d.get("threads")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ints = lambda v, low: isinstance(v, int) and not isinstance(v, bool) and v >= low
        if (not ints(pid, 1) or path.name != f"{pid}.json" or not (start is None or ints(start, 0))
                or not (threads is None or ints(threads, 1))):
            return None
        return Volunteer(pid, start, threads)

    def live(self) -> list[Volunteer]:
        """The volunteers running now; removes the files of those that are not."""
        try:
            paths = sorted(self.directory.glob("*.json"))
        except OSError:
            return []
        found = []
        for path in paths:
            entry = self._read(path)
            if entry is None:
                continue
            if pid_alive(entry.pid, entry.start):
                found.append(entry)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        return found


def fair_share(cores: int, volunteers: list[Volunteer], me: int) -> tuple[int, str]:
    """Threads for the volunteer ``me`` (without --threads) and the reason: the cores left by the
    volunteers with --threads, split evenly among the others (``me`` counted whether listed or
    not); at least 1."""
    fixed = sum(v.threads for v in volunteers if v.threads is not None and v.pid != me)
    sharing = 1 + sum(1 for v in volunteers if v.threads is None and v.pid != me)
    share = max(1, (cores - fixed) // sharing)
    if sharing == 1 and not fixed:
        return share, f"{cores} core{'s' * (cores != 1)}, no other volunteer on this machine"
    held = f" less {fixed} held by volunteers with --threads" if fixed else ""
    return share, f"{cores} core{'s' * (cores != 1)}{held} shared by {sharing} volunteer{'s' * (sharing != 1)} " \
                  "on this machine"


class TorchThreads:
    """This volunteer's torch CPU threads: ``fixed`` (--threads), or a fair share of the machine
    recomputed by :meth:`rebalance` (call it between steps, from the training thread: torch's
    thread count is the process's)."""

    def __init__(self, fixed: int | None, registry_dir: str | Path, *, cores: int | None = None,
                 pid: int | None = None, set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = REBALANCE_EVERY_S):
        self.fixed, self.registry = fixed, VolunteerRegistry(registry_dir)
        self.cores = cores or usable_cores()
        self.pid = pid or os.getpid()
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.set_threads, self.clock, self.every_s = set_threads, clock, every_s
        self.threads: int | None = None
        self.registered = False
        self.next_check = 0.0

    def _register(self) -> None:
        try:
            self.registry.add(self.pid, threads=self.fixed)
            self.registered = True
        except OSError as e:  # a read-only home: train anyway, as if alone
            if not self.registered:
                logger.warning("cannot register in %s (%s): this volunteer cannot share the cores with others on "
                               "this machine; --threads N to choose", self.registry.directory, e)

    def start(self) -> int:
        """Register, set torch's threads and say how many and why; the thread count."""
        self._register()
        if self.fixed is not None:
            self.threads = self.fixed
            self.set_threads(self.fixed)
            logger.info("%d torch thread%s (--threads)", self.fixed, "s" * (self.fixed != 1))
            return self.fixed
        self.threads, reason = fair_share(self.cores, self.registry.live(), self.pid)
        self.set_threads(self.threads)
        logger.info("%d torch thread%s: %s; --threads N to choose", self.threads, "s" * (self.threads != 1), reason)
        self.next_check = self.clock() + self.every_s
        return self.threads

    def rebalance(self) -> int | None:
        """Every ``every_s``: recount the volunteers on this machine and change torch's threads
        if this one's share changed; the new count, or None."""
        if self.fixed is not None or self.threads is None or self.clock() < self.next_check:
            return None
        self.next_check = self.clock() + self.every_s
        volunteers = self.registry.live()
        if not any(v.pid == self.pid for v in volunteers):
            self._register()  # the directory was cleared: be counted again
        threads, reason = fair_share(self.cores, volunteers, self.pid)
        if threads == self.threads:
            return None
        logger.info("torch threads %d -> %d: %s", self.threads, threads, reason)
        self.threads = threads
        self.set_threads(threads)
        return threads

    def leave(self) -> None:
        if self.registered:
            self.registry.remove(self.pid)
            self.registered = False
