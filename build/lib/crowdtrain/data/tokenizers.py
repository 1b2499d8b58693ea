"""Text tokenizer (HF ``tokenizers``) and the shipped defaults for the shapes data set.

The text tokenizer is any ``tokenizer.json``: the BPE one this project trains on captions
(``crowdtrain tokenizer train-text``) or another, such as T5's, which the paper used. The model
treats id 0 as padding (``ModelConfig.text_pad_id``), so a tokenizer must have its padding
token at id 0: our BPE reserves ``[PAD]`` = 0 and ``[UNK]`` = 1; T5's ``<pad>`` is 0 too.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHAPES_TEXT_TOKENIZER = ASSETS / "shapes_text_tokenizer.json"
# The shapes data's tokenizer: a palette-and-mask code per 8x8 patch, exact on those pictures
# (crowdtrain.data.palette_tokenizer). The learned VQ it replaced stays as an example of
# `crowdtrain tokenizer train`'s output ("shapes-vq"): 0.95 read-back, and codes that tie colour to shape.
SHAPES_IMAGE_TOKENIZER = ASSETS / "shapes_palette.safetensors"
SHAPES_VQ_TOKENIZER = ASSETS / "shapes_vq.safetensors"

PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "[pad]")


class TextTokenizer:
    """Captions -> fixed-length id rows for the model (padded with 0, truncated to ``text_len``)."""

    def __init__(self, tokenizer, *, source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.source = source
        pad = next((t for t in PAD_TOKENS if tokenizer.token_to_id(t) is not None), None)
        if pad is None or tokenizer.token_to_id(pad) != 0:
            raise ValueError(f"text tokenizer {source}: the model pads with id 0, but the tokenizer's padding token "
                             f"({pad or 'none of ' + str(PAD_TOKENS)}) is not id 0; retrain it with "
                             "`crowdtrain tokenizer train-text` or pick one whose <pad> is 0 (e.g. T5's)")
        self.pad_id = 0
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, captions: list[str], length: int):
        """(B,) captions -> (B, length) LongTensor, right-padded with 0 and truncated."""
        import torch

        out = torch.zeros(len(captions), length, dtype=torch.long)
        for i, enc in enumerate(self.tokenizer.encode_batch(list(captions), add_special_tokens=False)):
            ids = enc.ids[:length]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) != self.pad_id])

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        return path


def load_text_tokenizer(path) -> TextTokenizer:
    """Load any HF ``tokenizer.json`` (a file, or a folder containing one)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"text tokenizer {path} does not exist; train one with "
                                "`crowdtrain tokenizer train-text --data DIR --out FILE`")
    return TextTokenizer(Tokenizer.from_file(str(path)), source=str(path))


def train_text_tokenizer(captions: list[str], *, vocab_size: int = 1024, min_frequency: int = 2,
                         out=None) -> TextTokenizer:
    """Train a lower-casing BPE tokenizer on captions; the same captions always give the same file.

    Words are split on whitespace and punctuation and merged from characters; ``</w>`` marks
    word ends so decoding restores spaces. The merges are learnt here, greedily by pair count
    with ties broken by the pair's text: ``tokenizers``' own BpeTrainer breaks ties by hash
    order, which changes from run to run, and the shipped tokenizer must be reproducible. The
    result is a plain ``tokenizers`` BPE model. This learner is meant for caption sets of up to
    about 10^5 distinct words; for web-scale text use an existing tokenizer (T5's, as the paper).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if not captions:
        raise ValueError("no captions to train the text tokenizer on")
    specials = ["[PAD]", "[UNK]"]
    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()])
    pre_tokenizer = pre_tokenizers.Whitespace()
    counts: Counter = Counter()
    for caption in captions:
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(caption)))
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): c for w, c in counts.items()}
    vocab = specials + sorted({sym for w in words for sym in w})
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < min_frequency:
            break
        merges.append(best)
        joined = best[0] + best[1]
        vocab.append(joined)
        words = {_merge(w, best, joined): c for w, c in words.items()}
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, unk_token="[UNK]",
                               end_of_word_suffix="</w>"))
    tok.add_special_tokens(specials)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    result = TextTokenizer(tok)
    if out is not None:
        result.save(out)
        result.source = str(out)
    return result


def _merge(word: tuple[str, ...], pair: tuple[str, str], joined: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def read_captions(source) -> list[str]:
    """Captions from a folder: the ``.txt`` files (sorted), or the caption column of ``*.parquet`` shards."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"--data {source} does not exist")
    parquets = sorted(source.rglob("*.parquet")) if source.is_dir() else [source] if source.suffix == ".parquet" else []
    if parquets:
        import pyarrow.parquet as pq
        return [c for p in parquets for c in pq.read_table(p, columns=["caption"]).column("caption").to_pylist() if c]
    texts = sorted(source.rglob("*.txt")) if source.is_dir() else [source]
    captions = [t.read_text().strip() for t in texts]
    captions = [c for c in captions if c]
    if not captions:
        raise ValueError(f"no captions found in {source} (expected .txt files or parquet shards with a caption column)")
    return captions


def default_text_tokenizer() -> TextTokenizer:
    """The BPE tokenizer shipped for the shapes data set."""
    return load_text_tokenizer(SHAPES_TEXT_TOKENIZER)


def default_image_tokenizer(device: str = "cpu"):
    """The tokenizer shipped for the shapes data set (64x64 -> 8x8 codes of 256 masks x 5 colours)."""
    from crowdtrain.data.image_tokenizer import load_image_tokenizer

    return load_image_tokenizer(SHAPES_IMAGE_TOKENIZER, device=device)


def default_asset_paths() -> dict[str, Path]:
    """The shipped tokenizers under their checkpoint file names (``save_checkpoint(assets=...)``)."""
    return {"text_tokenizer.json": SHAPES_TEXT_TOKENIZER, "image_tokenizer.safetensors": SHAPES_IMAGE_TOKENIZER}


def resolve_image_tokenizer(spec: str, device: str = "cpu"):
    """'shapes' -> the shipped tokenizer, 'shapes-vq' the learned VQ for the same pictures;
    anything else is a path for ``load_image_tokenizer``."""
    from crowdtrain.data.image_tokenizer import load_image_tokenizer

    if spec == "shapes":
        return default_image_tokenizer(device)
    if spec == "shapes-vq":
        return load_image_tokenizer(SHAPES_VQ_TOKENIZER, device=device)
    return load_image_tokenizer(spec, device=device)
