"""`crowdtrain eval` on any run's data (held-out loss per split; adherence only where the data has a
judge) and `crowdtrain generate` with several prompts in one grid, on tiny checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests._data_helpers import make_shards, make_stripes_shards, random_vq, stripes_items
from crowdtrain.checkpoint import save_checkpoint
from crowdtrain.cli import main
from crowdtrain.data import judges
from crowdtrain.data.config import GenerateConfig
from crowdtrain.data.evaluate import evaluate_generator
from crowdtrain.data.generate import Generator, generate_rows
from crowdtrain.data.image_tokenizer import load_image_tokenizer
from crowdtrain.data.shards import prepare_shards
from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER, load_text_tokenizer
from crowdtrain.model.config import get_preset
from crowdtrain.model.transformer import DalleTransformer
from crowdtrain.train.validate import valid_loss, valid_rows

pytestmark = pytest.mark.timeout(180)

CONFIG = get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=512)


def checkpoint_for(directory, vq, data, *, seed: int = 0):
    """A tiny model's checkpoint as the coordinator writes it: both tokenizers, the run's data recorded."""
    torch.manual_seed(seed)
    return save_checkpoint(directory / "step-0000003", DalleTransformer(CONFIG), step=3, loss=4.0,
                           run_config={"task": {"name": "dalle", "data": str(data)}},
                           assets={"text_tokenizer.json": SHAPES_TEXT_TOKENIZER, "image_tokenizer.safetensors": vq})


@pytest.fixture(scope="module")
def stripes(tmp_path_factory):
    """An organizer's own pictures: train, valid and heldout splits, no judge."""
    root = tmp_path_factory.mktemp("stripes")
    shards, vq = make_stripes_shards(root, train=12, valid=9)
    prepare_shards(None, shards, load_image_tokenizer(vq), split="heldout", shard_size=20, progress=False,
                   items=(stripes_items(6, seed=2), 6))
    return shards, checkpoint_for(root, vq, shards)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The shapes data (recognised by the demo's marker file), coded by the checkpoint's own VQ."""
    root = tmp_path_factory.mktemp("shapes")
    vq = random_vq(root / "vq.safetensors", seed=1)  # not the stripes' tokenizer
    shards = make_shards(root / "shards", vq, num=20)
    make_shards(shards, vq, num=6, seed=5, split="valid")
    (shards / "demo.json").write_text(json.dumps({"num_train": 20}))
    return shards, checkpoint_for(root, vq, shards)


def test_eval_on_own_pictures_prints_each_held_out_loss_and_no_adherence(stripes, tmp_path, capsys):
    shards, ckpt = stripes
    assert main(["eval", "--checkpoint", str(ckpt), "--json", str(tmp_path / "eval.json")]) == 0  # data: the run's
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result["losses"]) == {"valid", "heldout"}  # every split but train
    assert result["losses"]["valid"]["rows"] == 9 and result["losses"]["heldout"]["rows"] == 6
    model = Generator.from_checkpoint(ckpt).model
    rows = valid_rows(shards, text_tokenizer=load_text_tokenizer(SHAPES_TEXT_TOKENIZER), model_config=CONFIG,
                      split="heldout")
    assert result["losses"]["heldout"]["loss"] == pytest.approx(valid_loss(model, rows), rel=1e-5)
    for split, v in result["losses"].items():
        assert f"{split:12s} {v['rows']:6d} {v['loss']:8.4f}" in out
    # No judge for these pictures: one line saying so, and no score of any kind.
    assert result["adherence"] is None and result["adherence_seen"] is None and result["judge"] is None
    assert "no prompt adherence: the data at" in out and "has no judge" in out
    assert "adherence " not in out.replace("no prompt adherence", "") and "seen" not in out


def test_eval_on_shapes_data_reports_adherence_by_the_shapes_judge(shapes, tmp_path, capsys):
    shards, ckpt = shapes
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(shards), "--samples-per-prompt", "1",
                 "--json", str(tmp_path / "eval.json")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result["losses"]) == {"valid"} and result["judge"] == "shapes"
    groups = result["adherence"]["groups"]
    assert set(groups) == {"seen", "heldout"} and groups["seen"]["samples"] == 8
    assert 0 <= groups["seen"]["adherence"] <= groups["seen"]["objects"] <= 1
    assert result["adherence_seen"] == groups["seen"]["adherence"]
    assert "prompt adherence by the shapes judge" in out and "objects" in out and "heldout" in out
    # An untrained model does not draw what it is asked.
    assert groups["seen"]["adherence"] <= 0.25


def test_eval_says_which_flag_to_pass_when_the_data_cannot_be_reached(stripes, tmp_path, capsys):
    _, ckpt = stripes
    gone = checkpoint_for(tmp_path, ckpt / "image_tokenizer.safetensors", "http://127.0.0.1:9/shards")
    assert main(["eval", "--checkpoint", str(gone)]) == 2
    err = capsys.readouterr().err
    assert "http://127.0.0.1:9/shards" in err and "--data" in err
    bare = save_checkpoint(tmp_path / "bare", DalleTransformer(CONFIG), step=1)  # no run recorded
    assert main(["eval", "--checkpoint", str(bare)]) == 2
    assert "pass the shards to evaluate on with --data" in capsys.readouterr().err


def test_eval_refuses_data_coded_by_another_image_tokenizer(stripes, shapes, capsys):
    (_, stripes_ckpt), (shapes_shards, _) = stripes, shapes
    assert main(["eval", "--checkpoint", str(stripes_ckpt), "--data", str(shapes_shards)]) == 2
    err = capsys.readouterr().err
    assert "coded with image tokenizer" in err and "--data" in err


def test_a_data_set_names_its_judge_in_its_manifest(stripes, tmp_path, monkeypatch):
    shards, _ = stripes
    assert judges.judge_for_data(shards) is None and judges.judge_for_data("pattern") is None

    class Bright:
        name = "bright"

        def prompts(self):
            return {"seen": ["a bright picture"], "novel": ["a dark picture", "a grey picture"]}

        def judge(self, prompt, images):
            return [{"all": bool(im.mean() > 127), "bright": bool(im.mean() > 100), "score": 0.5} for im in images]

    records = []
    monkeypatch.setitem(judges.JUDGES, "bright-things", lambda record: records.append(record) or Bright())
    named = tmp_path / "named"
    named.mkdir()
    manifest = json.loads((shards / "shards.json").read_text())
    record = {"name": "bright-things", "threshold": 127}  # what the set holds reaches its judge
    (named / "shards.json").write_text(json.dumps({**manifest, "dataset": record}))
    judge = judges.judge_for_data(named)
    assert isinstance(judge, Bright) and isinstance(judge, judges.Judge) and records == [record]
    (named / "shards.json").write_text(json.dumps({**manifest, "dataset": {"name": "nobody-judges-this"}}))
    assert judges.judge_for_data(named) is None

    class Canvas:  # a generator that draws all white for "bright", all black otherwise
        def sample(self, prompt, num, **kw):
            value = 255 if "bright" in prompt else 0
            return None, torch.full((num, 8, 8, 3), value, dtype=torch.uint8)

    result = evaluate_generator(Canvas(), judge=Bright(), samples_per_prompt=2)
    assert result["judge"] == "bright" and result["checks"] == ["bright"]  # "score" is not a check
    assert result["groups"]["seen"] == {"samples": 2, "adherence": 1.0, "bright": 1.0}
    assert result["groups"]["novel"] == {"samples": 4, "adherence": 0.0, "bright": 0.0}


def test_prepare_keeps_the_data_sets_name_across_splits(tmp_path):
    vq = random_vq(tmp_path / "vq.safetensors")
    tok = load_image_tokenizer(vq)
    prepare_shards(None, tmp_path / "s", tok, progress=False, items=(stripes_items(3, 0), 3),
                   dataset={"name": "stripes"})
    prepare_shards(None, tmp_path / "s", tok, split="valid", progress=False, items=(stripes_items(2, 1), 2))
    assert json.loads((tmp_path / "s" / "shards.json").read_text())["dataset"] == {"name": "stripes"}
    assert judges.dataset_name(tmp_path / "s") == "stripes"


def test_two_splits_prepared_into_one_folder_at_the_same_time_keep_each_others_shards(tmp_path, monkeypatch):
    # The valid split's run (another terminal) finishes while the train split's run is encoding its
    # first shard: the train run read the manifest before valid was in it.
    from crowdtrain.data import shards as shards_module

    tok = load_image_tokenizer(random_vq(tmp_path / "vq.safetensors"))
    out = tmp_path / "s"
    write_shard, other_done = shards_module.write_shard, []

    def write_while_the_other_run_finishes(path, rows):
        if not other_done:
            other_done.append(True)
            prepare_shards(None, out, tok, split="valid", progress=False, items=(stripes_items(2, 1), 2))
        return write_shard(path, rows)

    monkeypatch.setattr(shards_module, "write_shard", write_while_the_other_run_finishes)
    prepare_shards(None, out, tok, progress=False, shard_size=2, items=(stripes_items(4, 0), 4))
    splits = json.loads((out / "shards.json").read_text())["splits"]
    assert {split: sum(s["rows"] for s in entries) for split, entries in splits.items()} == {"train": 4, "valid": 2}


# ---- generate with several prompts ---------------------------------------------------------------

PROMPTS = ["a small red circle", "a large blue square on the left", "a green bar at the top"]


def test_generate_draws_one_grid_with_a_labelled_row_per_prompt(shapes, tmp_path, capsys):
    _, ckpt = shapes
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("# my prompts\n\n" + PROMPTS[1] + "\n[held-out] " + PROMPTS[2] + "\n")
    out = tmp_path / "grid.png"
    assert main(["generate", "--checkpoint", str(ckpt), PROMPTS[0], "--prompts", str(prompts_file),
                 "--num-samples", "4", "--keep", "2", "--seed", "3", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "wrote" in said and "3 rows, one per prompt, each the best 2 of 4" in said
    grid = np.asarray(Image.open(out).convert("RGB"))
    label_w, tile = 240, 4 * 66  # 64 px tiles with 2 px gaps, upscaled 4x
    assert grid.shape == (4 * (3 * 66 + 2), label_w + 4 * (2 * 66 + 2), 3)
    for row, prompt in enumerate(PROMPTS):
        # Each row is that prompt's own best 2 of 4, as `generate` draws for it alone.
        alone = tmp_path / f"alone{row}.png"
        assert main(["generate", "--checkpoint", str(ckpt), prompt, "--num-samples", "4", "--keep", "2",
                     "--seed", "3", "--out", str(alone)]) == 0
        single = np.asarray(Image.open(alone).convert("RGB"))
        assert single.shape == (4 * (66 + 2), 4 * (2 * 66 + 2), 3)
        top = row * tile
        assert np.array_equal(grid[top:top + 4 * 68, label_w:], single)
        # ... with its label drawn on the left.
        label = grid[top + 8:top + tile, :label_w]
        assert (label < 100).any(), f"no label text on row {row}"
    capsys.readouterr()


def test_generate_rows_without_labels_and_bad_prompt_files(shapes, tmp_path, capsys):
    _, ckpt = shapes
    result = generate_rows(ckpt, PROMPTS[:2], GenerateConfig(num_samples=2, keep=1), out=tmp_path / "g.png",
                           labels=False)
    assert [r["prompt"] for r in result["rows"]] == PROMPTS[:2]
    assert Image.open(tmp_path / "g.png").size == (4 * 68, 4 * (2 * 66 + 2))  # one column, two rows, no label
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    for path, message in ((tmp_path / "missing.txt", "--prompts"), (empty, "holds no prompt")):
        assert main(["generate", "--checkpoint", str(ckpt), "--prompts", str(path), "--out",
                     str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err
    assert main(["generate", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x.png")]) == 2
    assert "--prompts FILE" in capsys.readouterr().err
