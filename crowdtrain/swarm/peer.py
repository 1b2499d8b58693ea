"""A volunteer peer: join a run from its coordinator's URL and train with the swarm.

The coordinator hands out the run as data (``GET /api/join``): run id, task (model config and
data location), its architecture fingerprint, swarm settings and initial DHT peers. The peer
refuses to start if its own code would build a different model, downloads the current state
from peers, streams its data and trains until stopped (Ctrl-C leaves cleanly).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import torch

from crowdtrain.lifecycle import ChildWatch, Deadline, how_it_ended, on_signals
from crowdtrain.optim.loss_scale import LossScale
from crowdtrain.swarm.rounds import RoundSummary
from crowdtrain.swarm.volunteer_config import VolunteerConfig

logger = logging.getLogger(__name__)


def download_asset(url: str, sha256: str, cache_dir: Path) -> Path:
    """Fetch a file the run needs (the text tokenizer) into the cache, verified by hash."""
    from crowdtrain.remote import download_checked

    cache_dir.mkdir(parents=True, exist_ok=True)
    name = url.rsplit("/", 1)[-1]
    return download_checked(url, cache_dir / f"{sha256}-{name}", sha256, name=name, timeout_s=60)


def signed_files(info: dict, trust) -> dict[str, str] | None:
    """{shard URL: sha256} of the run's data as the coordinator signed it, for the stream to check
    every shard against (None: the data is not served by the coordinator, e.g. a hub data set, or
    generated). Also refuses join information whose token key is not the key that signed it."""
    from crowdtrain.runspec.trust import UntrustedCoordinator

    auth = info.get("auth") if isinstance(info.get("auth"), dict) else {}
    if trust.key is not None and auth.get("coordinator_public_key") not in (None, trust.key):
        raise UntrustedCoordinator("the join information names another token key than the one that signed it; "
                                   "not joining")
    files = info.get("files")
    data = info["task"]["data"]
    if not isinstance(files, dict) or not data.startswith(("http://", "https://")):
        return None
    shards = {name.removeprefix("shards/"): sha for name, sha in files.items()
              if isinstance(name, str) and name.startswith("shards/") and isinstance(sha, str)}
    if not shards:
        return None
    return {f"{data.rstrip('/')}/{name}": sha for name, sha in shards.items()}


def check_fingerprint(info: dict, model_config, model=None) -> None:
    """``model``: the one this peer built from ``model_config`` (see ``architecture_fingerprint``)."""
    from crowdtrain.model.info import architecture_fingerprint

    mine = architecture_fingerprint(model_config, model)
    if mine != info["fingerprint"]:
        from crowdtrain.swarm.join_info import coordinator_install_line

        install = coordinator_install_line(info)
        how = f":\n\n    {install}\n\n" if install else " "
        raise ValueError(
            f"this peer's model (fingerprint {mine}) differs from the run's ({info['fingerprint']}): "
            f"its crowdtrain builds different weights for this run's config. Install the crowdtrain the "
            f"coordinator runs{how}(and drop any model overrides), then join again")


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started inside (hivemind's DHT and averagers, and the p2p daemon they exec)
    start with SIGINT blocked; the mask survives fork and exec. Ctrl-C in a terminal signals the
    whole process group, so without this the daemon would die first and the peer could not
    leave the swarm cleanly; with it, only this process hears Ctrl-C and shuts them down."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _leave_on_signals(event: threading.Event, deadline, leave_within_s: float) -> None:
    """SIGINT, SIGTERM and SIGHUP set ``event``: the loop finishes its step and leaves cleanly,
    within ``leave_within_s`` (``deadline``, a ``crowdtrain.lifecycle.Deadline``, ends the process
    then, whatever it waits on); Ctrl-C again quits at once. Only the main thread can take
    signals: elsewhere (tests call run_volunteer in a thread) the caller's own ``stop`` event is
    the way to stop."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum):
        if not event.is_set():
            logger.info("leaving the swarm after this step (press Ctrl-C again to quit at once)")
            event.set()
        deadline.start(f"asked to leave ({signal.Signals(signum).name}) {leave_within_s:g} s ago "
                       "(join --leave-within)", leave_within_s)

    on_signals(leave, ctrl_c_again_quits=True)


def run_volunteer(config: VolunteerConfig, stop: threading.Event | None = None, info: dict | None = None,
                  trust=None) -> dict:
    """``info``: the coordinator's join information when the caller fetched it already (``crowdtrain
    join`` does, before importing torch, with ``trust`` that checked it); otherwise it is fetched
    here."""
    from crowdtrain.runspec.trust import CoordinatorTrust
    from crowdtrain.swarm.join_info import check_join_info, check_same_protocol, fetch_json, join_url

    base = config.coordinator_url.rstrip("/")
    if info is None or trust is None:
        trust = CoordinatorTrust(base, pin=config.pin)
        info = None
    # First, before seconds of imports (hivemind, bitsandbytes): a wrong address is said at once.
    # Says which crowdtrain this is: a coordinator of another protocol answers with the line that
    # installs its own, and this stops before any DHT or thread starts.
    if info is None:
        info = fetch_json(join_url(base), api_key=config.api_key, trust=trust)
    check_same_protocol(info, base)
    from crowdtrain.swarm.schedule_watch import ScheduleWatch, check_not_finished, run_schedule

    check_not_finished(info, base)  # a finished run: nothing to train, say so at once

    from crowdtrain.train.local import autocast_context
    from crowdtrain.swarm import machine

    device_name, device_line = machine.resolve_device(config.device)
    logger.info("%s", device_line)
    # All of it, before anything with threads starts (see crowdtrain.swarm.join_info), and before
    # hivemind's and bitsandbytes' imports (below): a bad config is said in half the time.
    checked = check_join_info(info, model_overrides=config.model_overrides, source=base, device=device_name)
    swarm, model_config = checked.swarm, checked.model
    verified = signed_files(info, trust)
    autocast_context(torch.device(device_name), config.precision)  # refuses a precision this device lacks
    batch_size, batch_line = machine.choose_batch(model_config, swarm, device=device_name, batch_size=config.batch_size,
                                                  precision=config.precision, memcalc_url=f"{base}/memcalc/")
    if config.batch_size == machine.AUTO:
        logger.info("%s", batch_line)
    from crowdtrain.train.task import DalleTask, build_initial_model, model_digest

    # The model this peer trains (the run's seeded initial model while the run has not moved on
    # from it), built on the CPU once its memory is known to fit: a crowdtrain that builds other
    # tensors for the run's config is refused here, before hivemind's imports and any p2p start-up.
    initial = info.get("initial_model")
    model = (build_initial_model(DalleTask(model_config), int(initial["seed"])) if initial
             else DalleTask(model_config).build_model())
    check_fingerprint(info, model_config, model)
    import hivemind

    from crowdtrain.swarm import metrics as swarm_metrics
    from crowdtrain.swarm.attacks import attack_from_fault, upload_delay_from_fault
    from crowdtrain.swarm.hivemind_seam.p2p import guard_request_pipe
    from crowdtrain.swarm.optimizer import StateUnavailable, all_finite, build_optimizer
    from crowdtrain.swarm.rounds import swarm_at_start, swarm_epoch_now
    from crowdtrain.noise import drop_exit_noise
    from crowdtrain.swarm.reconnect import BootstrapWatch, choose_bootstrap_peers

    config = copy.copy(config)  # as resolved, in the summary; the caller's stays as given
    config.device, config.batch_size = device_name, batch_size
    from crowdtrain.optim import Schedule

    # The learning-rate schedule the optimizer reads at each step; `watch` keeps it the coordinator's.
    joined_schedule = run_schedule(info, swarm)
    schedule = Schedule(warmup_epochs=joined_schedule.warmup_epochs, total_epochs=joined_schedule.total_epochs)
    watch = ScheduleWatch(base, info, schedule, api_key=config.api_key, trust=trust)
    tokenizer = None
    if info.get("text_tokenizer"):
        tokenizer = download_asset(info["text_tokenizer"]["url"], info["text_tokenizer"]["sha256"],
                                   Path(config.cache_dir).expanduser())
    from crowdtrain.data.config import StreamConfig

    task = DalleTask(model_config, data=info["task"]["data"], text_tokenizer=tokenizer,
                     stream_config=StreamConfig(outage_patience_s=config.data_outage_patience_s,
                                                shuffle_buffer=config.shuffle_buffer, verified=verified))

    device = torch.device(config.device)
    stop_event = stop or threading.Event()
    validators, signer = swarm_metrics.make_validators(swarm.run_id)
    access = _Access(config, info, swarm.run_id)
    if not info["initial_peers"]:
        access.close()
        raise ValueError(f"{base}/api/join lists no peer to join through" + (
            " for this API key" if config.api_key else "") + ": the run may be restarting; try again in a minute")
    # The identity vouches for the key that signs this peer's metrics (the coordinator drops records without).
    endorsement = swarm_metrics.endorsement(access.key, swarm.run_id, signer) if access.key is not None else {}
    summary_extra = {}

    def denied(reason: str) -> None:
        summary_extra["stopped_because"] = reason
        stop_event.set()

    # One address family for the run's first DHT peer, the one libp2p routes through (see there).
    bootstrap = choose_bootstrap_peers(info["initial_peers"], urlsplit(base).hostname)
    threads = machine.TorchThreads(config.torch_threads, Path(config.cache_dir).expanduser() / "volunteers")
    threads.start()
    threads_before, dht = set(threading.enumerate()), None
    try:
        with children_ignore_sigint():
            dht = guard_request_pipe(hivemind.DHT(
                initial_peers=bootstrap, client_mode=config.client_mode,
                host_maddrs=[f"/ip4/{config.host}/tcp/0"], record_validators=validators, start=False,
                **access.dht_kwargs()))
            dht.run_in_background(await_ready=True)
        peer_id = str(dht.peer_id)
        access.start_keeper(dht, signer, on_denied=denied)
        bootstrap_watch = BootstrapWatch(dht, bootstrap)
        bootstrap_watch.start()
        user = access.user or config.user
        maddrs = [] if config.client_mode else [str(m) for m in dht.get_visible_maddrs()]
        # Compared as built, on the CPU, before the optimizer's initializing step (as the coordinator does).
        same_start = initial is not None and model_digest(model) == initial["digest"]
        model = model.to(device)
        with children_ignore_sigint():
            optimizer = build_optimizer(dht, model, swarm, batch_size=config.batch_size,
                                        client_mode=config.client_mode, verbose=config.verbose,
                                        access_guard=access.guard, attack=attack_from_fault(config.fault),
                                        upload_delay_s=upload_delay_from_fault(config.fault),
                                        signer=signer, final_epoch=watch.final_epoch(config.max_epochs),
                                        leaving=stop_event, schedule=schedule)
    except BaseException:
        threads.leave()
        _abandon_start_up(dht, access, threads_before)
        raise
    deadline = Deadline() if stop is None else None  # a process of its own: it may end itself
    if stop is None:
        # After the optimizer exists: hivemind's averagers set SIGINT to SIG_IGN in this process
        # when they start (and never restore it), which would make Ctrl-C do nothing.
        _leave_on_signals(stop_event, deadline, config.leave_within_s)

    def child_died(name: str, process) -> None:
        # Every DHT read and every round goes through these processes: without one this peer can
        # neither train nor leave cleanly (a goodbye needs the DHT).
        reason = (f"this volunteer's {name} process (pid {process.pid}) has stopped: {how_it_ended(process.exitcode)}"
                  "; this peer cannot train without it and leaves. Join again; if memory ran out, a smaller "
                  "--batch-size")
        logger.error("%s", reason)
        summary_extra["stopped_because"], summary_extra["process_died"] = reason, name
        stop_event.set()
        if deadline is not None:
            deadline.start(reason, CHILD_DEATH_LEAVE_S)

    children = {"DHT": dht, **_averager_processes(optimizer)}
    logger.info("processes: %s", ", ".join(f"{name} pid {p.pid}" for name, p in children.items()))
    child_watch = ChildWatch(children, child_died).start()
    summary = {"peer_id": peer_id, "user": user, "config": asdict(config), "fingerprint": info["fingerprint"],
               "maddrs": maddrs,
               "epochs": [], "rounds": []}
    try:
        t_join = time.perf_counter()
        state_keeper = optimizer.state_averager
        if initial is not None and not same_start:
            logger.info("this peer's initial model differs from the run's (another torch version?); "
                        "downloading the state")
        if same_start and swarm_at_start(optimizer.tracker, state_keeper):
            # Nobody has stepped yet and our model is the run's initial one, bit for bit.
            logger.info("the swarm has not taken a step yet and this peer built the run's initial model "
                        "(digest %s): nothing to download", initial["digest"])
            summary_extra["state_download_skipped"] = True
        else:
            optimizer.load_state_from_peers()
            # The donors of the newest state may all be busy serving other newcomers (they send a
            # few states at a time, crowdtrain.swarm.hivemind_seam.state.StateUploadLimit): wait for a free one.
            give_up = time.monotonic() + swarm.load_state_give_up_s
            while ((state_keeper.states_loaded.value == 0
                    or optimizer.local_epoch < swarm_epoch_now(optimizer.tracker) - 1)
                   and not stop_event.is_set() and time.monotonic() < give_up):
                optimizer.load_state_from_peers()
        joined_epoch = optimizer.local_epoch
        logger.info("peer %s joined run %s at epoch %d (state loaded in %.1fs)", peer_id[-8:], swarm.run_id,
                    joined_epoch, time.perf_counter() - t_join)
        summary.update(joined_epoch=joined_epoch, state_load_s=time.perf_counter() - t_join)
        watch.start()
        _train_loop(task, model, optimizer, dht, signer, endorsement, swarm, config, device, stop_event, summary,
                    swarm_metrics, all_finite, autocast_context, t_join, run_end=watch, threads=threads)
    except StateUnavailable as e:
        reason = (f"{e}: the run has ended or its peers are unreachable. Leaving; see {config.coordinator_url} "
                  "and join again if the run goes on")
        summary_extra["stopped_because"] = reason
        raise ValueError(reason) from e
    finally:
        child_watch.stop()
        threads.leave()
        drop_exit_noise()
        # Finish the delayed optimizer step (local work), so what is saved is the state the swarm
        # agreed on, not one step behind; then say goodbye over the network, with a deadline:
        # after Ctrl-C in a terminal the p2p daemon has already exited and cannot answer.
        _bounded(optimizer.finish_pending_updates, 60, "the last optimizer step")
        watch.stop()
        if summary.get("run_finished"):
            # Serve the final state a little longer: the coordinator checkpoints it from the peers still here.
            _bounded(lambda: watch.wait_for_final_checkpoint(optimizer.local_epoch), 75, "waiting for the final model")
        last_record = summary.pop("_last_record", None)
        if last_record is not None:
            # The rounds finished since the last record are credited only if the coordinator
            # hears of them: say so before leaving (the record outlives us in the DHT for a minute;
            # the leaving record tells the coordinator to count this peer as gone at once).
            final = swarm_metrics.PeerMetrics(**{**last_record, **optimizer.ledger.record_fields(),
                                                 "epoch": optimizer.local_epoch, "time": time.time()})
            def publish_final():
                # At once, then waited for together: the coordinator credits from the metrics
                # record whenever it reads it, so the leaving record need not wait for it.
                try:
                    stores = [swarm_metrics.publish(dht, swarm.run_id, signer, final),
                              swarm_metrics.publish_round_counts(dht, swarm.run_id, signer,
                                                                 optimizer.ledger.round_counts(time.time())),
                              swarm_metrics.publish_leaving(dht, swarm.run_id, signer, epoch=optimizer.local_epoch)]
                    for store in stores:
                        store.result()
                except Exception as e:  # the p2p daemon already gone (Ctrl-C in a terminal)
                    logger.debug("could not store the last metrics record: %r", e)

            _bounded(publish_final, 10, "the last metrics record")
        summary.update(summary_extra)
        summary["credited_samples"], summary["credited_steps"] = optimizer.ledger.samples, optimizer.ledger.steps
        summary["credits"] = list(optimizer.ledger.entries)
        logger.info("credited on the leaderboard: %d samples in %d global steps (samples of rounds the swarm "
                    "finished without this peer are not)", optimizer.ledger.samples, optimizer.ledger.steps)
        summary["bootstrap_reconnects"] = bootstrap_watch.reconnects
        summary["rounds"] = optimizer.rounds.to_dicts()
        summary["averaging"] = optimizer.averaging_stats()
        summary["state_uploads"] = optimizer.state_averager.upload_stats()
        summary["final_epoch"] = optimizer.local_epoch
        if config.save_final:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, config.save_final)
        if config.summary_file:
            Path(config.summary_file).write_text(json.dumps(summary, indent=2))
        # Every background user of the DHT stops before the DHT does (a request in flight would hold
        # up its shutdown).
        access.close()
        bootstrap_watch.stop.set()
        bootstrap_watch.join(10)
        _bounded(optimizer.shutdown, 30, "leaving the averaging groups")
        _bounded(dht.shutdown, 15, "stopping the DHT")
        if summary.get("run_finished"):
            logger.info("%s", summary["run_finished"])
    return summary


class _Access:
    """This peer's identity, access token and guard, when the run authenticates peers (it says so in
    ``/api/join``'s ``auth``). Fails fast, before any p2p start-up, if the coordinator refuses."""

    def __init__(self, config: VolunteerConfig, info: dict, run_id: str):
        self.auth = info.get("auth")
        self.user = self.token = self.guard = self.keeper = None
        self.key = None  # the identity's private key, when the run authenticates peers
        self.temporary_identity = None
        self.identity_path = config.identity  # without auth: a fixed peer ID if given, else a fresh one
        if self.auth is None:
            if self.identity_path is not None:
                Path(self.identity_path).parent.mkdir(parents=True, exist_ok=True)
            return
        from crowdtrain.swarm.auth import (AccessDenied, AccessGuard, HttpTokenSource, SwarmAuthorizer,
                                           TokenRequestRejected, identity_path_for, load_identity, refresh_margin_s,
                                           refresh_retry_max_s)

        if self.auth["mode"] == "allowlist" and not config.api_key:
            raise ValueError("this run admits invited users only: ask its organizer for an API key "
                             "(`crowdtrain users add NAME` on the coordinator) and pass it with --key KEY")
        path = config.identity
        if path is None:
            path = self.temporary_identity = identity_path_for(config.cache_dir, run_id, config.user)
        self.identity_path = str(path)
        key = self.key = load_identity(path)
        self.source = HttpTokenSource(self.auth["token_url"], private_key=key, api_key=config.api_key,
                                      user=config.user)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.token = self.source()
                break
            except TokenRequestRejected as e:
                raise ValueError(f"{e}. This crowdtrain may not match the coordinator's: install the version "
                                 "the organizer runs") from e
            except AccessDenied as e:
                raise ValueError(f"{e}. Check --key (or ask the organizer for a new key)") from e
            except (ConnectionError, OSError) as e:  # coordinator restarting or overloaded: retry
                if time.monotonic() > deadline:
                    raise ValueError(f"could not get an access token from {self.auth['token_url']}: {e}") from e
                logger.warning("%s; retrying", e)
                time.sleep(3)
        self.user = self.token["username"]
        coordinator_key = self.auth["coordinator_public_key"].encode()
        lifetime = float(self.auth["token_lifetime_s"])
        self.lifetime = lifetime
        self.authorizer = SwarmAuthorizer(key, coordinator_key, self.source,
                                          refresh_margin_s=refresh_margin_s(lifetime),
                                          retry_max_s=refresh_retry_max_s(lifetime))
        self.guard = AccessGuard(run_id=run_id, coordinator_public_key=coordinator_key)
        self.run_id = run_id

    def dht_kwargs(self) -> dict:
        if self.auth is None:
            return {} if self.identity_path is None else {"identity_path": str(self.identity_path)}
        return {"identity_path": self.identity_path, "authorizer": self.authorizer}

    def start_keeper(self, dht, signer, *, on_denied) -> None:
        if self.auth is None:
            return
        from crowdtrain.swarm.auth import TokenKeeper

        self.keeper = TokenKeeper(dht, self.run_id, signer, self.source, lifetime_s=self.lifetime,
                                  on_denied=on_denied).start(self.token)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        if self.temporary_identity is not None:
            with contextlib.suppress(OSError):
                os.chmod(self.temporary_identity, 0o600)
                os.unlink(self.temporary_identity)


def _abandon_start_up(dht, access: "_Access", threads_before: set) -> None:
    """Undo a start-up that failed half-way (e.g. the optimizer refused a setting): stop what
    already runs, so the process can exit. A half-built hivemind optimizer is out of reach, but its
    progress tracker's thread is not; left running, it kept the interpreter from exiting."""
    from hivemind.optim.progress_tracker import ProgressTracker

    for thread in set(threading.enumerate()) - threads_before:
        if isinstance(thread, ProgressTracker):
            _bounded(thread.shutdown, 10, "stopping the progress tracker")
    access.close()
    if dht is not None:
        _bounded(dht.shutdown, 15, "stopping the DHT")


# How long a volunteer whose DHT or averager process died goes on leaving: the steps that need
# the network fail or wait on their own bounds; what is local (the summary) takes a moment.
CHILD_DEATH_LEAVE_S = 20.0


def _averager_processes(optimizer) -> dict:
    """The trainer's averagers that run as processes of their own (by role), each once."""
    import multiprocessing

    found, seen = {}, set()
    for attr, name in (("grad_averager", "gradient averager"), ("averager", "averager"),
                       ("state_averager", "state averager")):
        process = getattr(optimizer, attr, None)
        if isinstance(process, multiprocessing.Process) and id(process) not in seen and process.is_alive():
            found[name] = process
            seen.add(id(process))
    return found


def _bounded(fn, timeout_s: float, what: str) -> None:
    """Run ``fn`` but give up waiting after ``timeout_s``: leaving must never hang."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("%s did not finish within %.0fs; leaving anyway", what, timeout_s)


class Bursts:
    """One log line for a run of repeated events, not one per event: the first at once, then at
    most one every ``period_s`` with how many happened since the last line. A device that turns
    every fourth batch non-finite (or fp16 finding its loss scale) drops batches several times a
    second; the line says how often, the volunteer's log stays readable."""

    def __init__(self, period_s: float = 30.0, clock=time.monotonic):
        self.period_s, self.clock = period_s, clock
        self.unreported, self._last_line = 0, None

    def count(self) -> int | None:
        """Counts one event; the number to report now (this one included), or None: stay quiet."""
        self.unreported += 1
        now = self.clock()
        if self._last_line is not None and now - self._last_line < self.period_s:
            return None
        n, self.unreported, self._last_line = self.unreported, 0, now
        return n


def backward_checked(loss: torch.Tensor, model: torch.nn.Module, loss_scale: LossScale, all_finite) -> bool:
    """Backward of ``loss`` (scaled when ``loss_scale`` is enabled). True if the loss and every
    gradient are finite; the gradients are then unscaled, ready for the optimizer. False: the
    batch must be dropped (an fp16 overflow has halved the scale)."""
    loss_scale.scale_loss(loss).backward()
    grads = [p.grad for p in model.parameters()]
    finite = bool(torch.isfinite(loss)) and all_finite(grads)
    loss_scale.update(finite=finite)
    if finite:
        loss_scale.unscale_(grads)
    return finite


def _train_loop(task, model, optimizer, dht, signer, endorsement, swarm, config, device, stop_event, summary,
                swarm_metrics, all_finite, autocast_context, t_join, run_end=None, threads=None) -> None:
    batches = task.batches(batch_size=config.batch_size, seed_key=summary["peer_id"])
    start = time.perf_counter()
    contributed = steps = dropped = 0
    drops = Bursts()
    waited = computed = 0.0  # seconds blocked in optimizer.step / computing gradients (padding included)
    over_budget = 0  # steps whose real computation took longer than --simulated-step-s
    losses: list[float] = []
    last_report = start
    epoch_seen = optimizer.local_epoch
    first_contribution_s = None
    # fp16 gradients underflow without it; hivemind's optimizer steps copies of the parameters,
    # so the model's gradients are unscaled here, before optimizer.step (crowdtrain.optim.loss_scale).
    loss_scale = LossScale(enabled=config.precision == "fp16")
    while not stop_event.is_set():
        if run_end is not None:  # the run's end (crowdtrain.swarm.schedule_watch), moved when it is extended
            optimizer.final_epoch = run_end.final_epoch(config.max_epochs)
            if run_end.at_end(optimizer.local_epoch):
                summary["run_finished"] = run_end.finished_message(optimizer.local_epoch)
                logger.info("the swarm reached the run's last epoch (%d); leaving", optimizer.local_epoch)
                break
        if config.max_epochs is not None and optimizer.local_epoch >= config.max_epochs:
            logger.info("the swarm reached epoch %d; leaving", optimizer.local_epoch)
            break
        if config.max_minutes is not None and time.perf_counter() - start > 60 * config.max_minutes:
            break
        if threads is not None:
            threads.rebalance()  # volunteers that joined or left this machine move its share of the cores
        t_step = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        if steps == dropped == 0:
            optimizer.book_first_round(config.batch_size)  # hivemind looks at the clock after a step only
        with autocast_context(device, config.precision):
            loss = task.loss(model, batch)
        if (config.fault or "").startswith("nan-every=") and (steps + dropped + 1) % int(config.fault[10:]) == 0:
            loss = loss * float("nan")
        if not backward_checked(loss, model, loss_scale, all_finite):
            # Never send a non-finite gradient: drop this batch and go on.
            optimizer.zero_grad()
            dropped += 1
            if (n := drops.count()) is not None:
                scale = f", fp16 loss scale now {loss_scale.scale:g}" if loss_scale.enabled else ""
                logger.warning("non-finite loss or gradient (loss %s%s); dropping this batch%s", loss.item(), scale,
                               "" if n == 1 and dropped == 1 else
                               f" ({n} dropped since the last such line, {dropped} in all; a steady stream means a "
                               "faulty device or a learning rate too high)")
            continue
        if config.simulated_step_s > 0:
            # Pad the computation, not the waiting: a slower device computes longer, its network is no slower.
            over_budget += time.perf_counter() - t_step > config.simulated_step_s
            time.sleep(max(0.0, config.simulated_step_s - (time.perf_counter() - t_step)))
        t_opt = time.perf_counter()
        computed += t_opt - t_step
        optimizer.step()  # blocks only when this peer must wait for the swarm (averaging, state)
        waited += time.perf_counter() - t_opt
        optimizer.zero_grad()
        if not all_finite(list(model.parameters())):
            logger.error("parameters became non-finite; reloading the state from peers")
            optimizer.load_state_from_peers()
        steps += 1
        contributed += config.batch_size
        losses.append(loss.item())
        if first_contribution_s is None and optimizer.local_epoch > epoch_seen:
            first_contribution_s = time.perf_counter() - t_join
            summary["first_epoch_s"] = first_contribution_s
            summary["first_epoch_unix"] = time.time()
        now = time.perf_counter()
        rate = contributed / max(now - start, 1e-9)
        last_round = optimizer.last_round() or RoundSummary(epoch=0, group_size=0, swarm_peers=0)
        # One line (and one metrics record) per new epoch or every 5 s, not per step: a small
        # model steps several times a second.
        if optimizer.local_epoch != epoch_seen or now - last_report > 5:
            window = losses[-20:]
            mean_loss = sum(window) / len(window)
            logger.info("epoch %d | loss %.4f | %.1f samples/s | contributed %d | peers in last round %d/%d",
                        optimizer.local_epoch, mean_loss, rate, contributed, last_round.group_size,
                        last_round.swarm_peers)
            if optimizer.local_epoch != epoch_seen:
                summary["epochs"].append({"epoch": optimizer.local_epoch, "loss": mean_loss, "samples": contributed,
                                          "time": now - start, "unix": time.time(), "compute_s": computed,
                                          "wait_s": waited})
            record = dict(peer_id=summary["peer_id"], epoch=optimizer.local_epoch, samples=contributed,
                          samples_per_second=float(rate), loss=float(mean_loss), steps=steps, time=time.time(),
                          client_mode=config.client_mode, last_round_peers=int(last_round.group_size),
                          swarm_peers=int(last_round.swarm_peers), fingerprint=summary["fingerprint"],
                          user=summary["user"], maddrs=summary["maddrs"], **endorsement,
                          **optimizer.ledger.record_fields())
            swarm_metrics.publish(dht, swarm.run_id, signer, swarm_metrics.PeerMetrics(**record))
            swarm_metrics.publish_round_counts(dht, swarm.run_id, signer, optimizer.ledger.round_counts(time.time()))
            summary["_last_record"] = record
            epoch_seen, last_report = optimizer.local_epoch, now
    window = losses[-20:]
    logger.info("left at epoch %d: contributed %d samples in %d steps over %.1f min (%d batches dropped)%s",
                optimizer.local_epoch, contributed, steps, (time.perf_counter() - start) / 60, dropped,
                f"; loss {sum(window) / len(window):.4f}" if window else "")
    summary.update(samples=contributed, steps=steps, seconds=time.perf_counter() - start, wait_s=waited,
                   compute_s=computed, over_budget_steps=over_budget, end_unix=time.time(),
                   dropped_batches=dropped,
                   loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None)
