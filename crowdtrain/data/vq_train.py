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

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from crowdtrain.data.config import VQTrainConfig
from crowdtrain.data.image_tokenizer import SmallVQ, images_to_float

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


def train_vq(images: np.ndarray, config: VQTrainConfig, *, progress: bool = True) -> SmallVQ:
    """Train a :class:`SmallVQ` on (N, S, S, 3) uint8 images."""
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
    model.train()
    bar = tqdm(range(config.steps), desc="train vq", unit="step", disable=not progress)
    t0 = time.time()
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
            bar.set_postfix(l1=f"{rec_loss.item() / 2:.4f}", commit=f"{commit.item():.4f}")  # on a 0..1 scale
    logger.info("trained %d steps in %.0f s", config.steps, time.time() - t0)
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
