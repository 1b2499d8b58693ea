"""Checkpoints, the LR schedule, the single-process trainer and the model CLI."""

import json
import subprocess
import sys

import pytest
import torch

from crowdtrain.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, load_optimizer_state,
                                   prune_checkpoints, save_checkpoint)
from crowdtrain.model import DalleTransformer, get_preset
from crowdtrain.optim import linear_warmup_decay, param_groups, warmup_decay_at
from crowdtrain.train.local import LocalTrainConfig, train_local
from crowdtrain.train.task import DalleTask, stable_seed, task_from_description


def test_checkpoint_round_trip_keeps_weights_config_and_optimizer_state(tmp_path):
    model = DalleTransformer(get_preset("tiny", reversible=True))
    opt_state = {"exp_avg.0": torch.randn(5), "step": torch.tensor(3)}
    asset = tmp_path / "tok.json"
    asset.write_text('{"vocab": 1}')
    path = save_checkpoint(tmp_path / "ckpt" / "step-0000003", model, step=3, loss=2.5, optimizer_state=opt_state,
                           optimizer_meta={"name": "lamb"}, assets={"text_tokenizer.json": asset})
    loaded, meta = load_checkpoint(path)
    assert meta["step"] == 3 and meta["loss"] == 2.5 and meta["fingerprint"] == model.config.fingerprint()
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tensors, opt_meta = load_optimizer_state(path)
    assert torch.equal(tensors["exp_avg.0"], opt_state["exp_avg.0"]) and opt_meta == {"name": "lamb"}
    assert (path / "text_tokenizer.json").read_text() == '{"vocab": 1}'
    assert not any(p.name.startswith(".") for p in path.parent.iterdir()), "no temporary directory left behind"
    # No pickle anywhere: every file is JSON or safetensors.
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "optimizer.safetensors",
                                                      "text_tokenizer.json"]


def test_damaged_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a crowdtrain checkpoint"):
        load_checkpoint(tmp_path)
    path = save_checkpoint(tmp_path / "step-0000001", DalleTransformer(get_preset("tiny")), step=1)
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="incomplete or damaged"):
        load_checkpoint(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(path)


def test_checkpoint_listing_and_pruning_keep_the_newest(tmp_path):
    model = DalleTransformer(get_preset("tiny"))
    for step in (1, 5, 12, 30):
        save_checkpoint(tmp_path / f"step-{step:07d}", model, step=step)
    (tmp_path / ".step-0000040.tmp-1").mkdir()  # a crashed write is not a checkpoint
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000001", "step-0000005", "step-0000012", "step-0000030"]
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-0000001", "step-0000005"]
    assert latest_checkpoint(tmp_path).name == "step-0000030"
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=0)


def test_schedule_warms_up_then_decays_to_zero_and_groups_skip_norms():
    rates = [linear_warmup_decay(s, warmup_steps=10, total_steps=100) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[10:], rates[11:])) and rates[-1] < 0.02
    model = DalleTransformer(get_preset("tiny"))
    decay, no_decay = param_groups(model, 0.045)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_stable_seed_is_the_same_in_another_process():
    here = stable_seed("peer-abc")
    code = "from crowdtrain.train.task import stable_seed; print(stable_seed('peer-abc'))"
    there = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert here == there and stable_seed("peer-abd") != here


def test_local_training_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    # A task whose data has structure: the image codes repeat the caption's first tokens.
    cfg = get_preset("tiny")

    class CopyTask(DalleTask):
        def batches(self, *, batch_size, seed_key):
            g = torch.Generator().manual_seed(stable_seed(seed_key))
            while True:
                text = torch.randint(1, 8, (batch_size, cfg.text_len), generator=g)
                image = (text[:, :1].repeat(1, cfg.image_len) * 3) % cfg.image_vocab_size
                yield {"text": text, "image": image}

    task = CopyTask(cfg)
    summary = train_local(task, LocalTrainConfig(batch_size=16, max_steps=80, warmup_steps=5, lr=3e-3,
                                                 out_dir=str(tmp_path), log_every=20))
    assert summary["steps"] == 80
    assert summary["loss_end"] < 0.5 * summary["loss_start"], (summary["loss_start"], summary["loss_end"])
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["loss_end"] == summary["loss_end"]
    model, meta = load_checkpoint(summary["checkpoint"])
    assert meta["step"] == 80 and meta["run"]["task"]["name"] == "dalle"
    assert task_from_description(meta["run"]["task"]).model_config == cfg


def test_train_config_rejects_bad_values_with_the_flag_to_change():
    with pytest.raises(ValueError, match="--batch-size"):
        LocalTrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="--precision"):
        LocalTrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="--warmup-steps"):
        LocalTrainConfig(max_steps=10, warmup_steps=10)


def test_model_info_cli_prints_the_paper_counts_as_json():
    out = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "model-info", "--preset", "paper", "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    info = json.loads(out)
    assert abs(info["unique_params"] / 126e6 - 1) < 0.03 and abs(info["unshared_params"] / 1.12e9 - 1) < 0.03
    assert info["sequence"]["seq_len"] == 256 + 32 * 32
    assert [l["pattern"] for l in info["layers"][:4]] == ["axial_row", "axial_col", "axial_row", "axial_row"]
    bad = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "model-info", "--preset", "huge"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown model preset 'huge'" in bad.stderr


def test_warmup_on_a_continuous_position_starts_from_zero_and_never_exceeds_the_peak():
    # DiLoCo keys its inner rate on the epoch plus the progress into it (0.5 = half an epoch);
    # its first inner steps must not take half the peak rate (bench_diloco_outer: 0.84 vs 0.65).
    rates = [warmup_decay_at(s / 10, warmup=2, total=20) for s in range(201)]
    assert rates[0] == 0.0 and rates[1] == pytest.approx(0.05) and rates[20] == pytest.approx(1.0)
    assert max(rates) == 1.0 and all(a <= b for a, b in zip(rates[:20], rates[1:21]))
    assert all(a >= b for a, b in zip(rates[20:], rates[21:])) and rates[200] == 0.0
    assert warmup_decay_at(3.0, warmup=0, total=10) == pytest.approx(0.7)  # no warm-up: decay only