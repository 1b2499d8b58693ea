"""docs/organize-a-run.md with an organizer's own images (not the shapes set), by the command line
alone: tokenizers trained from the images and captions, shards with the fit report, a
coordinator given both tokenizers, its own sample prompts and a time budget, two volunteers as
real processes that train to the run's end, the prompts on /samples and in the checkpoint's
sample folder, and `crowdtrain generate`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tests._data_helpers import stripes_items
from crowdtrain.launch import LocalSwarm, cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def crowdtrain(*args: str, timeout: float = 240) -> str:
    return crowdtrain_at_once(args, timeout=timeout)[0]


def crowdtrain_at_once(*commands: tuple[str, ...], timeout: float = 240) -> list[str]:
    """Independent steps of the guide side by side (the second core is otherwise idle while each
    imports torch); each one's output, in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    outs = []
    for args, proc in zip(commands, procs):
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, (args, stdout[-2000:], stderr[-3000:])
        outs.append(stdout)
    return outs


def image_folder(folder, num: int, seed: int):
    """Own pictures as an organizer has them: PNG files, each with a same-named .txt caption."""
    folder.mkdir()
    for item in stripes_items(num, seed=seed):
        name = item.source.replace("/", "_")
        Image.fromarray(item.image).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(item.caption)
    return folder


# In the swarm lane: its gallery needs the auxiliary peer to checkpoint while the volunteers
# train, which a starved (niced) auxiliary peer beside a storm of newcomers did not; and the
# run is time-boxed (a starved run reaches fewer epochs).
@pytest.mark.swarm
def test_the_guide_with_own_images_by_the_command_line_alone_to_the_end_of_its_time_budget(tmp_path):
    images = image_folder(tmp_path / "my_images", 60, seed=3)
    valid = image_folder(tmp_path / "my_valid", 8, seed=4)

    # Step 2 of the guide: an image tokenizer and a text tokenizer of one's own, then shards.
    vq, text = tmp_path / "my_vq.safetensors", tmp_path / "my_text_tokenizer.json"
    crowdtrain_at_once(("tokenizer", "train", "--data", str(images), "--out", str(vq), "--steps", "30", "--batch-size",
                        "8"),
                       ("tokenizer", "train-text", "--data", str(images), "--out", str(text), "--vocab-size", "128"))
    assert not vq.with_name(vq.name + ".resume.safetensors").exists()
    shards = tmp_path / "shards"
    # Both splits at once, as two terminals would: each keeps the other's shards in the manifest.
    said, _ = crowdtrain_at_once(("data", "prepare", "--input", str(images), "--out", str(shards), "--image-tokenizer",
                                  str(vq)),
                                 ("data", "prepare", "--input", str(valid), "--out", str(shards), "--image-tokenizer",
                                  str(vq), "--split", "valid"))
    assert "60 rows" in said and "skipped nothing" in said and "tokenizer fit: PSNR" in said, said
    assert (shards / "fit_report-train.png").is_file()

    # Step 4: the coordinator with both tokenizers by flag, the organizer's own prompts, and a
    # time budget (20 s of training here): the run sizes its total once it has measured its pace.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# the gallery\na blue checkerboard number 1\n[held-out] a green gradient number 2\n")
    swarm = LocalSwarm(tmp_path, preset="tiny", data=str(shards), samples_every=1,
                       swarm={"target_batch_size": 64, "checkpoint_every_epochs": 4, "matchmaking_time_s": 2.0})
    del swarm.swarm["total_epochs"]  # the budget sizes it
    try:
        info = swarm.start_coordinator(extra=["--image-tokenizer", str(vq), "--text-tokenizer", str(text),
                                              "--sample-prompts", str(prompts), "--time-budget", "20s"])
        assert info["task"]["model"]["image_vocab_size"] == 512  # sized by the image tokenizer
        assert info["schedule"]["total_epochs"] is None and info["schedule"]["time_budget_s"] == 20
        for name in ("alice", "bob"):
            swarm.join(name, batch_size=8, max_epochs=500)
        for name in ("alice", "bob"):
            assert swarm.wait_exit(name, 240) == 0, swarm.log(name)[-3000:]
        check_the_run_ended(swarm)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(swarm.run_dir.glob("samples/step-*/prompts.json")):
            time.sleep(1)
        index_files = sorted(swarm.run_dir.glob("samples/step-*/prompts.json"))
        assert index_files, swarm.log("coordinator")[-3000:] + (swarm.run_dir / "aux.log").read_text()[-3000:]
        index = json.loads(index_files[-1].read_text())
        assert [(e["prompt"], e["tag"]) for e in index] == [("a blue checkerboard number 1", None),
                                                           ("a green gradient number 2", "held-out")]
        html = urllib.request.urlopen(f"{swarm.url}/samples", timeout=30).read().decode()
        assert "a blue checkerboard number 1" in html and '<span class="badge held-out">held-out</span>' in html
        assert "a large red circle" not in html  # no shapes prompt on a run that is not the shapes data
        checkpoints = urllib.request.urlopen(f"{swarm.url}/checkpoints", timeout=30).read().decode()
        assert re.search(r"crowdtrain generate --checkpoint step-\d+ &#39;a blue checkerboard number 1&#39;",
                         checkpoints)

        # Step 7: the auxiliary peer measured the validation loss at each checkpoint, over the
        # coordinator's /shards, and marked the best one; `crowdtrain eval` reads the run's data itself.
        written = json.loads(urllib.request.urlopen(f"{swarm.url}/api/checkpoints", timeout=30).read())
        assert written and all(set(c["valid_loss"] or {}) == {"valid"} for c in written), written
        assert all(c["valid_rows"] == {"valid": 8} for c in written)
        assert sum(c["best"] for c in written) == 1
        history = json.loads(urllib.request.urlopen(f"{swarm.url}/api/history", timeout=30).read())
        assert [p["valid_loss"] for p in history if p.get("valid_loss")][-1] == written[-1]["valid_loss"]
        last = sorted((swarm.run_dir / "checkpoints").glob("step-*"))[-1]
        said = crowdtrain("eval", "--checkpoint", str(last))
        found = re.search(r"valid +8 +(\d+\.\d{4})", said)
        assert found and "no prompt adherence" in said, said
        run_figure = {c["name"]: c["valid_loss"]["valid"] for c in written}[last.name]
        assert float(found.group(1)) == pytest.approx(run_figure, abs=2e-4)  # the figure the run showed
    finally:
        swarm.close()

    # Step 8: draw from the last checkpoint with the run's own tokenizers (saved into it).
    checkpoint = sorted((swarm.run_dir / "checkpoints").glob("step-*"))[-1]
    one, rows = tmp_path / "drawn.png", tmp_path / "drawn_rows.png"
    prompts_file = tmp_path / "to_draw.txt"
    prompts_file.write_text("a blue checkerboard number 1\n# not this\na green gradient number 2\n")
    said_one, said_rows = crowdtrain_at_once(
        ("generate", "--checkpoint", str(checkpoint), "a green gradient number 2", "--num-samples", "4", "--keep", "2",
         "--out", str(one)),
        ("generate", "--checkpoint", str(checkpoint), "--prompts", str(prompts_file), "--num-samples", "4", "--keep",
         "2", "--out", str(rows)))
    assert "best 2 of 4" in said_one and np.asarray(Image.open(one)).shape == (4 * 68, 4 * (2 * 66 + 2), 3)
    assert "2 rows, one per prompt" in said_rows and np.asarray(Image.open(rows)).shape[0] == 4 * (2 * 66 + 2)


def check_the_run_ended(swarm: LocalSwarm) -> None:
    """The end of a time-budget run: volunteers that joined while the total was unknown learned it
    while they trained (no restart); at the total they waited for the final checkpoint and left
    with the message and exit code 0; the run says it has finished and nobody trains; a
    newcomer's `crowdtrain join` stops at once (exit 2)."""
    status = swarm.status()
    total = status["total_epochs"]
    assert status["schedule"]["sized_at"] is not None and total > 3, status["schedule"]
    # The first to train joined while the total was unknown (its first steps started the clock):
    # it learned the total while it trained. (The other may have joined after it was sized.)
    learned = f"the run's schedule changed: total_epochs being sized -> {total}"
    assert any(learned in swarm.log(name) for name in ("alice", "bob")), swarm.log("alice")[-3000:]
    # At the total, or one step past it: while the total is being sized a peer asks for it at each
    # new epoch (and every 5 s), and a total sized with an epoch to go just after a peer asked (the
    # swarm's first epochs were slow: 4 s each once) can be passed before it hears. It then waits
    # for the total's checkpoint all the same (the coordinator saves no later one), not out its minute.
    finals = {name: swarm.summary(name)["final_epoch"] for name in ("alice", "bob")}
    assert all(total <= final <= total + 1 for final in finals.values()) and total in finals.values(), finals
    for name, final in finals.items():
        log = swarm.log(name)
        assert (f"the run reached its last epoch ({final} of {total}): thank you; the final model is at "
                f"{swarm.url}/checkpoints") in log, log[-3000:]
        assert "has not saved the final model" not in log, log[-3000:]
    # Their last metrics records live a minute in the DHT; they said they left, so nobody counts as training.
    left = time.monotonic()
    while status["active_peers"] and time.monotonic() - left < 10:
        time.sleep(1)
        status = swarm.status()
    assert status["active_peers"] == 0 and status["epoch"] == max(finals.values())
    assert status["finished"] and status["schedule"]["finished_epoch"] == total
    assert status["last_checkpoint_epoch"] == total and (swarm.run_dir / "checkpoints" / f"step-{total:07d}").is_dir()
    started = time.monotonic()
    late = subprocess.run(cli("join", swarm.url, "--user", "carol"), capture_output=True, text=True, timeout=60,
                          env=swarm.env)
    assert late.returncode == 2 and f"the run reached its last epoch ({total} of {total})" in late.stderr, \
        late.stderr[-2000:]
    assert time.monotonic() - started < 30
