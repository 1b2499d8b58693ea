"""The one place crowdtrain depends on hivemind's internals.

hivemind is pinned exactly (``HIVEMIND_VERSION``, pyproject.toml). Every override, copy and patch
of a hivemind internal lives in this package and is an entry of :data:`SEAMS`: what of ours
(``ours``), the upstream code it replaces or relies on (``upstream``), why, the canary test that
fails when an upgrade changes what it relies on, and a digest of the upstream source it was written
against. Outside this package no crowdtrain module touches a ``_`` name of hivemind
(tests/test_hivemind_seam.py checks both).

Upgrading hivemind: bump the pin, run ``pytest tests/test_hivemind_seam.py``. Each entry whose
upstream code changed is listed with its ``why`` and canary; re-read the upstream change, adapt
``ours``, run the canary, then record the new digest (``python -m crowdtrain.swarm.hivemind_seam``
prints them). Entries with an ``upstream_fix`` are plain hivemind bug fixes, written so they could
be sent upstream as they are (docs/hivemind-fixes.md); once hivemind has one, delete ours.

The modules: ``averaging`` (the all-reduce: robust reducer, results as values, byte counting,
matchmaking fixes), ``state`` (serving and downloading the training state), ``optimizer``
(hivemind.Optimizer's internal steps as hooks, the suspect-aware progress tracker), ``p2p``
(auth token, dialing, RPC handler wrapping, the decoder table), ``records`` (the layouts of the
DHT records crowdtrain reads: state offers, progress records).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

HIVEMIND_VERSION = "1.1.12"


@dataclass(frozen=True)
class Seam:
    ours: str  # "module:qualname" of our code (in this package unless kind is "public-override")
    upstream: str  # "module:qualname" of the hivemind code replaced or relied on
    kind: str  # override | copy | patch | private-read | layout | public-override
    why: str
    canary: str  # "tests/file.py::test_name": fails when an upgrade breaks what ``ours`` relies on
    digest: str  # upstream_digest(upstream) in hivemind HIVEMIND_VERSION
    upstream_fix: str = ""  # a plain hivemind bug fix: what to send upstream


KINDS = ("override", "copy", "patch", "private-read", "layout", "public-override")

_A, _S, _O, _P, _R = (f"crowdtrain.swarm.hivemind_seam.{m}"
                      for m in ("averaging", "state", "optimizer", "p2p", "records"))
_ROBUST = "tests/test_robust.py::"
_CATCH = "tests/test_catch_up.py::"

SEAMS: tuple[Seam, ...] = (
    # -- the all-reduce (averaging.py)
    Seam(f"{_A}:RobustTensorPartReducer.check_current_part_finished",
         "hivemind.averaging.partition:TensorPartReducer.check_current_part_finished", "copy",
         "hand one slice's parts to crowdtrain.swarm.robust.combine_slice instead of returning the running sum",
         _ROBUST + "test_the_reducer_drops_non_finite_parts_and_zero_weights_whatever_the_rule", "ec9b059c42f3ca27"),
    Seam(f"{_A}:RobustTensorPartReducer.reset_accumulators",
         "hivemind.averaging.partition:TensorPartReducer.reset_accumulators", "override",
         "a collector of the parts stands in for the running sum",
         _ROBUST + "test_the_reducer_drops_non_finite_parts_and_zero_weights_whatever_the_rule", "5d3dc36f344a342e"),
    Seam(f"{_A}:RobustTensorPartReducer.accumulate_part",
         "hivemind.averaging.partition:TensorPartReducer.accumulate_part", "override",
         "relies on upstream calling accumulator.add_(part, alpha=weight) once per sender: the collector "
         "learns each part's sender from it",
         _ROBUST + "test_the_reducer_leaves_out_suspects_parts_while_the_others_are_a_majority_and_still_judges_them",
         "1d64a8bd77052ac4"),
    Seam(f"{_A}:RobustAllReduceRunner.__init__", "hivemind.averaging.allreduce:AllReduceRunner.__init__", "override",
         "replaces the runner's tensor_part_reducer after construction and sets tensor_part_container.return_deltas "
         "(results as values)",
         _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "597a0c8dbbeabbe3"),
    Seam(f"{_A}:RobustAllReduceRunner._keep_fallback_on_failure",
         "hivemind.averaging.partition:TensorPartContainer.register_failed_reducer", "patch",
         "per instance: an attacker keeps its honest slice where a reducer failed (reads the container's "
         "_outputs_registered_by_peer and _input_parts_by_peer)",
         _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "89b41b9d7f225968"),
    Seam(f"{_A}:RobustAllReduceRunner._communicate_with_peer",
         "hivemind.averaging.allreduce:AllReduceRunner._communicate_with_peer", "override",
         "with results as values, our own slice goes through the same encoded message the others get, so every "
         "peer holds the same bits",
         _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "d910885e9727ed48"),
    Seam(f"{_A}:RobustAllReduceRunner._generate_input_for_peer",
         "hivemind.averaging.allreduce:AllReduceRunner._generate_input_for_peer", "override",
         "counts the bytes sent", _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "c91d3343d3e60faf"),
    Seam(f"{_A}:RobustAllReduceRunner._accumulate_parts_streaming",
         "hivemind.averaging.allreduce:AllReduceRunner._accumulate_parts_streaming", "copy",
         "replies with the result itself (encoded once for all senders) when results are values; counts bytes",
         _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "6c5a3c7266060303",
         upstream_fix="encode a reply once per part, not once per sender, where the reply is the same for all"),
    Seam(f"{_A}:RobustAveragerMixin.rpc_aggregate_part",
         "hivemind.averaging.averager:DecentralizedAverager.rpc_aggregate_part", "override",
         "a part for a group we joined but have not started yet waits for it instead of being refused",
         _ROBUST + "test_a_part_for_a_group_we_have_not_started_yet_waits_for_it_instead_of_being_refused",
         "06ad9597d5884df8",
         upstream_fix="rpc_aggregate_part: wait (up to next_chunk_timeout) for a pre-scheduled group to be "
                      "registered; the event it waits on is set again by the previous round's end"),
    Seam(f"{_A}:RobustAveragerMixin._run_allreduce_inplace_",
         "hivemind.averaging.averager:DecentralizedAverager._run_allreduce_inplace_", "copy",
         "the robust runner, the attack hook (tests), verdicts on senders, and the state-updated event once a "
         "round instead of once per tensor",
         _ROBUST + "test_a_round_re_declares_a_state_donor_once_not_once_per_tensor", "914d57cffc7d69e1",
         upstream_fix="set _state_updated once after the round, not after every averaged tensor (each set "
                      "re-declares the averager in the DHT: ~50 stores a round)"),
    Seam(f"{_A}:RobustAveragerMixin._matchmaking", "hivemind.averaging.averager:DecentralizedAverager._run_internal",
         "patch",
         "intercepts the assignment of _matchmaking in the averager's process to throttle its group-key reads",
         _ROBUST + "test_an_averager_looking_for_a_group_reads_the_dht_a_few_times_a_second_not_fifty",
         "8f85686e1ccd3eb0"),
    Seam(f"{_A}:throttle_group_lookups", "hivemind.averaging.matchmaking:PotentialLeaders.pop_next_leader", "patch",
         "per instance: GroupKeyManager.get_averagers spaced out; upstream re-reads the key as soon as a read "
         "returns (~50 reads a second per averager)",
         _ROBUST + "test_an_averager_looking_for_a_group_reads_the_dht_a_few_times_a_second_not_fifty",
         "802ac9db091629d4",
         upstream_fix="PotentialLeaders: space out group-key reads while no better leader is known"),
    Seam(f"{_A}:robust_averager_class", "hivemind.p2p.servicer:ServicerBase._collect_rpc_handlers", "layout",
         "RPC protocol names follow the servicer's class name: our subclasses keep hivemind's name",
         _ROBUST + "test_butterfly_all_reduce_with_an_attacker_gives_every_peer_the_same_robust_result",
         "c6b0a7a27a95cf06"),
    # -- the training state (state.py)
    Seam(f"{_S}:StateUploadLimit._load_state_from_peers",
         "hivemind.averaging.averager:DecentralizedAverager._load_state_from_peers", "copy",
         "a busy donor of the newest epoch means 'ask again', not 'take an older state'; ties broken at random",
         "tests/test_state_uploads.py::test_a_busy_donor_turns_the_second_newcomer_away_and_it_does_not_take_the_old_checkpoint",
         "fe7b419d01ced5fe",
         upstream_fix="_load_state_from_peers: when a donor of the newest epoch sent nothing (busy), return "
                      "nothing rather than a state from an older epoch; break ties between donors at random"),
    Seam(f"{_S}:StateUploadLimit.download_state",
         "hivemind.averaging.averager:DecentralizedAverager.load_state_from_peers", "copy",
         "sends the downloader in the averager's process (through _outer_pipe) a min_epoch: donors of older "
         "states are not asked",
         "tests/test_state_uploads.py::test_a_downloader_that_needs_a_newer_epoch_never_fetches_an_older_state",
         "973fae40a3d1e16f"),
    Seam(f"{_S}:StateUploadLimit.rpc_download_state",
         "hivemind.averaging.averager:DecentralizedAverager.rpc_download_state", "override",
         "relies on an empty stream meaning 'next donor' to the downloader",
         "tests/test_state_uploads.py::test_a_busy_donor_turns_the_second_newcomer_away_and_it_does_not_take_the_old_checkpoint",
         "fd2f6f19e7d247af"),
    Seam(f"{_R}:progress_records", "hivemind.optim.progress_tracker:LocalTrainingProgress", "layout",
         "the fields of a peer's progress record (peer_id, epoch, samples_accumulated, samples_per_second)",
         _CATCH + "test_after_a_long_download_the_epoch_check_reads_the_swarm_afresh", "493562e9fef573b5"),
    Seam(f"{_R}:state_offers_key",
         "hivemind.averaging.averager:DecentralizedAverager._declare_for_download_periodically", "layout",
         "the DHT key of state offers ('{prefix}.all_averagers', peer ID -> priority)",
         _CATCH + "test_a_peer_left_out_of_a_round_ranks_its_state_below_the_groups_at_once", "23ae6db0d205bcaf"),
    Seam(f"{_S}:ConsistentStateAverager.step", "hivemind.optim.state_averager:TrainingStateAverager.step", "override",
         "marks the start of a delayed update (the epoch is incremented before the step lands)",
         _CATCH + "test_a_peer_mid_update_serves_a_copy_never_last_epochs_parameters_as_this_epochs", "c68d9335d0ccf55e"),
    Seam(f"{_S}:ConsistentStateAverager._do", "hivemind.optim.state_averager:TrainingStateAverager._do", "override",
         "marks the end of the background (delayed) update, also when it failed",
         _CATCH + "test_a_peer_mid_update_serves_a_copy_never_last_epochs_parameters_as_this_epochs", "0b1896170cc6bdb0"),
    Seam(f"{_S}:ConsistentStateAverager.get_current_state",
         "hivemind.optim.state_averager:TrainingStateAverager.get_current_state", "copy",
         "serve a copy taken under the optimizer's lock, labelled with the epoch its parameters belong to",
         _CATCH + "test_a_peer_mid_update_serves_a_copy_never_last_epochs_parameters_as_this_epochs",
         "d2ee431a0a4b4074",
         upstream_fix="get_current_state: copy under lock_optimizer and label the state with the epoch of the "
                      "parameters, not the already-incremented epoch of a delayed update"),
    Seam(f"{_S}:set_state_epoch", "hivemind.optim.state_averager:TrainingStateAverager._update_scheduler",
         "private-read", "a state keeper that never steps moves its scheduler to a new epoch",
         "tests/test_hivemind_seam.py::test_a_state_keeper_labelled_with_an_epoch_moves_its_scheduler_there", "9b8de2a7b6020122"),
    # -- hivemind.Optimizer (optimizer.py)
    Seam(f"{_O}:OptimizerSeam._update_global_epoch", "hivemind.optim.optimizer:Optimizer._update_global_epoch",
         "override", "hook around_global_epoch_update: lone-step check, no state round into a peer's last epoch",
         _CATCH + "test_the_step_into_a_peers_last_epoch_does_not_average_state", "03a36523a3fce65e"),
    Seam(f"{_O}:OptimizerSeam._begin_averaging_gradients",
         "hivemind.optim.optimizer:Optimizer._begin_averaging_gradients", "override",
         "hook around_gradient_round_start: credits a lone peer's step in its ledger",
         "tests/test_swarm.py::test_a_round_credits_the_peers_weight_only_when_its_gradients_went_into_a_step",
         "f17d8bb258a0c551"),
    Seam(f"{_O}:OptimizerSeam._maybe_schedule_gradient_averaging",
         "hivemind.optim.optimizer:Optimizer._maybe_schedule_gradient_averaging", "override",
         "book the gradient round a step plus the matchmaking time ahead, at the epoch's estimated end",
         "tests/test_round_booking.py::test_a_peer_with_steps_longer_than_matchmaking_books_the_round_at_the_epochs_end",
         "868f8c36bdaa41e6",
         upstream_fix="pre-schedule the gradient round one local step plus matchmaking_time ahead (a peer looks "
                      "only between steps) and pass the computed ETA as scheduled_time (it was computed, then "
                      "unused)"),
    Seam(f"{_O}:OptimizerSeam._maybe_schedule_state_averaging",
         "hivemind.optim.optimizer:Optimizer._maybe_schedule_state_averaging", "override",
         "hook around_state_round_scheduling: none before a peer's last epoch",
         _CATCH + "test_the_step_into_a_peers_last_epoch_does_not_average_state", "f6ba5e5eab04f4eb"),
    Seam(f"{_O}:OptimizerSeam._average_gradients_and_load_into_optimizer",
         "hivemind.optim.optimizer:Optimizer._average_gradients_and_load_into_optimizer", "override",
         "hook around_gradient_round: left-out and partial-round detection, round records, the ledger",
         _CATCH + "test_a_peer_left_out_of_a_round_stops_waiting_and_downloads_the_groups_state", "d95bb5ebc061749e"),
    Seam(f"{_O}:OptimizerSeam._should_load_state_from_peers",
         "hivemind.optim.optimizer:Optimizer._should_load_state_from_peers", "override",
         "hook should_catch_up: a peer whose round went on without it downloads the group's state",
         _CATCH + "test_a_peer_given_part_of_the_average_downloads_if_a_groupmate_got_all_of_it", "e1af5bdfc8e60b70"),
    Seam(f"{_O}:OptimizerSeam._make_progress_tracker", "hivemind.optim.optimizer:Optimizer._make_progress_tracker",
         "override", "the suspect-aware tracker",
         _ROBUST + "test_the_gradient_averager_gets_the_runs_matchmaking_options", "a3fe70a367d732d6"),
    Seam(f"{_O}:OptimizerSeam._make_gradient_averager", "hivemind.optim.optimizer:Optimizer._make_gradient_averager",
         "override", "the robust class, no state offers, and averager_opts that upstream gives the state averager only",
         _ROBUST + "test_the_gradient_averager_gets_the_runs_matchmaking_options", "b9a4450197c1e6fb",
         upstream_fix="pass averager_opts (request_timeout, min_group_size) to the gradient averager too"),
    Seam(f"{_O}:OptimizerSeam._make_state_averager", "hivemind.optim.optimizer:Optimizer._make_state_averager", "copy",
         "the robust, guarded, consistent state averager with the upload limit",
         _CATCH + "test_a_peer_mid_update_serves_a_copy_never_last_epochs_parameters_as_this_epochs", "59a43eff001c3284"),
    Seam(f"{_O}:SuspectAwareProgressTracker.shutdown", "hivemind.optim.progress_tracker:ProgressTracker.shutdown",
         "copy", "waits (bounded) for the store that erases this peer's progress record before the DHT stops",
         _ROBUST + "test_a_leaving_peers_progress_record_is_erased_before_its_dht_stops", "56a92c00f0cd5010",
         upstream_fix="ProgressTracker.shutdown: wait, up to its timeout, for the store that erases the peer's "
                      "progress record (it was sent and not awaited; a DHT stopped right after dropped it)"),
    Seam(f"{_O}:SuspectAwareProgressTracker._parse_swarm_progress_data",
         "hivemind.optim.progress_tracker:ProgressTracker._parse_swarm_progress_data", "override",
         "a suspect's samples do not count toward the target batch, and a stale record (a peer in a round or a "
         "download) is not extrapolated as if it were computing",
         _ROBUST + "test_the_progress_tracker_does_not_count_a_suspects_samples_toward_the_target", "1b5ad87469d3c13f"),
    Seam(f"{_O}:OptimizerSeam.load_state_from_peers",
         "hivemind.optim.optimizer:Optimizer.load_state_from_peers", "public-override",
         "through the around_catch_up hook, sync mode's catch-up (SwarmOptimizer.load_state_from_peers): bounded "
         "by give_up_s, the state only (not the gradient buffers), relabelled only with a state",
         _CATCH + "test_catching_up_downloads_the_state_once_not_the_gradient_buffers_too", "87030a961ecf8f7f",
         upstream_fix="load_state_from_peers: do not download the gradient averager's accumulators (fp32, "
                      "uncompressed), which are zeroed right after"),
    Seam("crowdtrain.swarm.diloco:DiLoCoAverager.get_current_state",
         "hivemind.averaging.averager:DecentralizedAverager.get_current_state", "public-override",
         "the outer state (global parameters, momentum, epoch) under its lock",
         "tests/test_diloco.py::test_diloco_three_peers_train_agree_after_every_sync_and_a_newcomer_catches_up",
         "e40a50069c2b4868"),
    Seam("crowdtrain.swarm.diloco:DiLoCoAverager.load_state_from_peers",
         "hivemind.averaging.averager:DecentralizedAverager.load_state_from_peers", "public-override",
         "checks the kind and shapes of a downloaded outer state before taking it (downloaded through "
         "StateUploadLimit.download_state)",
         "tests/test_diloco.py::test_diloco_three_peers_train_agree_after_every_sync_and_a_newcomer_catches_up",
         "973fae40a3d1e16f"),
    # -- p2p, auth, wire (p2p.py)
    Seam(f"{_P}:rsa_key_from_der", "hivemind.utils.crypto:RSAPrivateKey.__setstate__", "private-read",
         "a peer signs with its libp2p identity's key: built through the unpickling state ({'_private_key': DER})",
         "tests/test_auth.py::test_the_peer_id_follows_from_the_public_key_in_the_token", "bdf8b31594bf2615"),
    Seam(f"{_P}:current_token", "hivemind.utils.auth:TokenAuthorizerBase.refresh_token_if_needed", "private-read",
         "the token held now (_local_access_token), kept while a refresh fails",
         "tests/test_auth.py::test_a_failing_refresh_keeps_the_live_token_and_backs_off_instead_of_flooding_the_coordinator",
         "7df50e54aed10d87"),
    Seam(f"{_P}:dial", "hivemind.p2p.p2p_daemon_bindings.p2pclient:Client.connect", "private-read",
         "dial a restarted bootstrap peer through the daemon client (P2P._client); no public call",
         "tests/test_reconnect.py::test_a_peer_whose_daemon_never_had_the_address_dials_it", "4a93e314e2e3640a"),
    Seam(f"{_P}:probe", "hivemind.p2p.p2p_daemon_bindings.p2pclient:Client.stream_open", "private-read",
         "asks the p2p daemon (P2P._client) to open a stream to a peer by ID, as matchmaking does, to tell an "
         "unreachable groupmate (its error) from one that answers",
         "tests/test_fresh_runs.py::test_volunteers_bootstrapped_through_the_chosen_address_can_dial_each_other_and_"
         "through_an_unroutable_one_cannot", "08c702707d91836c"),
    Seam(f"{_P}:with_wrapped_handlers", "hivemind.p2p.servicer:ServicerBase._collect_rpc_handlers", "private-read",
         "registers an averager's RPC handlers through a wrapper that checks access tokens",
         "tests/test_auth.py::test_the_averaging_guard_admits_token_holders_and_refuses_the_rest", "c6b0a7a27a95cf06"),
    Seam(f"{_P}:guard_request_pipe", "hivemind.dht.dht:DHT.run", "patch",
         "per instance, before the DHT process starts: its request pipe (_inner_pipe) raises an OSError, which "
         "run's loop survives, where a request's sender exited while its reply pipe was fetched (EOFError, "
         "which ended the DHT process)",
         "tests/test_noise.py::test_a_request_whose_sender_exits_mid_handshake_ends_that_request_not_the_dht_process",
         "bd3a376f042d386e",
         upstream_fix="DHT.run: a request that cannot be read because its sender exited (EOFError from the "
                      "resource sharer) is dropped like the OSErrors already caught, instead of ending the process"),
    Seam(f"{_P}:replace_decoder", "hivemind.compression.serialization:deserialize_torch_tensor", "patch",
         "process-wide: an entry of the decoder table (_BASE_COMPRESSION_TYPES) that this function reads is "
         "replaced, so UNIFORM_8BIT messages are decoded by crowdtrain's faster codec (same values)",
         "tests/test_coordinator.py::test_8bit_messages_decode_to_hiveminds_values_through_hiveminds_own_entry_point",
         "74f1eed9fb9b7de3"),
    Seam("crowdtrain.swarm.compression:Uniform8Bit.quantize",
         "hivemind.compression.quantization:Uniform8BitQuantization.quantize", "public-override",
         "the same wire format without torch.quantize_per_tensor (deprecated)",
         "tests/test_coordinator.py::test_8bit_messages_decode_to_hiveminds_values_through_hiveminds_own_entry_point",
         "22c9ac8b40147db0"),
)


def resolve(spec: str):
    """The object named by "module:qualname" (attributes looked up in class dicts first, so a
    method is the class's own, not an inherited one)."""
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) and part in obj.__dict__ else getattr(obj, part)
    return obj


def upstream_digest(spec: str) -> str:
    """sha256 (16 hex digits) of the upstream object's source (for a table: of its keys)."""
    obj = resolve(spec)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    text = repr(sorted(obj)) if isinstance(obj, dict) else inspect.getsource(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_upstream() -> list[tuple[Seam, str]]:
    """The entries whose upstream code differs from what they were written against, with the new digest."""
    out = []
    for seam in SEAMS:
        try:
            digest = upstream_digest(seam.upstream)
        except (AttributeError, ImportError, KeyError, OSError, TypeError) as e:
            digest = f"missing ({e!r})"
        if digest != seam.digest:
            out.append((seam, digest))
    return out


def check_hivemind_version() -> None:
    """Raise with the fix if the installed hivemind is not the one this package was written against."""
    import hivemind

    if hivemind.__version__ != HIVEMIND_VERSION:
        raise RuntimeError(f"crowdtrain needs hivemind=={HIVEMIND_VERSION} exactly (it overrides hivemind "
                           f"internals, see crowdtrain/swarm/hivemind_seam), found {hivemind.__version__}: "
                           f"pip install hivemind=={HIVEMIND_VERSION}")
