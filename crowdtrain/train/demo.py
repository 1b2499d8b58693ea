"""`crowdtrain demo`: a whole collaborative run on this machine, on embedded defaults.

Makes the shapes shards if missing, starts a coordinator and N volunteers of different speeds
and batch sizes on 127.0.0.1 (real processes, the same commands people run), prints a live
summary, and at the end the epochs reached, the loss from start to end, samples contributed
per peer and the share of rounds in which all live peers averaged together; it writes a grid
of samples for fixed prompts (seen and held-out compositions) and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from crowdtrain import launch

logger = logging.getLogger(__name__)

# (batch size, simulated seconds per step): a fast peer, a medium one, a slow device.
PEER_KINDS = [(32, 0.0), (16, 0.0), (8, 1.5)]


def _open_in_browser(url: str) -> None:
    """Open the dashboard where there is a screen to show it on (not on a headless server)."""
    import webbrowser

    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin":
        try:
            webbrowser.open(url)
        except webbrowser.Error:
            pass


# The auxiliary peer measures the validation loss at every checkpoint (every ~20 s in a demo) on
# the cores the volunteers train on: on 2 cores, 512 rows of each shapes split took ~7 s, a third
# of a core, and the 5-minute demo lost a quarter of its epochs. 128 rows draw the dashboard's
# line at a quarter of that (the demo's own held-out loss at the end is read on 256 rows). The
# emoji demo keeps the coordinator's default: its figures were measured with it.
SHAPES_VALID_ROWS = 128
# How long the demo waits for its volunteers to start training before its clock starts anyway (a
# volunteer that never starts shows in its log; the others train meanwhile).
STARTUP_WAIT_S = 120.0


def run_swarm_demo(*, peers: int = 3, minutes: float = 5.0, port: int = 8000, dht_port: int = 31337,
                   out_dir: str = "runs/demo", preset: str = "demo", data: str = "shapes",
                   swarm_preset: str = "laptop", swarm_overrides: dict | None = None,
                   model_overrides: dict | None = None, evaluate: bool = True, max_epochs: int | None = None,
                   coordinator_args: list[str] = (), data_options: dict | None = None,
                   eval_samples_per_prompt: int = 16) -> dict:
    """A coordinator and ``peers`` volunteers on this machine for ``minutes``; returns the summary.

    The learning-rate schedule is sized to the run: the swarm's throughput is estimated from a
    few timed steps of the model here (:func:`estimate_swarm_samples_per_s`), and
    ``total_epochs`` set so the rate decays to zero as the time runs out. A run that resumes
    from an earlier checkpoint gets a schedule that starts again at its epoch.

    ``data``: "shapes" (the bundled synthetic set), "emoji" (real pictures: see
    :func:`emoji_run_data`; ``data_options`` go to :func:`crowdtrain.data.emoji.ensure_emoji_shards`)
    or a shard folder. ``eval_samples_per_prompt``: images drawn per prompt for the prompt
    adherence of the last checkpoint (``evaluate``); fewer are quicker and noisier.
    """
    if peers < 1:
        raise ValueError(f"--peers must be >= 1, got {peers}")
    if minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {minutes}")
    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    data_name, data_args = data, []
    if data == "shapes":
        from crowdtrain.data import ensure_demo_shards

        print("making the bundled shapes data set (once; later runs reuse it)...", flush=True)
        data = str(ensure_demo_shards(out / "data" / "shapes", progress=True))
        data_args = ["--valid-rows", str(SHAPES_VALID_ROWS)]
    elif data == "emoji":
        data, data_args = emoji_run_data(out, data_options or {})
    swarm_overrides = dict(swarm_overrides or {})
    if "total_epochs" not in swarm_overrides:
        swarm_overrides.update(sized_schedule(swarm_preset, swarm_overrides, minutes=minutes, peers=peers,
                                              preset=preset, model_overrides=model_overrides or {},
                                              resumed_epoch=_resumed_epoch(out)))
    url = f"http://127.0.0.1:{port}"
    coordinator = launch.spawn(launch.cli(*launch.coordinator_args(
        run_id="demo", preset=preset, data=data, host="127.0.0.1", port=port, dht_port=dht_port, run_dir=out / "run",
        swarm_preset=swarm_preset, swarm=swarm_overrides, model=model_overrides,
        extra=["--samples-every", "5", *data_args, *coordinator_args])), out / "logs" / "coordinator.log")
    volunteers: dict[str, subprocess.Popen] = {}
    try:
        launch.wait_for_coordinator(url, coordinator, 180, out / "logs" / "coordinator.log")
        print(f"\ncoordinator up at {url}\n\n    dashboard: {url}/dashboard   (leaderboard, peers, checkpoints, "
              f"samples; API docs at {url}/docs)\n")
        _open_in_browser(f"{url}/dashboard")
        for i in range(peers):
            batch, step_s = PEER_KINDS[i % len(PEER_KINDS)]
            name = f"peer{i + 1}"
            volunteers[name] = launch.spawn(launch.cli(*launch.join_args(
                url, user=name, batch_size=batch, host="127.0.0.1", max_epochs=max_epochs, simulated_step_s=step_s,
                summary_file=out / f"{name}.json")), out / "logs" / f"{name}.log")
            print(f"  {name}: batch {batch}" + (f", a slow device ({step_s:.1f} s/step)" if step_s else ""))
        # The clock starts once every volunteer trains (or after STARTUP_WAIT_S): their start-up
        # (imports, the DHT, the first batches) takes seconds to a minute on a busy laptop, and the
        # schedule was sized for ``minutes`` of training.
        print(f"waiting for the {peers} volunteer(s) to start training; logs in {out / 'logs'}", flush=True)
        startup_ends, end, next_line = time.monotonic() + STARTUP_WAIT_S, None, 0.0
        while end is None or time.monotonic() < end:
            # Checked every second, so the demo goes on as soon as the volunteers are done; a
            # progress line every 15 s.
            time.sleep(1.0 if end is None else min(1.0, max(0.0, end - time.monotonic())))
            if all(proc.poll() is not None for proc in volunteers.values()):
                if all(proc.returncode == 0 for proc in volunteers.values()):
                    break  # every volunteer reached --max-epochs, or the run's last epoch
                raise RuntimeError(f"every volunteer exited early; see the logs in {out / 'logs'}")
            if end is not None and time.monotonic() < min(next_line, end):
                continue
            if end is None and time.monotonic() >= startup_ends:  # even while the status does not answer
                end = time.monotonic() + 60 * minutes
                print(f"not every volunteer trains after {STARTUP_WAIT_S:.0f} s (see their logs); training for "
                      f"{minutes:g} minutes\n", flush=True)
            try:
                status = launch.get_json(f"{url}/api/status")
            except OSError:
                continue
            live = status.get("peers", [])
            if end is None:
                if len(live) >= peers:
                    end = time.monotonic() + 60 * minutes
                    print(f"{len(live)} of {peers} volunteer(s) training; training for {minutes:g} minutes\n",
                          flush=True)
                continue
            next_line = time.monotonic() + 15.0
            loss = sum(p["loss"] for p in live) / len(live) if live else float("nan")
            print(f"[{time.strftime('%H:%M:%S')}] epoch {status['epoch']:4d} | {len(live)} peers | "
                  f"{status.get('samples_per_second', 0):6.1f} samples/s | mean loss {loss:.4f}", flush=True)
    finally:
        # Leave cleanly, like Ctrl-C, all at once (as Ctrl-C reaches them): one at a time, each
        # would leave a smaller swarm behind and the last would wait out a round alone.
        launch.stop_all(volunteers.values(), signal.SIGINT, 90)
        launch.stop(coordinator, signal.SIGTERM, 60)

    summary = summarize(out, list(volunteers))
    summary["url"] = url
    summary["data"] = data_name
    summary["minutes"] = minutes
    summary["swarm"] = {"preset": swarm_preset, **swarm_overrides}
    summary["samples_grid"] = write_samples(out, data=data)
    if evaluate and summary["checkpoint"]:
        summary.update(evaluate_run(summary["checkpoint"], data, samples_per_prompt=eval_samples_per_prompt))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


# Samples/s of one training process on one thread of the machine the demo's settings were
# tuned on (2 cores, idle), and what the 3-peer swarm made of it there: the swarm's rate scales
# with the cores the peers can use, and with the model's speed here.
_REFERENCE_STEP_SAMPLES_PER_S = 57.0
_REFERENCE_SWARM_SAMPLES_PER_S = 83.0
_REFERENCE_CORES = 2


def estimate_swarm_samples_per_s(*, preset: str, model_overrides: dict, peers: int, steps: int = 4) -> float:
    """The swarm's likely samples/s on this machine, from a few timed steps of the model."""
    import torch

    from crowdtrain.model.config import get_preset
    from crowdtrain.model.transformer import DalleTransformer

    config = get_preset(preset, **model_overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each volunteer runs
    try:
        torch.manual_seed(0)
        model = DalleTransformer(config)
        batch = {"text": torch.randint(1, config.text_vocab_size, (16, config.text_len)),
                 "image": torch.randint(0, config.image_vocab_size, (16, config.image_len))}
        model(**batch).loss.backward()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            model(**batch).loss.backward()
        per_thread = 16 * steps / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    cores = min(os.cpu_count() or 1, peers)
    scale = (per_thread / _REFERENCE_STEP_SAMPLES_PER_S) * (cores / min(_REFERENCE_CORES, 3))
    return _REFERENCE_SWARM_SAMPLES_PER_S * scale


def sized_schedule(swarm_preset: str, swarm_overrides: dict, *, minutes: float, peers: int, preset: str,
                   model_overrides: dict, resumed_epoch: int) -> dict:
    """``total_epochs`` (and a warm-up that fits) so the learning rate reaches zero when the run ends."""
    from crowdtrain.coordinator.run import SWARM_PRESETS

    base = dataclasses.replace(SWARM_PRESETS[swarm_preset](), **swarm_overrides)
    # Err long (x1.15): a schedule that ends early leaves the rest of the run at a zero rate,
    # one that ends late only stops the decay at ~13% of the peak.
    rate = 1.15 * estimate_swarm_samples_per_s(preset=preset, model_overrides=model_overrides, peers=peers)
    # The first ~20 s go to starting processes and forming the swarm.
    epochs = max(3, round(max(0.0, 60 * minutes - 20) * rate / base.target_batch_size))
    warmup = min(base.warmup_epochs, max(0, epochs // 5))
    logger.info("expecting about %.0f samples/s: schedule of %d epochs from epoch %d", rate, epochs, resumed_epoch)
    return {"total_epochs": resumed_epoch + epochs, "warmup_epochs": warmup}


def _resumed_epoch(out: Path) -> int:
    from crowdtrain.checkpoint import latest_checkpoint, read_meta

    checkpoint = latest_checkpoint(out / "run" / "checkpoints")
    return int(read_meta(checkpoint).get("step", 0)) if checkpoint is not None else 0


def evaluate_run(checkpoint: str, data: str, *, samples_per_prompt: int = 16, max_rows: int | None = None) -> dict:
    """Held-out loss on each split but train and, for data with a judge (``crowdtrain.data.judges``:
    the shapes analyser, the emoji retrieval judge), prompt adherence of the run's last checkpoint
    (``crowdtrain eval``'s figures; adherence None for data without one)."""
    from crowdtrain.train.validate import evaluate_quality

    print("evaluating the last checkpoint (held-out loss, prompt adherence where the data has a judge)...", flush=True)
    result = evaluate_quality(checkpoint, data=data, samples_per_prompt=samples_per_prompt, max_rows=max_rows)
    adherence = result.get("adherence") or {}
    return {"valid_loss": result["valid_loss"], "adherence_seen": result["adherence_seen"],
            "adherence_heldout": result["adherence_heldout"], "eval_samples_per_prompt": samples_per_prompt,
            "held_out_losses": {split: v["loss"] for split, v in result["losses"].items()},
            "judge": result["judge"], "adherence_groups": adherence.get("groups"),
            "adherence_per_prompt": adherence.get("prompts")}


EMOJI_SAMPLE_PROMPTS = 4  # per group in the run's gallery: each is drawn at every sampled checkpoint


def emoji_run_data(out: Path, options: dict) -> tuple[str, list[str]]:
    """Make (once, cached) the emoji shards and the run's sample prompts; returns the shard
    folder and the coordinator flags that name the run's tokenizers and prompts."""
    from crowdtrain.data.emoji import emoji_tokenizers, ensure_emoji_shards
    from crowdtrain.data.emoji_judge import EmojiJudge, write_prompt_file

    print("making the emoji data set (once; later runs reuse it): pictures, the learned image tokenizer "
          "(minutes), the text tokenizer, shards...", flush=True)
    shards = ensure_emoji_shards(out / "data" / "emoji", progress=True, **options)
    tokenizers = emoji_tokenizers(shards)
    prompts = write_prompt_file(EmojiJudge.from_shards(shards), out / "emoji_prompts.txt", EMOJI_SAMPLE_PROMPTS)
    return str(shards), ["--image-tokenizer", str(tokenizers["image"]), "--text-tokenizer", str(tokenizers["text"]),
                         "--sample-prompts", str(prompts)]


def summarize(out: Path, names: list[str]) -> dict:
    peers = {}
    for name in names:
        path = out / f"{name}.json"
        if path.is_file():
            peers[name] = json.loads(path.read_text())
    rounds = [r for p in peers.values() for r in p.get("rounds", []) if r["swarm_peers"] >= 2]
    first = [p["epochs"][0]["loss"] for p in peers.values() if p.get("epochs")]
    last = [p["epochs"][-1]["loss"] for p in peers.values() if p.get("epochs")]
    from crowdtrain.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(out / "run" / "checkpoints")
    return {
        "epochs": max((p.get("final_epoch", 0) for p in peers.values()), default=0),
        "loss_start": sum(first) / len(first) if first else None,
        "loss_end": sum(last) / len(last) if last else None,
        "samples_per_peer": {n: p.get("samples", 0) for n, p in peers.items()},
        "full_rounds_share": (sum(r["group_size"] >= r["swarm_peers"] for r in rounds) / len(rounds)) if rounds else None,
        "rounds": len(rounds),
        "checkpoint": str(checkpoint) if checkpoint else None,
    }


def write_samples(out: Path, per_prompt: int = 4, *, data: str | None = None) -> str | None:
    """A grid of samples from the latest checkpoint: one row per sample prompt of the run (for the
    shapes data: seen, then held out; for other data: captions, each after its real image). Where
    the data's judge knows a prompt's real picture (``reference(prompt)``: the emoji set's), it
    comes first in the row, framed."""
    from crowdtrain.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(out / "run" / "checkpoints")
    if checkpoint is None:
        logger.warning("no checkpoint was written (the run was too short): no samples")
        return None
    import torch
    from PIL import Image

    from crowdtrain.data.generate import Generator, make_grid
    from crowdtrain.data.judges import judge_for_data
    from crowdtrain.data.sample_prompts import reference_codes, shapes_prompts
    from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

    spec = json.loads((out / "run" / "coordinator.json").read_text())
    prompts = spec.get("sample_prompts") or shapes_prompts()
    gen = Generator.from_checkpoint(checkpoint)
    cfg = gen.model.config
    judge = judge_for_data(data) if data is not None else None
    real_picture = getattr(judge, "reference", None)
    rows = []
    with_reference = real_picture is not None or any(p.get("reference") is not None for p in prompts)
    for i, p in enumerate(prompts):
        images = gen.sample(p["prompt"], per_prompt, top_k=DEFAULT_TOP_K, top_p=DEFAULT_TOP_P, temperature=1.0,
                            seed=i)[1]
        if with_reference:  # every row gets a first column: the real image, or a blank tile
            codes = reference_codes(p.get("reference"), cfg)
            if codes is not None:
                real = gen.image_tokenizer.decode(codes.to(gen.device)).cpu()
            elif real_picture is not None:
                real = torch.from_numpy(real_picture(p["prompt"]).copy())[None].to(images.dtype)
            else:
                real = torch.full_like(images[:1], 255)
            for edge in (real[:, 0], real[:, -1], real[:, :, 0], real[:, :, -1]):
                edge[:] = torch.tensor([70, 70, 70], dtype=real.dtype)  # a frame: the real one
            images = torch.cat([real, images])
        rows.append(images)
    grid = make_grid(torch.cat(rows), columns=per_prompt + with_reference)
    grid = grid.resize((grid.width * 3, grid.height * 3), Image.NEAREST)
    path = out / "samples.png"
    grid.save(path)
    lines = [f"[{p['tag']}] {p['prompt']}" if p.get("tag") else p["prompt"] for p in prompts]
    head = "rows, top to bottom" + (" (the first column, framed: the real picture with that caption)"
                                    if with_reference else "")
    (out / "samples.txt").write_text(head + ":\n" + "\n".join(lines) + "\n")
    return str(path)


def print_summary(s: dict) -> None:
    print("\n=== demo finished ===")
    print(f"epochs reached       {s['epochs']}")
    if s["loss_start"] is not None:
        print(f"loss                 {s['loss_start']:.4f} -> {s['loss_end']:.4f}")
    for name, n in s["samples_per_peer"].items():
        print(f"samples from {name:<8}{n}")
    if s["full_rounds_share"] is not None:
        print(f"rounds with all live peers  {100 * s['full_rounds_share']:.0f}% of {s['rounds']}")
    if s.get("held_out_losses"):
        print("held-out loss        " + ", ".join(f"{k} {v:.4f}" for k, v in s["held_out_losses"].items()))
    elif s.get("valid_loss") is not None:
        print(f"held-out loss        {s['valid_loss']:.4f}")
    if s.get("adherence_seen") is not None:
        print(f"prompt adherence     {s['adherence_seen']:.2f} seen, {s['adherence_heldout']:.2f} held-out "
              f"({s['eval_samples_per_prompt']} samples per prompt, the {s.get('judge')} judge)")
    for group, checks in (s.get("adherence_groups") or {}).items():
        detail = ", ".join(f"{k} {v:.2f}" for k, v in checks.items() if k not in ("samples", "adherence"))
        if detail:
            print(f"  {group:<18} {detail}")
    print(f"checkpoint           {s['checkpoint']}")
    print(f"samples              {s['samples_grid']}  (prompts in samples.txt)")


def run_local_demo(*, minutes: float, out_dir: str, device: str, batch_size: int, data: str = "shapes",
                   data_options: dict | None = None) -> dict:
    """The single-process variant (`crowdtrain demo --local`)."""
    from crowdtrain.data import default_asset_paths, ensure_demo_shards
    from crowdtrain.model.config import get_preset
    from crowdtrain.train.local import LocalTrainConfig, train_local
    from crowdtrain.train.task import DalleTask

    if data == "emoji":
        from crowdtrain.data.emoji import emoji_tokenizers, ensure_emoji_shards
        from crowdtrain.data.image_tokenizer import load_image_tokenizer

        shards = ensure_emoji_shards(Path(out_dir) / "data" / "emoji", progress=True, **(data_options or {}))
        paths = emoji_tokenizers(shards)
        # The model draws the learned tokenizer's codes, not the shapes palette's.
        config = get_preset("demo", image_vocab_size=load_image_tokenizer(paths["image"]).vocab_size,
                            image_code_factors=None)
        task = DalleTask(config, data=str(shards), text_tokenizer=paths["text"])
        assets = {"text_tokenizer.json": paths["text"], "image_tokenizer.safetensors": paths["image"]}
    else:
        shards = ensure_demo_shards(Path(out_dir) / "data" / "shapes")
        task, assets = DalleTask(get_preset("demo"), data=str(shards)), default_asset_paths()
    summary = train_local(task, LocalTrainConfig(batch_size=batch_size, max_minutes=minutes, max_steps=100_000,
                                                 device=device, out_dir=out_dir, lr=3e-3),
                          assets=assets)
    print(f"\nloss {summary['loss_start']:.4f} -> {summary['loss_end']:.4f} in {summary['steps']} steps; "
          f"checkpoint {summary['checkpoint']}")
    return summary
