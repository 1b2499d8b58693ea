"""What a checkpoint draws for the held-out colour-shape pairs (``crowdtrain eval``'s held-out prompts).

For every held-out object a sample should show (a red triangle, a green circle, ...), the shapes
analyser's reading of the sample falls in one of: both right; the right colour on another shape
(the colour word won, and the shape followed a pair seen in training); the right shape in another
colour; neither. Also, as a check that the image codes are not the obstacle: how often the codes of
held-out images occur in training images (the rarest code per held-out image). With the shapes
data's palette codes a held-out image does hold whole codes never in training (a red triangle's
tip), by design: what the factorised model needs is that each code's mask and its colour occur in
training, which ``factors`` reports.

    python benchmarks/bench_heldout.py CHECKPOINT [--samples 32] [--train-images 20000]

Writes ``benchmarks/results/bench_heldout.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"


def drawn(checkpoint: str, samples: int) -> dict:
    from crowdtrain.data import shapes
    from crowdtrain.data.generate import Generator

    gen = Generator.from_checkpoint(checkpoint, device="cpu")
    tally, objects = collections.Counter(), 0
    for j, prompt in enumerate(shapes.EVAL_PROMPTS_HELDOUT):
        scene = shapes.parse_caption(prompt)
        _, images = gen.sample(prompt, samples, seed=11 + j)  # the default sampling filter
        for image in images.numpy():
            found = shapes.analyse_image(image)
            for obj in scene.objects:
                if (obj.color, obj.shape) not in shapes.HELDOUT_PAIRS:
                    continue
                objects += 1
                same_shape = [d for d in found if d.shape == obj.shape]
                if any(d.color == obj.color for d in same_shape):
                    tally["both right"] += 1
                elif same_shape:
                    tally["right shape, other colour"] += 1
                elif any(d.color == obj.color for d in found):
                    tally["right colour, other shape"] += 1
                else:
                    tally["neither"] += 1
    return {"objects": objects, **{k: v / objects for k, v in sorted(tally.items())}}


def code_coverage(train_images: int, heldout_images: int = 1000) -> dict:
    import numpy as np

    from crowdtrain.data import shapes
    from crowdtrain.data.image_tokenizer import load_image_tokenizer
    from crowdtrain.data.tokenizers import SHAPES_IMAGE_TOKENIZER

    tokenizer = load_image_tokenizer(SHAPES_IMAGE_TOKENIZER)  # the demo data's shipped tokenizer

    def codes(num: int, seed: int, heldout: bool):
        rng = random.Random(seed)
        images = [shapes.render(shapes.random_scene(rng, heldout=heldout), rng) for _ in range(num)]
        return np.concatenate([tokenizer.encode(np.stack(images[i:i + 500])).numpy()
                               for i in range(0, num, 500)])

    train, held = codes(train_images, 1, False), codes(heldout_images, 7, True)
    counts = collections.Counter(train.ravel().tolist())
    rarest = np.array([min(counts[c] for c in image.ravel().tolist()) for image in held])
    result = {"train_images": train_images, "heldout_images": heldout_images,
              "heldout_images_with_a_code_never_in_training": float((rarest == 0).mean()),
              "rarest_code_count_percentiles": {str(q): float(np.percentile(rarest, q)) for q in (5, 25, 50)}}
    if getattr(tokenizer, "factors", None):  # code = mask * n_colours + colour
        n_colours = tokenizer.factors[1]
        masks, colours = set((train // n_colours).ravel().tolist()), set((train % n_colours).ravel().tolist())
        unseen = [any(m not in masks for m in (image // n_colours).ravel().tolist())
                  or any(c not in colours for c in (image % n_colours).ravel().tolist()) for image in held]
        result["factors"] = {"heldout_images_with_a_mask_or_colour_never_in_training": float(np.mean(unseen))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--samples", type=int, default=32, help="samples per held-out prompt")
    parser.add_argument("--train-images", type=int, default=20_000)
    parser.add_argument("--out", default=str(RESULTS / "bench_heldout.json"))
    args = parser.parse_args()
    result = {"checkpoint": args.checkpoint, "drawn": drawn(args.checkpoint, args.samples),
              "codes": code_coverage(args.train_images)}
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
