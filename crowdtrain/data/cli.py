"""Data commands: `data shapes|prepare|serve`, `tokenizer train|train-text|convert`, `generate`, `eval`."""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger(__name__)


def _sampling_flags(p) -> None:
    """--top-k / --top-p: neither given samples with the one default filter
    (crowdtrain.model.config.DEFAULT_TOP_K / DEFAULT_TOP_P); one given uses only that one; both
    given apply top-k, then the nucleus of its survivors."""
    from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

    default = f"top-k {DEFAULT_TOP_K}" if DEFAULT_TOP_K else f"top-p {DEFAULT_TOP_P}"
    p.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k most likely codes (0: no top-k; the paper: 256); given alone it replaces the "
                        f"default filter; default when neither flag is given: {default}")
    p.add_argument("--top-p", type=float, default=None,
                   help="keep the smallest set of codes whose probability reaches p (the paper: 0.75); "
                        "with --top-k both apply, top-k first")


def _resolved_filters(args) -> tuple:
    from crowdtrain.model.config import sampling_filters

    return sampling_filters(args.top_k, args.top_p)


def register(subparsers) -> None:
    # ---- crowdtrain data ... ----------------------------------------------------------------
    data = subparsers.add_parser("data", help="make, prepare and serve data sets",
                                 description="Make the bundled shapes data set, turn images and captions "
                                             "into streamed shards of image codes, serve shards over HTTP.")
    dsub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")

    p = dsub.add_parser("shapes", help="generate the bundled shapes data set (PNG + .txt captions)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num", type=int, default=10000, help="number of images (default: 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--heldout", choices=["exclude", "only", "any"], default="exclude",
                   help="held-out compositions: exclude (training data, default), only (a test set), any")
    p.set_defaults(handler=_shapes)

    p = dsub.add_parser("emoji", help="draw the emoji data set: real pictures with captions (PNG + .txt)",
                        description="Draw emoji that take a skin tone (Debian's fonts-noto-color-emoji, rendered "
                                    "with Pillow) at random sizes and places on 64x64 white frames, captioned from "
                                    "their Unicode names ('waving hand, medium skin tone'), into OUT/train, "
                                    "OUT/valid and OUT/heldout (each base's held-out tone, never in train), with "
                                    "OUT/sample_prompts.txt (the judge's prompts, held-out ones tagged). "
                                    "`crowdtrain demo --data emoji` makes the same set into shards itself.")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--bases", default="hands",
                   help="which emoji: groups from hands, people, activities joined with '+', or 'all' "
                        "(default: hands, 46 bases)")
    p.add_argument("--max-bases", type=int, default=None,
                   help="keep this many of those emoji, spread evenly over them (a smaller set)")
    p.add_argument("--renderings", type=int, default=100,
                   help="pictures per seen composition in train (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="random seed: held-out tones and jitter (default: 0)")
    p.set_defaults(handler=_emoji)

    p = dsub.add_parser("prepare", help="images + captions -> brotli parquet shards of image codes",
                        description="Encode images with an image tokenizer and write shards (caption, code as "
                                    "int16 bytes, original_width/height, NSFW, url). Resumable: run the same "
                                    "command again after an interrupt.")
    p.add_argument("--input", required=True,
                   help="a folder of images with .txt captions, a webdataset .tar, or a .parquet of image bytes "
                        "and captions")
    p.add_argument("--out", required=True, help="shard folder")
    p.add_argument("--image-tokenizer", default="shapes-vq",
                   help="'shapes-vq' (the shipped learned VQ: 64x64 pictures to 8x8 codes of 512), 'shapes' (the "
                        "shapes data's palette codes: flat pictures in its five colours only), a .safetensors file "
                        "or a taming .ckpt (default: shapes-vq)")
    p.add_argument("--split", default="train", help="split name, the shards' file prefix (default: train)")
    p.add_argument("--shard-size", type=int, default=5000, help="input items per shard (default: 5000)")
    p.add_argument("--batch-size", type=int, default=64, help="images encoded at once (default: 64)")
    p.add_argument("--nsfw-default", default="UNLIKELY",
                   help="safety flag for inputs that carry none (default: UNLIKELY = safe, as LAION's NSFW column)")
    p.add_argument("--text-tokenizer", default=None, metavar="FILE",
                   help="the run's text tokenizer, to check the captions fit the model (how many are cut, which "
                        "words it does not know); default: the shipped one, which knows the shapes captions only")
    p.add_argument("--preset", default="demo",
                   help="model preset whose text length the captions are checked against (default: demo)")
    p.add_argument("--text-len", type=int, default=None,
                   help="the model's text length in tokens, if the run sets one (--model text_len=N)")
    p.set_defaults(handler=_prepare)

    p = dsub.add_parser("serve", help="serve a shard folder over HTTP (with Range requests)")
    p.add_argument("directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8008)
    p.set_defaults(handler=_serve)

    data.set_defaults(handler=lambda args: data.print_help() or 2)

    # ---- crowdtrain tokenizer ... -----------------------------------------------------------
    tok = subparsers.add_parser("tokenizer", help="train or convert image and text tokenizers")
    tsub = tok.add_subparsers(dest="tokenizer_command", metavar="TOKENIZER_COMMAND")
    p = tsub.add_parser("train", help="train the small VQ image tokenizer on a folder of images (CPU)",
                        description="Train a small VQ-VAE image tokenizer; prints and stores its reconstruction "
                                    "error. Defaults reproduce the shipped shapes tokenizer from "
                                    "`crowdtrain data shapes --out DIR --num 10000 --seed 0`.")
    p.add_argument("--data", required=True, help="folder of images (with .txt captions for the shapes report)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    from crowdtrain.data.config import VQTrainConfig
    d = VQTrainConfig()
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--patch", type=int, default=d.patch, help="pixel block size of the first stage")
    p.add_argument("--channels", default=",".join(map(str, d.channels)), help="channels per stage, comma separated")
    p.add_argument("--codebook-size", type=int, default=d.codebook_size)
    p.add_argument("--codebook-dim", type=int, default=d.codebook_dim)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--limit", type=int, default=None, help="use only the first N images")
    p.set_defaults(handler=_tokenizer_train)

    p = tsub.add_parser("train-text", help="train a BPE text tokenizer on captions",
                        description="Train a byte-pair-encoding tokenizer (HF tokenizers) on captions: the .txt "
                                    "files in a folder or the caption column of parquet shards. Id 0 is padding.")
    p.add_argument("--data", required=True, help="folder of .txt captions or of parquet shards")
    p.add_argument("--out", required=True, help="output tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.set_defaults(handler=_tokenizer_train_text)

    p = tsub.add_parser("convert", help="convert a taming-transformers VQGAN checkpoint to one .safetensors file")
    p.add_argument("--taming", required=True, help="the .ckpt (e.g. vqgan_gumbel_f8_8192 last.ckpt)")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle the checkpoint fully (weights_only=False): only for files you trust")
    p.add_argument("--image-size", type=int, default=256,
                   help="resolution images are resized to before encoding (default: 256, a 32x32 grid at f=8)")
    p.set_defaults(handler=_tokenizer_convert)
    tok.set_defaults(handler=lambda args: tok.print_help() or 2)

    # ---- crowdtrain generate / eval ---------------------------------------------------------
    p = subparsers.add_parser("generate", help="sample images for prompts, re-rank, write a PNG grid",
                              description="Sample --num-samples images per prompt, decode them, re-rank with CLIP "
                                          "(--clip DIR) or without (the model's own likelihood of each sample), "
                                          "and write the best --keep of each as one PNG grid: a row per prompt, "
                                          "labelled with it when there are several.")
    p.add_argument("prompt", nargs="*", help="the caption to draw (or give --prompts FILE)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="more prompts, one a line (blank lines and # comments skipped; '[tag] prompt' shows the "
                        "tag in the label), drawn after the positional one, each as a row of the grid")
    p.add_argument("--labels", action=argparse.BooleanOptionalAction, default=None,
                   help="write each row's prompt on its left (default: when there are several prompts)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--num-samples", type=int, default=128, help="samples drawn per prompt (default: 128)")
    p.add_argument("--keep", type=int, default=4, help="best samples kept per prompt (default: 4)")
    _sampling_flags(p)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="samples drawn at once")
    p.add_argument("--rerank", choices=["auto", "clip", "likelihood", "none"], default="auto",
                   help="auto: clip when --clip is given, else likelihood (default: auto)")
    p.add_argument("--clip", default=None, help="local directory of a transformers CLIP model (e.g. ViT-B/32)")
    p.add_argument("--out", default="grid.png", help="output PNG (default: grid.png)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(handler=_generate)

    p = subparsers.add_parser("eval", help="held-out loss per split of a checkpoint, and prompt adherence where the "
                                           "data has a judge",
                              description="The checkpoint's mean loss on every split of the run's shards but "
                                          "train (e.g. valid, heldout), and, only for data with an automatic "
                                          "judge (the bundled shapes), the share of samples that follow the "
                                          "judge's seen and held-out prompts.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--data", default=None, metavar="SHARDS",
                   help="the shards to evaluate on: a folder made by `crowdtrain data prepare` or its URL "
                        "(default: the data the checkpoint's run recorded, e.g. its coordinator's /shards)")
    p.add_argument("--pin", default=None, metavar="SHA256:...",
                   help="when the data is a coordinator's (https://HOST/shards): the fingerprint of its key, which "
                        "every held-out shard is checked against before use (default: the key this machine "
                        "remembers for that address)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N",
                   help="at most N rows per split, the first N of the fixed evaluation order (default: all; 512 "
                        "gives the rows the coordinator's validation loss uses)")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    _sampling_flags(p)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--device", default="cpu")
    p.set_defaults(handler=_eval)


# ---- handlers (heavy imports inside) ----------------------------------------------------------

def _shapes(args) -> int:
    from crowdtrain.data.shapes import write_shapes_folder

    heldout = {"exclude": False, "only": True, "any": None}[args.heldout]
    if args.num <= 0:
        raise ValueError("--num must be positive")
    write_shapes_folder(args.out, num=args.num, seed=args.seed, heldout=heldout)
    print(f"wrote {args.num} images with captions to {args.out}")
    return 0


def _emoji(args) -> int:
    from crowdtrain.data.emoji import EmojiFont, make_emoji_set, write_emoji_folder
    from crowdtrain.data.emoji_judge import EmojiJudge, write_prompt_file

    font = EmojiFont()
    emoji_set = make_emoji_set(font, bases=args.bases, max_bases=args.max_bases, renderings=args.renderings,
                               seed=args.seed)
    counts = write_emoji_folder(args.out, emoji_set, font, progress=True)
    prompts = write_prompt_file(EmojiJudge(emoji_set, font), f"{args.out}/sample_prompts.txt")
    seen, heldout = emoji_set.compositions
    print(f"wrote {', '.join(f'{n} {split}' for split, n in counts.items())} pictures with captions to {args.out}: "
          f"{len(emoji_set.bases)} emoji x 6 tones, {len(seen)} seen and {len(heldout)} held-out compositions; "
          f"sample prompts in {prompts}")
    print(f"next: crowdtrain tokenizer train --data {args.out}/train --out vq.safetensors --steps 3000, "
          f"then `crowdtrain data prepare --input {args.out}/SPLIT --split SPLIT --image-tokenizer vq.safetensors` "
          "for each split (docs/organize-a-run.md)")
    return 0


def _prepare(args) -> int:
    from crowdtrain.data.captions import caption_report, format_caption_report, split_captions
    from crowdtrain.data.shards import format_fit_report, prepare_shards, tokenizer_fit_report
    from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER, load_text_tokenizer, resolve_image_tokenizer
    from crowdtrain.model.config import get_preset

    # Before the long encoding pass: a wrong flag is said at once.
    text_len = args.text_len if args.text_len is not None else get_preset(args.preset).text_len
    if text_len < 1:
        raise ValueError(f"--text-len must be >= 1, got {text_len}")
    text_tokenizer = load_text_tokenizer(args.text_tokenizer or SHAPES_TEXT_TOKENIZER)
    tokenizer = resolve_image_tokenizer(args.image_tokenizer)
    summary = prepare_shards(args.input, args.out, tokenizer, split=args.split, shard_size=args.shard_size,
                             batch_size=args.batch_size, nsfw_default=args.nsfw_default)
    print(summary.format())
    print(format_fit_report(tokenizer_fit_report(args.input, tokenizer, args.out, split=args.split),
                            args.image_tokenizer))
    report = caption_report(split_captions(args.out, args.split), text_tokenizer, text_len)
    print(format_caption_report(
        report, tokenizer_name=args.text_tokenizer or "(the shipped shapes tokenizer)",
        text_len_from=f"--text-len {text_len}" if args.text_len is not None else f"the {args.preset} preset's text_len"))
    return 0


def _serve(args) -> int:
    import time

    from crowdtrain.data.http_server import serve_directory

    server = serve_directory(args.directory, host=args.host, port=args.port)
    print(f"serving {args.directory} at {server.url} (Ctrl-C to stop)")
    try:
        while True:
            time.sleep(3600)
    finally:
        server.close()


def _tokenizer_train(args) -> int:
    import torch

    from crowdtrain.data.config import VQTrainConfig
    from crowdtrain.data.vq_train import (TrainingInterrupted, load_image_folder, reconstruction_report,
                                          resume_path_for, split_holdout, train_vq)

    config = VQTrainConfig(image_size=args.image_size, patch=args.patch,
                           channels=tuple(int(c) for c in args.channels.split(",")),
                           codebook_size=args.codebook_size, codebook_dim=args.codebook_dim, steps=args.steps,
                           batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    logger.info("config: %s (torch threads: %d)", config, torch.get_num_threads())
    images, captions = load_image_folder(args.data, config.image_size, limit=args.limit)
    train_idx, held_idx = split_holdout(len(images))
    try:
        model = train_vq(images[train_idx], config, resume_path=resume_path_for(args.out))
    except TrainingInterrupted as e:
        print(e)
        return 130
    report = reconstruction_report(model, images[held_idx], [captions[i] for i in held_idx])
    report["train_images"] = int(len(train_idx))
    report["command"] = (f"crowdtrain tokenizer train --data DIR --steps {config.steps} --seed {config.seed} "
                         f"--channels {args.channels} --codebook-size {config.codebook_size}")
    model.save(args.out, report=report, half=True)
    print(f"wrote {args.out}")
    print("reconstruction on held-out images: " + json.dumps(report))
    return 0


def _tokenizer_train_text(args) -> int:
    from crowdtrain.data.tokenizers import read_captions, train_text_tokenizer

    captions = read_captions(args.data)
    tok = train_text_tokenizer(captions, vocab_size=args.vocab_size, out=args.out)
    print(f"wrote {args.out}: vocabulary {tok.vocab_size} from {len(captions)} captions")
    return 0


def _tokenizer_convert(args) -> int:
    from crowdtrain.data.vqgan import TamingVQGAN

    model = TamingVQGAN.from_checkpoint(args.taming, trust_checkpoint=args.trust_checkpoint,
                                        image_size=args.image_size)
    model.save(args.out)
    print(f"wrote {args.out}: {model.kind} {json.dumps(model.config_dict())}")
    return 0


def _generate(args) -> int:
    from crowdtrain.data.config import GenerateConfig
    from crowdtrain.data.generate import generate_rows, read_prompts_file

    entries = [{"prompt": " ".join(args.prompt), "tag": None}] if args.prompt else []
    if args.prompts:
        entries += read_prompts_file(args.prompts)
    if not entries:
        raise ValueError("give a prompt, e.g. crowdtrain generate --checkpoint CKPT \"a small red circle\", or a file "
                         "of prompts, one a line, with --prompts FILE")
    top_k, top_p = _resolved_filters(args)
    cfg = GenerateConfig(num_samples=args.num_samples, keep=args.keep, top_k=top_k, top_p=top_p,
                         temperature=args.temperature, seed=args.seed, batch_size=args.batch_size,
                         rerank=args.rerank, clip_dir=args.clip)
    labels = args.labels if args.labels is not None else len(entries) > 1
    if labels:
        labels = [f"[{e['tag']}] {e['prompt']}" if e.get("tag") else e["prompt"] for e in entries]
    result = generate_rows(args.checkpoint, [e["prompt"] for e in entries], cfg, out=args.out, labels=labels,
                           device=args.device, progress=True, say=lambda line: print(line, flush=True))
    rows = result["rows"]
    if len(rows) == 1:
        print(f"wrote {args.out}: best {len(rows[0]['scores'])} of {args.num_samples} by {result['reranker']} "
              f"(scores {', '.join(f'{s:.3f}' for s in rows[0]['scores'])})")
        return 0
    for row in rows:
        print(f"  {row['prompt'][:70]}: scores {', '.join(f'{s:.3f}' for s in row['scores'])}")
    print(f"wrote {args.out}: {len(rows)} rows, one per prompt, each the best {args.keep} of {args.num_samples} by "
          f"{result['reranker']}")
    return 0


def _eval(args) -> int:
    from crowdtrain.train.validate import evaluate_quality, format_quality

    if args.max_rows is not None and args.max_rows < 1:
        raise ValueError("--max-rows must be >= 1")
    top_k, top_p = _resolved_filters(args)
    from crowdtrain.checkpoint import read_meta
    from crowdtrain.train.validate import run_data

    data = run_data(args.checkpoint, read_meta(args.checkpoint), args.data)
    if data.startswith(("http://", "https://")) and data.rstrip("/").endswith("/shards"):
        from crowdtrain.remote import fetch_data

        from crowdtrain.runspec.trust import FileMismatch, UntrustedCoordinator

        # A coordinator's shards: its held-out splits, each file checked against its signed manifest.
        try:
            local = fetch_data(data, pin=args.pin)
        except (FileMismatch, UntrustedCoordinator):
            raise
        except ValueError as e:
            raise ValueError(f"the held-out shards of {data} cannot be fetched ({e}); pass the run's shards with "
                             "--data (a local shard folder made by `crowdtrain data prepare`)") from e
        print(f"held-out shards of {data}, checked against its coordinator's signed manifest, in {local}")
        data = str(local)
    results = evaluate_quality(args.checkpoint, data=data, max_rows=args.max_rows,
                               samples_per_prompt=args.samples_per_prompt, top_k=top_k, top_p=top_p,
                               temperature=args.temperature, seed=args.seed, device=args.device)
    print(format_quality(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
