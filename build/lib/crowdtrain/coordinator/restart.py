"""A coordinator restarted on an existing run folder: what changed from the stored run, and whether
the live swarm can take it.

The run folder keeps ``coordinator.json`` from the last start. Volunteers keep training through a
coordinator restart with the settings they joined with, and only the schedule reaches them while
they train (``crowdtrain.swarm.schedule_watch``). So a restart may change:

- **the schedule** (``total_epochs``, ``warmup_epochs``, ``--time-budget``): an extension, sent to
  every volunteer within seconds (``crowdtrain.runspec.schedule``);
- **what each peer decides alone** (:data:`LOCAL`): timeouts, state uploads, checkpoint period,
  compression threshold, the robust aggregation's tuning. The coordinator's own peer uses the new
  values at once; volunteers already training keep theirs until they rejoin, and mixed values
  only make some rounds or downloads behave differently;
- **the data source** (``--data``): newcomers stream the new shards.

and it refuses (naming the flag) whatever would make the peers of one swarm train apart:

- the model (``--preset``, ``--model``) and the text or image tokenizer: a newcomer would build or
  read something other than the model the swarm holds;
- ``mode``, ``target_batch_size``, ``aggregation``, ``overlap_outer_round`` and ``run_id``: peers
  would count epochs, meet for rounds or average differently (a different target batch puts
  sync points apart; a different mode or aggregation cannot share a round);
- the optimizer's hyper-parameters (``lr``, ``betas``, ...): peers already training keep the old
  ones, so replicas of the one model would take different steps and drift apart;
- any setting this list does not name (a new one is refused until someone decides).

Refused changes stop the start before anything is written; the error says how to go on: restart
with the stored value, or start a new run (``--run-id``/``--run-dir``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from crowdtrain.runspec.swarm import PEER_LOCAL_SETTINGS as LOCAL
from crowdtrain.runspec.swarm import SCHEDULE_SETTINGS as SCHEDULE  # see crowdtrain.runspec.schedule

WHY = {
    "run_id": "the swarm's peers find each other under the run id",
    "mode": "sync and DiLoCo peers cannot share a round",
    "target_batch_size": "peers already training count epochs at the stored target batch: a different one puts "
                         "their sync points apart",
    "aggregation": "peers with different aggregation rules form different groups",
    "overlap_outer_round": "overlapped and blocking DiLoCo peers read each other's progress as a lost round",
}
OPTIMIZER = ("lr", "betas", "eps", "weight_decay", "clip_grad_norm", "inner_optimizer", "outer_lr", "outer_momentum")
OPTIMIZER_WHY = ("volunteers already training keep the stored value, so the swarm's replicas of the one model "
                 "would take different steps and drift apart")
OTHER_WHY = "volunteers already training keep the stored value (a setting not known to be safe to mix)"


@dataclass
class SpecChanges:
    """What differs between the stored run's spec and this start's."""

    accepted: list[str] = field(default_factory=list)  # log lines, old -> new
    refused: list[str] = field(default_factory=list)  # one line each: the flag, old -> new, why

    def error(self, run_dir) -> str:
        lines = "\n".join(f"  - {r}" for r in self.refused)
        return (f"refusing to start: these settings differ from the stored run's ({Path(run_dir) / 'coordinator.json'})"
                f" and would break its live swarm:\n{lines}\nRestart with the stored values (the last start's "
                "command), or start a new run with another --run-id (or --run-dir).")


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _file_sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, TypeError):
        return None


def compare_specs(old: dict, new: dict) -> SpecChanges:
    """Every difference between two ``coordinator.json`` specs, sorted into accepted and refused
    (the schedule's fields are left to ``crowdtrain.runspec.schedule.schedule_at_start``)."""
    changes = SpecChanges()
    old_task, new_task = old.get("task") or {}, new.get("task") or {}
    if old.get("preset") != new.get("preset"):
        changes.refused.append(f"--preset: {old.get('preset')} -> {new.get('preset')}: the swarm trains the stored "
                               "run's model; a newcomer would build another")
    old_model, new_model = old_task.get("model") or {}, new_task.get("model") or {}
    for key in sorted(set(old_model) | set(new_model)):
        if old_model.get(key) != new_model.get(key):
            changes.refused.append(f"--model {key}: {_show(old_model.get(key))} -> {_show(new_model.get(key))}: the "
                                   "swarm trains the stored run's model; a newcomer would build another")
    if old_task.get("data") != new_task.get("data"):
        changes.accepted.append(f"--data: {old_task.get('data')} -> {new_task.get('data')} (newcomers stream the new "
                                "data; volunteers already training keep the old until they rejoin)")
    old_text, new_text = old.get("text_tokenizer") or {}, new.get("text_tokenizer") or {}
    if old_text.get("sha256") != new_text.get("sha256"):
        changes.refused.append(f"--text-tokenizer: {old_text.get('path')} -> {new_text.get('path')} (another file): "
                               "captions would become other token ids for newcomers than for the swarm")
    old_image = (old.get("assets") or {}).get("image_tokenizer.safetensors")
    new_image = (new.get("assets") or {}).get("image_tokenizer.safetensors")
    if old_image != new_image and _file_sha256(old_image) != _file_sha256(new_image):
        changes.refused.append(f"--image-tokenizer: {old_image} -> {new_image} (another file): the shards' codes "
                               "and the model's samples would mean other pictures")
    old_swarm, new_swarm = old.get("swarm") or {}, new.get("swarm") or {}
    for key in sorted(set(old_swarm) | set(new_swarm)):
        if key in SCHEDULE or old_swarm.get(key) == new_swarm.get(key):
            continue
        line = f"--swarm {key}: {_show(old_swarm.get(key))} -> {_show(new_swarm.get(key))}"
        if key in LOCAL:
            changes.accepted.append(f"{line} (the coordinator's peer uses it now; volunteers already training "
                                    "keep the old value until they rejoin)")
        elif key == "run_id":
            changes.refused.append(f"--run-id: {old_swarm.get(key)} -> {new_swarm.get(key)}: {WHY[key]}")
        else:
            changes.refused.append(f"{line}: {WHY.get(key, OPTIMIZER_WHY if key in OPTIMIZER else OTHER_WHY)}")
    return changes
