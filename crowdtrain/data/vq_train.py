"""Train the small VQ image tokenizer on a folder of images (``crowdtrain tokenizer train``).

Deterministic: the same images, seed, steps, torch build and thread count give the same file.
Every 20th image (in sorted path order) is held out for the reconstruction report, which is
stored in the tokenizer file's metadata and printed:

- ``mse``: mean squared error per pixel channel on a 0..1 scale, ``psnr_db`` from it;
- ``codes_used``: distinct codes the held-out images use, of ``codebook_size``;
- ``shapes_agreement`` (when the captions are shapes captions): share of reconstructions in
  which the shapes analyser still finds exactly what the caption says. This is the number that
  matters for the demo: a tokenizer that blurs a triangle into a square caps prompt adherence.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from crowdtrain.data.config import VQTrainConfig
from crowdtrain.data.image_tokenizer import SmallVQ
from crowdtrain.data.image_tokenizer_base import images_to_float

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def load_image_folder(directory, image_size: int, *, limit: int | None = None) -> tuple[np.ndarray, list[str]]:
    """All images under ``directory`` (sorted), centre-cropped and resized to image_size -> (N, S, S, 3) uint8,
    with their captions (the sibling ``.txt``, or '' when missing)."""
    from PIL import Image

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--data {directory} is not a folder of images; make one with "
                                "`crowdtrain data shapes --out DIR`")
    paths = sorted(p for p in directory.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)[:limit]
    if not paths:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {directory}")
    images, captions = [], []
    for p in paths:
        with Image.open(p) as im:
            images.append(np.asarray(fit_image(im, image_size)))
        txt = p.with_suffix(".txt")
        captions.append(txt.read_text().strip() if txt.exists() else "")
    return np.stack(images), captions


def fit_image(im, size: int):
    """Centre-crop to a square and resize to size x size RGB (no-op for images already that size)."""
    from PIL import Image

    im = im.convert("RGB")
    w, h = im.size
    if (w, h) == (size, size):
        return im
    s = min(w, h)
    im = im.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s))
    return im.resize((size, size), Image.BICUBIC)


class TrainingInterrupted(Exception):
    """Ctrl-C (or SIGTERM) during ``train_vq`` with a resume file: the state is saved there."""


def resume_path_for(out) -> Path:
    """Where ``crowdtrain tokenizer train --out OUT`` keeps its resumable state while it runs."""
    out = Path(out)
    return out.with_name(out.name + ".resume.safetensors")


def _save_resume(path: Path, config: VQTrainConfig, n_images: int, step: int, model, opt, sched, gen) -> None:
    import dataclasses

    from safetensors.torch import save_file

    from crowdtrain.checkpoint import flatten_optimizer_state

    tensors, opt_meta = flatten_optimizer_state(opt.state_dict())
    tensors = {f"opt/{k}": v.contiguous() for k, v in tensors.items()}
    tensors.update({f"model/{k}": v.contiguous() for k, v in model.state_dict().items()})
    tensors["generator"] = gen.get_state()
    meta = {"config": json.dumps(dataclasses.asdict(config)), "images": str(n_images), "step": str(step),
            "optimizer": json.dumps(opt_meta), "scheduler": json.dumps(sched.state_dict())}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # a kill while writing leaves the previous resume file whole


def _load_resume(path: Path, config: VQTrainConfig, n_images: int, model, opt, sched, gen) -> int:
    import dataclasses

    from safetensors import safe_open

    from crowdtrain.checkpoint import unflatten_optimizer_state

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        saved = json.loads(meta["config"])
    except Exception as e:  # a file cut short by a full disk, or not ours
        raise ValueError(f"{path} (an interrupted training's state) cannot be read ({type(e).__name__}: {e}); "
                         f"delete it to start afresh") from e
    ours = json.loads(json.dumps(dataclasses.asdict(config)))
    if saved != ours or int(meta["images"]) != n_images:
        changed = sorted(k for k in ours if saved.get(k) != ours[k])
        what = f"settings {changed}" if changed else f"{meta['images']} images, now {n_images}"
        raise ValueError(f"{path} holds an interrupted training with other {what}: run the same command as "
                         f"before to continue it, or delete {path} to start afresh")
    model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    opt.load_state_dict(unflatten_optimizer_state({k[len("opt/"):]: v for k, v in tensors.items()
                                                   if k.startswith("opt/")}, json.loads(meta["optimizer"])))
    sched.load_state_dict(json.loads(meta["scheduler"]))
    gen.set_state(tensors["generator"])
    return int(meta["step"])


def train_vq(images: np.ndarray, config: VQTrainConfig, *, progress: bool = True, resume_path=None,
             save_every_s: float = 120.0, stop_after_steps: int | None = None) -> SmallVQ:
    """Train a :class:`SmallVQ` on (N, S, S, 3) uint8 images.

    With ``resume_path`` the state (model, optimizer, schedule, random generator) is saved there
    every ``save_every_s`` and on Ctrl-C or SIGTERM (then :class:`TrainingInterrupted` is raised
    after the step in progress), and a later call with the same images and config continues
    from it, as if never stopped; the file is removed once training ends.
    ``stop_after_steps`` stops as an interrupt would after that many steps (tests).
    """
    import signal
    import threading

    from tqdm import tqdm

    torch.manual_seed(config.seed)
    model = SmallVQ(image_size=config.image_size, patch=config.patch, channels=config.channels, codebook_size=config.codebook_size,
                    codebook_dim=config.codebook_dim)
    gen = torch.Generator().manual_seed(config.seed)
    data = torch.from_numpy(images)
    # Start the codebook on real encodings (k-means++ lite): fewer dead codes from step 0.
    with torch.no_grad():
        pick = torch.randint(len(data), (min(len(data), 256),), generator=gen)
        z = model.encoder(images_to_float(data[pick])).permute(0, 2, 3, 1).reshape(-1, config.codebook_dim)
        init = z[torch.randint(len(z), (config.codebook_size,), generator=gen)]
        model.codebook.copy_(init)
        model.ema_sum.copy_(init)
    params = list(model.encoder.parameters()) + list(model.decoder.parameters())
    opt = torch.optim.Adam(params, lr=config.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / config.steps)))
    resume_path = Path(resume_path) if resume_path is not None else None
    start = 0
    if resume_path is not None and resume_path.is_file():
        start = _load_resume(resume_path, config, len(images), model, opt, sched, gen)
        logger.info("continuing the interrupted training in %s from step %d of %d", resume_path, start, config.steps)
    # A signal ends the loop after the step in progress, so what is saved is one whole step. The
    # handler only sets a flag: one that took a lock (threading.Event.set) would deadlock when a
    # second signal arrives inside it (crowdtrain.lifecycle.on_signals says more).
    stop = {"requested": False}

    def request_stop(signum, frame):
        stop["requested"] = True

    previous = {}
    if resume_path is not None and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, request_stop)
    model.train()
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc="train vq", unit="step",
               disable=not progress)
    t0 = last_save = time.monotonic()
    step = start
    try:
        for step in bar:
            batch = images_to_float(data[torch.randint(len(data), (config.batch_size,), generator=gen)])
            recon, commit, _ = model(batch, generator=gen, dead_code_steps=config.dead_code_steps)
            # L1 rather than MSE: the median of plausible pixels keeps edges sharp where MSE blurs them.
            rec_loss = F.l1_loss(recon, batch)
            loss = rec_loss + config.commitment * commit
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 50 == 0 or step == config.steps - 1:
                # The running reconstruction error, as mean absolute error on a 0..255 scale.
                bar.set_postfix(err=f"{rec_loss.item() * 127.5:.1f}/255", commit=f"{commit.item():.4f}")
            done = step + 1
            if stop_after_steps is not None and done - start >= stop_after_steps:
                stop["requested"] = True
            if resume_path is not None and (stop["requested"] or time.monotonic() - last_save > save_every_s):
                _save_resume(resume_path, config, len(images), done, model, opt, sched, gen)
                last_save = time.monotonic()
            if stop["requested"] and done < config.steps:
                bar.close()
                raise TrainingInterrupted(f"stopped at step {done} of {config.steps}; the state is in {resume_path}: "
                                          "run the same command again to continue")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("trained %d steps in %.0f s", config.steps - start, time.monotonic() - t0)
    if resume_path is not None:
        resume_path.unlink(missing_ok=True)
    return model.eval()


@torch.no_grad()
def reconstruction_report(model, images: np.ndarray, captions: list[str] | None = None, *, batch_size: int = 128) -> dict:
    """Reconstruction error of ``model`` on (N, S, S, 3) uint8 images (see the module docstring)."""
    from crowdtrain.data import shapes

    mse_sum, used, agree, judged = 0.0, torch.zeros(model.vocab_size, dtype=torch.long), 0, 0
    for i in range(0, len(images), batch_size):
        chunk = images[i: i + batch_size]
        codes = model.encode(chunk)
        recon = model.decode(codes)
        mse_sum += ((recon.float() - torch.from_numpy(chunk).float()) / 255).pow(2).mean(dim=(1, 2, 3)).sum().item()
        used += torch.bincount(codes.flatten(), minlength=model.vocab_size)
        for j, caption in enumerate((captions or [])[i: i + batch_size]):
            scene = shapes.parse_caption(caption)
            if scene is not None:
                judged += 1
                agree += shapes.judge(scene, shapes.analyse_image(recon[j].numpy()))["all"]
    mse = mse_sum / len(images)
    p = used.float() / used.sum()
    report = {
        "images": int(len(images)),
        "mse": round(mse, 6),
        "psnr_db": round(10 * math.log10(1 / max(mse, 1e-12)), 2),
        "codes_used": int((used > 0).sum()),
        "codebook_size": int(model.vocab_size),
        "perplexity": round(float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum())), 1),
    }
    if judged:
        report["shapes_agreement"] = round(agree / judged, 4)
    return report


def split_holdout(n: int, every: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, held-out): every ``every``-th image is held out for the report."""
    idx = np.arange(n)
    held = idx % every == every - 1
    return idx[~held], idx[held]
