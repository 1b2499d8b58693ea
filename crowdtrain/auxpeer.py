"""The coordinator's auxiliary peer: first DHT peer, metrics collector, state keeper, checkpointer.

Runs as a child process of ``crowdtrain coordinator`` (the web side never imports torch). It is
the one module that joins both sides: a swarm peer (``crowdtrain.swarm``) that records what it
sees in the coordinator's database (``crowdtrain.coordinator.db``) and run folder (the files of
``crowdtrain.runspec.files``). It

1. starts the run's first DHT peer on a fixed port with a persistent identity, so volunteers
   and a restarted coordinator find each other at the same address;
2. writes ``run.json`` (what ``GET /api/join`` serves): run id, task, architecture fingerprint,
   swarm settings, initial peers;
3. collects every peer's signed metrics records into ``metrics.jsonl`` and ``status.json``;
4. every ``checkpoint_every_epochs`` downloads the newest model and optimizer state from the
   peers, measures its loss on fixed rows of each held-out split of the run's data (the
   validation loss: ``crowdtrain.train.validate.HeldOutSet``) and writes a checkpoint (the last
   ``keep_checkpoints`` are kept, and the one with the lowest validation loss);
5. serves that state to newcomers when no trainer is around, e.g. after everyone left, and on
   start resumes from the latest checkpoint;
6. keeps the schedule (``crowdtrain.runspec.schedule``): sizes a time budget's total from the
   swarm's pace, and marks the run finished when the swarm reaches the total (then writes a
   checkpoint of the last epoch while the volunteers wait for it).

    python -m crowdtrain.auxpeer RUN_DIR
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

import hivemind
import torch

from crowdtrain.checkpoint import (best_checkpoint, checkpoint_name, flatten_optimizer_state, latest_checkpoint,
                                   load_optimizer_state, prune_checkpoints, save_checkpoint, unflatten_optimizer_state)
from crowdtrain.coordinator.db import Store
from crowdtrain.lifecycle import forks_die_with_this_process, on_signals
from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P, ModelConfig
from crowdtrain.model.info import architecture_fingerprint
from crowdtrain.optim import param_groups
from crowdtrain.runspec import files
from crowdtrain.runspec.schedule import RunSchedule, ScheduleKeeper, read_schedule, write_schedule
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.runspec.tokens import CoordinatorKey
from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.swarm.auth import (AccessGuard, LocalTokenSource, SwarmAuthorizer, TokenKeeper, guarded,
                                   load_identity, refresh_margin_s, refresh_retry_max_s)
from crowdtrain.swarm.compression import PaperCompression
from crowdtrain.swarm.hivemind_seam import check_hivemind_version
from crowdtrain.swarm.hivemind_seam.p2p import guard_request_pipe
from crowdtrain.swarm.hivemind_seam.state import ConsistentStateAverager, set_state_epoch
from crowdtrain.swarm.lamb import make_lamb
from crowdtrain.swarm.optimizer import make_scheduler
from crowdtrain.swarm.reconnect import choose_bootstrap_peers, libp2p_routes_through
from crowdtrain.swarm.rounds import StateOffer
from crowdtrain.train.task import DalleTask, build_initial_model, model_digest, stable_seed
from crowdtrain.train.validate import DEFAULT_MAX_ROWS, HeldOutSet

logger = logging.getLogger(__name__)

# How long a stopping auxiliary peer waits for a checkpoint under way (main() exits hard at 20 s).
CHECKPOINT_JOIN_S = 15.0


def _is_ipv4(host: str) -> bool:
    import ipaddress

    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def download_patience(swarm: SwarmConfig) -> dict:
    """How long the checkpointer waits for a donor's first byte: as long as a volunteer's download
    does (``next_chunk_timeout_s``), not hivemind's request timeout (a few seconds). A donor in a
    round answers once the round lets go of its tensors; with epochs of seconds a round is nearly
    always running, and downloads that gave up after the request timeout left a run without a
    checkpoint for a minute."""
    return {"next_chunk_timeout": swarm.next_chunk_timeout_s}


class AuxPeer:
    def __init__(self, run_dir: Path):
        check_hivemind_version()
        self.run_dir = run_dir
        spec = json.loads((run_dir / "coordinator.json").read_text())
        self.spec = spec
        self.swarm = SwarmConfig.from_dict(spec["swarm"])
        self.model_config = ModelConfig.from_dict(spec["task"]["model"])
        self.checkpoint_dir = Path(spec["checkpoint_dir"])
        self.keep = int(spec.get("keep_checkpoints", 3))
        # The schedule the coordinator started with (crowdtrain.runspec.schedule): this peer sizes a
        # time budget's total, and marks the run finished at the total.
        schedule, problem = read_schedule(run_dir)
        if problem:
            logger.warning("%s; using the swarm settings' schedule", problem)
        self.schedule = ScheduleKeeper(schedule or RunSchedule(total_epochs=self.swarm.total_epochs,
                                                               warmup_epochs=self.swarm.warmup_epochs))
        self._final_checkpoint_try = 0.0  # monotonic: the last try at the finished run's checkpoint
        validators, self.signer = swarm_metrics.make_validators(self.swarm.run_id)
        self.refused_records = validators[0].refused
        self.store = Store(spec["db_url"])
        self.auth = spec["auth"]
        # The coordinator's own peer signs its access token with the coordinator key.
        key = load_identity(spec["identity"])
        public_key = key.get_public_key().to_bytes()
        self.token_source = LocalTokenSource(self.auth["key_path"], public_key=public_key, user="coordinator",
                                             lifetime_s=self.auth["token_lifetime_s"])
        coordinator_key = CoordinatorKey.load_or_create(self.auth["key_path"]).public_key
        lifetime = self.auth["token_lifetime_s"]
        authorizer = SwarmAuthorizer(key, coordinator_key, self.token_source,
                                     refresh_margin_s=refresh_margin_s(lifetime),
                                     retry_max_s=refresh_retry_max_s(lifetime))
        self.guard = AccessGuard(run_id=self.swarm.run_id, coordinator_public_key=coordinator_key)
        # After a restart, rejoin the swarm through the peers seen last time; alone otherwise.
        known, problem = files.read_known_peers(run_dir)
        if problem:
            logger.warning("%s", problem)
        # Each through an address libp2p routes through, as volunteers join (see choose_bootstrap_peers):
        # a connection through another would leave that volunteer unable to look up its groupmates.
        initial_peers = [m for maddrs in known.values()
                         for m in choose_bootstrap_peers(maddrs, spec.get("public_host"))]
        self.dht = self._start_dht(spec, validators, initial_peers, authorizer)
        self.keeper = TokenKeeper(self.dht, self.swarm.run_id, self.signer, self.token_source,
                                  lifetime_s=self.auth["token_lifetime_s"]).start()
        self.seed = stable_seed(self.swarm.run_id)
        self.model = build_initial_model(DalleTask(self.model_config), self.seed)
        # As built, before the optimizer's initializing step (hivemind runs one with zero gradients;
        # a volunteer's offloaded optimizer applies it to its own copy, not to the model).
        self.initial_digest = model_digest(self.model)
        compression = PaperCompression(self.swarm.compression_threshold)
        if self.swarm.mode == "diloco":  # keeps the global parameters and the outer momentum
            from crowdtrain.swarm.diloco import DiLoCoAverager

            self.averager = guarded(DiLoCoAverager, self.guard).for_model(self.dht, self.model, self.swarm,
                                                                          **download_patience(self.swarm))
        else:
            # A copy of the state for each download, so a checkpoint's download into our tensors
            # never tears a newcomer's (see crowdtrain.swarm.hivemind_seam.state).
            self.averager = guarded(ConsistentStateAverager, self.guard)(
                dht=self.dht, prefix=f"{self.swarm.run_id}_state_averager",
                optimizer=partial(make_lamb, config=self.swarm), scheduler=partial(make_scheduler, config=self.swarm),
                params=param_groups(self.model, self.swarm.weight_decay), compression=compression,
                state_compression=compression, min_matchmaking_time=self.swarm.matchmaking_time_s,
                request_timeout=self.swarm.request_timeout_s,  # below the matchmaking time, as hivemind asks
                max_state_uploads=self.swarm.max_state_uploads, allow_state_sharing=True, start=True,
                **download_patience(self.swarm))
        self.last_checkpoint_epoch = self._resume()
        self.state_trail = 0  # how many epochs the last state served trailed the swarm's (maybe_checkpoint)
        self.seen: dict[str, float] = {}
        self.round_health = swarm_metrics.RoundHealth()  # the status page's "rounds are failing"
        # Dropped records: counts by reason, the stored versions already counted (until they
        # expire), and the kinds of failure already logged (each is logged once, then counted).
        self.dropped: dict[str, int] = {}
        self._dropped_versions: dict[tuple, float] = {}
        self._logged: set = set()
        self._reported: dict[str, int] = {}  # counters as last added to the database
        self.checkpoints_written = 0
        self.samples_possible = True  # until a checkpoint shows there is no image tokenizer for the model
        self.held_out = self._held_out_set()
        self.stop = threading.Event()

    @staticmethod
    def _start_dht(spec: dict, validators: list, initial_peers: list[str], authorizer) -> hivemind.DHT:
        kwargs = dict(host_maddrs=[f"/ip4/{spec['dht_host']}/tcp/{spec['dht_port']}"], identity_path=spec["identity"],
                      record_validators=validators, authorizer=authorizer)
        public = spec.get("public_host")
        if public and _is_ipv4(public) and not libp2p_routes_through(public):
            logger.warning("--public-host %s is in a range libp2p does not route through (a documentation or "
                           "benchmarking net): volunteers joining through it will reach the coordinator but not "
                           "each other, and their rounds will not form. Use an address of a local network or a "
                           "public one", public)
        if public and public not in ("127.0.0.1", "localhost", spec["dht_host"]) and _is_ipv4(public):
            # Behind NAT (e.g. a cloud VM): announce the address volunteers can reach, not the private one.
            kwargs["announce_maddrs"] = [f"/ip4/{public}/tcp/{spec['dht_port']}"]

        def start(**more) -> hivemind.DHT:  # its request pipe guarded before its process starts
            dht = guard_request_pipe(hivemind.DHT(start=False, **kwargs, **more))
            dht.run_in_background(await_ready=True)
            return dht

        if initial_peers:
            try:
                dht = start(initial_peers=initial_peers, ensure_bootstrap_success=False)
                logger.info("rejoined the swarm through %d known peer addresses", len(initial_peers))
                return dht
            except Exception as e:  # nobody from last time is online: start the swarm anew
                logger.info("no known peer answered (%s); starting as the first peer", str(e).splitlines()[0])
        return start()

    def _resume(self) -> int:
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return 0
        from safetensors.torch import load_file

        state = load_file(path / "model.safetensors")
        self.model.load_state_dict(state)
        loaded = load_optimizer_state(path)
        if loaded is not None:
            tensors, meta = loaded
            self.averager.optimizer.load_state_dict(unflatten_optimizer_state(tensors, meta))
        epoch = int(json.loads((path / "config.json").read_text())["step"])
        set_state_epoch(self.averager, epoch)
        StateOffer(self.averager, client_mode=False).offer(epoch)
        logger.info("resumed from %s at epoch %d", path, epoch)
        return epoch

    def _held_out_set(self) -> HeldOutSet | None:
        """Fixed rows of the run's held-out splits (read at the first checkpoint, then reused), or
        None when there is nothing to measure: ``valid_rows`` 0 (``crowdtrain coordinator
        --valid-rows``) or generated data."""
        max_rows = int(self.spec.get("valid_rows", DEFAULT_MAX_ROWS))
        data = self.spec["task"].get("data")
        if max_rows < 1 or not data or data in ("pattern", "synthetic"):
            return None
        try:
            from crowdtrain.data.tokenizers import default_text_tokenizer, load_text_tokenizer

            path = (self.spec.get("text_tokenizer") or {}).get("path")
            tokenizer = load_text_tokenizer(path) if path else default_text_tokenizer()
            return HeldOutSet(data, text_tokenizer=tokenizer, model_config=self.model_config, max_rows=max_rows)
        except Exception as e:  # the run goes on without a validation loss
            logger.warning("no validation loss in this run: %r", e)
            return None

    def evaluate_held_out(self) -> tuple[dict[str, float], dict[str, int]]:
        """``({split: loss}, {split: rows})`` of the model as it is now; empty when there is nothing
        to measure or measuring failed (logged once: a checkpoint without it is still a checkpoint)."""
        if self.held_out is None:
            return {}, {}
        start = time.monotonic()
        try:
            losses, rows = self.held_out.losses(self.model)
        except Exception as e:
            self._log_once(("held-out", type(e).__name__), "held-out evaluation failed (logged once): %r", e,
                           exc_info=True)
            return {}, {}
        if losses:
            logger.info("validation loss %s (%d rows in %.1f s)",
                        ", ".join(f"{k} {v:.4f}" for k, v in losses.items()), sum(rows.values()),
                        time.monotonic() - start)
        return losses, rows

    def announce(self, *, first: bool = True) -> None:
        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]  # fixed host and port: no refresh needed
        schedule = self.schedule.state
        swarm = self.swarm.to_dict()
        if schedule.total_epochs is not None:  # for volunteers that read no schedule (older crowdtrain)
            swarm.update(total_epochs=schedule.total_epochs, warmup_epochs=schedule.warmup_epochs)
        join = files.RunInfo(
            run_id=self.swarm.run_id, fingerprint=architecture_fingerprint(self.model_config, self.model),
            swarm=swarm, task=self.spec["task"], initial_peers=maddrs, schedule=schedule.to_dict(),
            text_tokenizer=self.spec.get("text_tokenizer"),  # /api/join drops its local path
            coordinator_peer_id=str(self.dht.peer_id),
            auth={k: self.auth[k] for k in ("mode", "coordinator_public_key", "token_url", "token_lifetime_s")},
            # A run that resumed from a checkpoint has moved on from the initial model.
            initial_model=({"seed": self.seed, "digest": self.initial_digest} if self.last_checkpoint_epoch == 0
                           else None))
        files.write_json_atomic(self.run_dir / files.RUN_INFO, join.to_dict())
        if first:
            logger.info("DHT up at %s", maddrs)

    def _log_once(self, kind, message: str, *args, exc_info=None) -> None:
        """WARNING the first time for each kind of failure, DEBUG after that: a hostile peer
        repeating one bad record must not flood the log; the counters say how many there were."""
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, message, *args, exc_info=exc_info)

    def _drop(self, reason: str, detail: str, version) -> None:
        if version in self._dropped_versions:
            return
        self._dropped_versions[version] = time.time() + 3600.0  # forgotten after an hour (records live a minute)
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.store.bump(f"metrics_records_dropped_{reason}")
        self._log_once(("dropped", reason), "dropped a metrics record (%s): %s; further ones are counted at "
                       "/api/counters as metrics_records_dropped_%s", reason, detail, reason)

    def screen(self, stored: list[swarm_metrics.StoredRecord]) -> list[swarm_metrics.PeerMetrics]:
        """The records that pass :func:`crowdtrain.swarm.metrics.screen`; the rest counted and logged."""
        now = time.time()
        self._dropped_versions = {v: t for v, t in self._dropped_versions.items() if t > now}
        records, dropped = swarm_metrics.screen(stored, run_id=self.swarm.run_id, now=now,
                                                user_of=self.store.users_of_peers,
                                                floor_epoch=self.averager.local_epoch)
        for d in dropped:
            self._drop(d.reason, d.detail, d.record.version)
        return records

    def collect(self) -> list[swarm_metrics.PeerMetrics]:
        stored = swarm_metrics.fetch(self.dht, self.swarm.run_id)
        records = self.screen(stored)
        if records:
            counts = swarm_metrics.round_counts_of(
                stored, swarm_metrics.fetch_round_counts(self.dht, self.swarm.run_id), records, self.swarm.run_id)
            self.round_health.add(counts, users={r.peer_id: r.user for r in records}, now=time.time())
            self.round_health.add_groups(records, now=time.time())
        fresh = [r for r in records if self.seen.get(r.peer_id) != r.time]
        if fresh:
            files.append_metrics(self.run_dir, [r.dict() for r in fresh])
            self.seen.update({r.peer_id: r.time for r in fresh})
            try:
                self.store.record_metrics([r.dict() for r in fresh])
            except Exception:  # one at a time, so a record the database refuses cannot block the rest
                for r in fresh:
                    try:
                        self.store.record_metrics([r.dict()])
                    except Exception as e:
                        self._drop("database", f"peer {r.peer_id}: {e!r}"[:300], (r.peer_id, r.time))
        now = time.time()
        # A peer that said it is leaving is gone, though its last record lives on a minute.
        gone = swarm_metrics.leaving_peer_ids(stored, swarm_metrics.fetch_leaving(self.dht, self.swarm.run_id),
                                              self.swarm.run_id) if records else set()
        recent, live = swarm_metrics.live_records(records, now=now, gone=gone)
        reachable = {r.peer_id: r.maddrs for r in live if r.maddrs}
        if reachable:
            files.write_json_atomic(self.run_dir / files.KNOWN_PEERS, reachable)
        epoch = max([r.epoch for r in recent], default=self.averager.local_epoch)
        epoch = max(epoch, self.schedule.state.finished_epoch or 0)
        self.follow_schedule(now, epoch=epoch, training=bool(live))
        rate = sum(r.samples_per_second for r in live)
        mean_loss = sum(r.loss for r in live) / len(live) if live else None
        self.store.record_swarm_point(epoch=epoch, loss=mean_loss, active_peers=len(live), samples_per_second=rate)
        self.credit(fresh)
        # Bumped by what is new since the last turn, so the counts add up across restarts.
        self.store.add_new_counts(self._reported, {"metrics_records_refused": int(self.refused_records.value),
                                                   "averaging_requests_refused": int(self.guard.refused)})
        status = files.RunStatus(
            epoch=epoch, peers=[r.dict() for r in live], updated=time.time(),
            last_checkpoint_epoch=self.last_checkpoint_epoch, samples_per_second=rate,
            total_epochs=self.schedule.state.total_epochs or 0, target_batch_size=self.swarm.target_batch_size,
            metrics_records_refused=int(self.refused_records.value), metrics_records_dropped=self.dropped,
            finished_at=self.schedule.state.finished_at, epochs_per_second=self.schedule.epochs_per_second(now),
            rounds=self.round_health.summary())
        files.write_json_atomic(self.run_dir / files.STATUS, status.to_dict())
        return live

    def follow_schedule(self, now: float, *, epoch: int, training: bool) -> None:
        """Start a time budget's clock, size its total, mark the run finished
        (``crowdtrain.runspec.schedule.ScheduleKeeper``); a change goes to ``schedule.json`` and
        ``run.json``, where volunteers read it."""
        changes = self.schedule.observe(now, epoch=epoch, training=training)
        if changes:
            for line in changes:
                logger.info("schedule: %s", line)
            write_schedule(self.run_dir, self.schedule.state)
            self.announce(first=False)

    def maybe_final_checkpoint(self, live: list[swarm_metrics.PeerMetrics]) -> None:
        """Once the run has finished, a checkpoint of its last epoch while a volunteer still serves
        it (volunteers at the end wait a little for it before they leave)."""
        schedule = self.schedule.state
        if (not schedule.finished or not live or self.last_checkpoint_epoch >= schedule.total_epochs
                or time.monotonic() - self._final_checkpoint_try < 2.0):
            return
        self._final_checkpoint_try = time.monotonic()
        self.maybe_checkpoint(live, force=True)

    def credit(self, records: list[swarm_metrics.PeerMetrics]) -> None:
        """Credit each peer's samples that went into global steps (its signed, cumulative ledger in
        its metrics record; see ``crowdtrain.swarm.metrics.Ledger``) to the user its token was
        issued to. A round weighs a peer by the samples it accumulated, which is at most about the
        target batch: more than twice that per step is not credited (such claims are counted in
        /api/counters as credit_claims_over_step_bound)."""
        for r in records:
            if not r.session:
                continue  # a peer from before ledgers: nothing it reports can be credited exactly
            try:
                done = self.store.record_credit(peer_id=r.peer_id, session=r.session, samples=r.credited_samples,
                                                steps=r.credited_steps, epoch=max(0, r.epoch - 1),
                                                samples_per_second=r.samples_per_second,
                                                max_samples_per_step=2 * self.swarm.target_batch_size)
            except Exception as e:
                self._log_once("contribution", "could not credit peer %s: %r", r.peer_id, e)
                continue
            if done["clamped"]:
                self.store.bump("credit_claims_over_step_bound")
                self._log_once(("clamped", r.peer_id), "peer %s claims %d samples more than its %d step(s) "
                               "can hold; not credited", r.peer_id, done["clamped"], r.credited_steps)

    def maybe_checkpoint(self, live: list[swarm_metrics.PeerMetrics], *, force: bool = False) -> None:
        """Download the swarm's state and checkpoint it, every ``checkpoint_every_epochs`` epochs of
        the states served. A state served is labelled with the epoch of its parameters, which
        trails the epoch the volunteers report while their update is in flight (one epoch, in runs
        of short epochs): due is counted in served epochs, with the trail the last download showed,
        or a run checkpointing every 2 epochs would checkpoint (and download, and evaluate) at
        every epoch."""
        swarm_epoch = max([r.epoch for r in live], default=0)
        due = swarm_epoch - self.state_trail >= self.last_checkpoint_epoch + self.swarm.checkpoint_every_epochs
        if not live or not (due or force):
            return
        loaded_before = self.averager.states_loaded.value  # counted by the downloader (StateUploadLimit)
        try:
            self.averager.load_state_from_peers(timeout=self.swarm.load_state_timeout_s)
        except Exception as e:  # a peer left mid-download: try again next time
            logger.warning("could not download state for a checkpoint: %r", e)
            return
        epoch = self.averager.local_epoch
        if self.averager.states_loaded.value == loaded_before:
            # Nobody served a state (none offered one yet, or its donors were all busy): tried again
            # at the next refresh, and said once, so a run without checkpoints shows why.
            self._log_once("no checkpoint state", "no peer served its state for a checkpoint while the swarm is at "
                           "epoch %d (none offers one yet, or all are busy uploading); retrying (logged once)",
                           swarm_epoch)
            return
        self.state_trail = max(0, swarm_epoch - epoch)
        if self.last_checkpoint_epoch < epoch < self.last_checkpoint_epoch + self.swarm.checkpoint_every_epochs \
                and not force:
            return  # the state trailed more than the last one did: due again when the swarm is further on
        if epoch <= self.last_checkpoint_epoch:
            # Saved already. A finished run's last checkpoint (force) asks again until the last
            # epoch's state is served: the volunteers' final update may hold it for a while.
            if not force:
                self._log_once("stale checkpoint state", "the state downloaded for a checkpoint is at epoch %d, not "
                               "past the last checkpoint's %d, while the swarm is at %d; retrying (logged once)",
                               epoch, self.last_checkpoint_epoch, swarm_epoch)
            return
        StateOffer(self.averager, client_mode=False).offer(epoch)
        valid_loss, valid_rows = self.evaluate_held_out()
        tensors, meta = flatten_optimizer_state(self.averager.optimizer.state_dict())
        mean_loss = sum(r.loss for r in live) / len(live)
        path = save_checkpoint(self.checkpoint_dir / checkpoint_name(epoch), self.model, step=epoch, loss=mean_loss,
                               run_config={"task": self.spec["task"], "swarm": self.swarm.to_dict()},
                               optimizer_state=tensors, optimizer_meta=meta, assets=self.spec.get("assets"),
                               valid_loss=valid_loss, valid_rows=valid_rows)
        self.record_checkpoint(path, epoch=epoch, train_loss=mean_loss, valid_loss=valid_loss, valid_rows=valid_rows,
                               live=live)
        self.last_checkpoint_epoch = epoch
        self.checkpoints_written += 1
        logger.info("checkpoint at epoch %d: %s (mean loss %.4f)", epoch, path, mean_loss)
        every = self.spec.get("samples_every_checkpoints", 1)
        if every and self.samples_possible and self.checkpoints_written % every == 0:
            self.make_samples(path, epoch)

    def record_checkpoint(self, path: Path, *, epoch: int, train_loss: float, valid_loss: dict, valid_rows: dict,
                          live: list[swarm_metrics.PeerMetrics]) -> None:
        """Prune (the newest ``keep`` and the best by validation loss stay) and record a written
        checkpoint: its row, the best mark, and a history point carrying both losses."""
        prune_checkpoints(self.checkpoint_dir, self.keep, keep_best=True)
        self.store.record_checkpoint(name=path.name, epoch=epoch, loss=train_loss,
                                     files=sorted(p.name for p in path.iterdir()), valid_loss=valid_loss,
                                     valid_rows=valid_rows)
        self.store.mark_pruned([p.name for p in self.checkpoint_dir.glob("step-*")])
        best = best_checkpoint(self.checkpoint_dir)
        self.store.mark_best(best.name if best is not None else None)
        if valid_loss:
            self.store.record_swarm_point(epoch=epoch, loss=train_loss, active_peers=len(live),
                                          samples_per_second=sum(r.samples_per_second for r in live),
                                          valid_loss=valid_loss)

    def make_samples(self, checkpoint: Path, epoch: int, per_prompt: int = 4) -> None:
        """Images for the run's sample prompts from this checkpoint (crowdtrain.data.sample_prompts),
        for the gallery: one PNG per prompt, its real image first where the prompt is a caption of
        the data, and ``prompts.json`` saying which file is which prompt."""
        try:
            from PIL import Image

            from crowdtrain.data.generate import Generator, TokenizerMismatch, make_grid
            from crowdtrain.data.sample_prompts import reference_codes, shapes_prompts

            # A spec written before runs had their own prompts: the shapes run it was.
            prompts = self.spec.get("sample_prompts")
            prompts = shapes_prompts() if prompts is None else prompts
            if not prompts:
                self.samples_possible = False
                logger.info("no sample images for this run: it has no sample prompts")
                return
            try:
                gen = Generator.from_checkpoint(checkpoint)
            except TokenizerMismatch as e:  # e.g. a run on pattern data: no image tokenizer to decode with
                self.samples_possible = False
                logger.info("no sample images for this run: %s", e)
                return
            folder = self.run_dir / "samples" / checkpoint.name
            folder.mkdir(parents=True, exist_ok=True)
            index = []
            for i, p in enumerate(prompts):
                images = gen.sample(p["prompt"], per_prompt, top_k=DEFAULT_TOP_K, top_p=DEFAULT_TOP_P,
                                    temperature=1.0, seed=i)[1]
                reference = reference_codes(p.get("reference"), gen.model.config)
                if reference is not None:
                    real = gen.image_tokenizer.decode(reference.to(gen.device)).cpu().clone()
                    for edge in (real[:, 0], real[:, -1], real[:, :, 0], real[:, :, -1]):
                        edge[:] = torch.tensor([70, 70, 70], dtype=real.dtype)  # a frame: the real one
                    images = torch.cat([real, images])
                grid = make_grid(images, columns=len(images))
                grid = grid.resize((grid.width * 3, grid.height * 3), Image.NEAREST)
                path = folder / f"{i}.png"
                grid.save(path)
                index.append({"file": path.name, "prompt": p["prompt"], "tag": p.get("tag"),
                              "first_is_real_image": reference is not None})
            (folder / "prompts.json").write_text(json.dumps(index, indent=1))
            # Listed on /samples only now: a checkpoint shows when all its images exist.
            for entry in index:
                self.store.record_sample(checkpoint=checkpoint.name, epoch=epoch, prompt=entry["prompt"],
                                         path=str((folder / entry["file"]).relative_to(self.run_dir)),
                                         tag=entry["tag"], reference=entry["first_is_real_image"])
            logger.info("samples for %s written to %s", checkpoint.name, folder)
        except Exception as e:  # samples are a nicety: never let them stop the checkpointer
            logger.warning("could not make samples for %s: %r", checkpoint, e)

    def run(self, refresh_s: float | None = None) -> None:
        """Collect every ``refresh_s`` in this thread, checkpoint in another. A checkpoint (a state
        download, the held-out evaluation, the sample images) takes seconds on the tiny model and
        minutes on a large one; collecting waits for none of it, so the status, the leaderboard and
        the records of leaving peers (which live a minute in the DHT) stay current meanwhile.
        ``refresh_s`` defaults to the coordinator's ``--collect-every-s``."""
        if refresh_s is None:
            refresh_s = float(self.spec.get("collect_every_s", 2.0))
        self.announce()
        logger.info("reading the volunteers' records every %g s", refresh_s)
        self._live: list[swarm_metrics.PeerMetrics] | None = None
        self._collected = threading.Event()
        checkpointer = threading.Thread(target=self._checkpoint_loop, args=(refresh_s,), name="checkpointer",
                                        daemon=True)
        checkpointer.start()
        while not self.stop.is_set():
            try:
                self._live = self.collect()
                self._collected.set()
            except Exception as e:
                # This process is the run's first DHT peer: volunteers join through it, so nothing a
                # peer stores (or a database hiccup) may end it. Retried at the next refresh.
                self._loop_failed("collecting metrics", refresh_s, e)
            self.stop.wait(refresh_s)
        self._collected.set()
        # A checkpoint under way finishes first (its files are written whole); main()'s deadline
        # bounds a download that hangs.
        checkpointer.join(CHECKPOINT_JOIN_S)
        if checkpointer.is_alive():
            logger.warning("a checkpoint still runs after %.0f s; stopping without it", CHECKPOINT_JOIN_S)
        self.shutdown()

    def _checkpoint_loop(self, refresh_s: float) -> None:
        """Checkpoint when due, on the newest records the collector saw (each turn waits for a
        fresh collection, so a turn never acts on records older than one refresh)."""
        while not self.stop.is_set():
            self._collected.wait(refresh_s)
            self._collected.clear()
            live = self._live
            if live is None or self.stop.is_set():
                continue
            try:
                self.maybe_checkpoint(live)
                self.maybe_final_checkpoint(live)
            except Exception as e:
                self._loop_failed("checkpointing", refresh_s, e)

    def _loop_failed(self, what: str, refresh_s: float, e: Exception) -> None:
        self._log_once(("loop", what, type(e).__name__, str(e)[:200]), "%s failed (retrying every %.0f s; logged "
                       "once): %r", what, refresh_s, e, exc_info=True)
        with contextlib.suppress(Exception):  # the database may be what failed
            self.store.bump("aux_peer_errors")

    def shutdown(self) -> None:
        logger.info("stopping")
        self.keeper.stop()
        self.averager.shutdown()
        self.dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s aux: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)  # the aux peer does no heavy compute; leave the cores to trainers
    run_dir = Path(argv[0])
    # A restarted coordinator ends a leftover of ours; it and the tests read this file while it is
    # written, so it is renamed into place whole.
    files.write_text_atomic(run_dir / "aux.pid", str(os.getpid()))
    forks_die_with_this_process()  # the DHT and averager processes, even if this one is killed
    peer = AuxPeer(run_dir)

    def stop(signum: int) -> None:
        # Leave at the next loop turn; if a long call (a state download) blocks it, go anyway.
        if peer.stop.is_set():
            return  # the first signal's deadline runs
        peer.stop.set()
        deadline = threading.Timer(20.0, lambda: os._exit(0))
        deadline.daemon = True  # a clean stop exits at once, without waiting for it
        deadline.start()

    on_signals(stop)  # not in the handler itself: it sets an event the main loop waits on
    try:
        peer.run()
    finally:
        pid_file = run_dir / "aux.pid"
        with contextlib.suppress(OSError, ValueError):
            if int(pid_file.read_text()) == os.getpid():  # not a newer aux peer's
                pid_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
