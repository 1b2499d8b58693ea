"""Do the captions fit the model? ``data prepare``'s caption check.

The peers tokenize each caption with the run's text tokenizer and keep its first ``text_len``
tokens (``crowdtrain.data.tokenizers.TextTokenizer.encode_batch``, as ``crowdtrain.data.streaming``
calls it): what is past them is cut, silently, in every batch. And a tokenizer that does not know
a caption's words spells them out in pieces (or as ``[UNK]``), which both costs positions and
hides what the words mean. This counts both on a split's captions, the way the peers will see
them, and says what to change:

- captions cut: give the model more text positions (``--model text_len=N`` on the coordinator;
  the report names the N that keeps 95% and all of them whole) or shorten the captions;
- words the tokenizer does not know: train one on these captions (``crowdtrain tokenizer
  train-text``) and give it to the coordinator (``--text-tokenizer``). The shipped tokenizer knows
  only the ~100 words of the shapes captions.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

# A tokenizer trained on the captions spells out only their rarest words (a few percent of the
# words written); the shipped shapes tokenizer on other captions, most of them.
UNKNOWN_WORDS_WARN_SHARE = 0.1
WORD_MARKERS = ("", "</w>", "\u2581", "\u0120")  # whole-word tokens: plain, our BPE, SentencePiece, GPT-2
UNK_TOKENS = ("[UNK]", "<unk>", "<|unk|>")


def split_captions(out_dir, split: str) -> list[str]:
    """The captions of a split's shards, as written by ``data prepare`` (its manifest names them)."""
    import pyarrow.parquet as pq

    from crowdtrain.data.shards import read_manifest

    manifest = read_manifest(out_dir) or {}
    files = [Path(out_dir) / s["file"] for s in manifest.get("splits", {}).get(split, [])]
    return [c for f in files if f.is_file() for c in pq.read_table(f, columns=["caption"]).column("caption").to_pylist()
            if c]


def _words(tokenizer, caption: str) -> list[str]:
    """The caption's words as the tokenizer splits them before its model (its normalizer and
    pre-tokenizer), e.g. ``['a', 'red', 'circle']`` or SentencePiece's ``['\u2581a', ...]``."""
    text = tokenizer.normalizer.normalize_str(caption) if tokenizer.normalizer is not None else caption
    if tokenizer.pre_tokenizer is None:
        return text.split()
    return [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def caption_report(captions: list[str], text_tokenizer, text_len: int) -> dict:
    """How ``captions`` fit a model reading ``text_len`` tokens with ``text_tokenizer`` (a
    ``crowdtrain.data.tokenizers.TextTokenizer``): captions cut, lengths, unknown words."""
    tok = text_tokenizer.tokenizer
    encodings = tok.encode_batch(list(captions), add_special_tokens=False) if captions else []
    lengths = sorted(len(e.ids) for e in encodings)
    vocab = tok.get_vocab()
    unk_ids = {tok.token_to_id(t) for t in UNK_TOKENS} - {None}
    unknown: Counter = Counter()
    words = with_unk = 0
    for caption, encoding in zip(captions, encodings):
        with_unk += any(i in unk_ids for i in encoding.ids)
        for word in _words(tok, caption):
            words += 1
            if not any(word + m in vocab or m + word in vocab for m in WORD_MARKERS):
                unknown[word] += 1
    cut = sum(n > text_len for n in lengths)

    def percentile(q: float) -> int:
        return lengths[min(len(lengths) - 1, math.ceil(q * len(lengths)) - 1)] if lengths else 0

    return {"captions": len(captions), "text_len": text_len, "cut": cut, "longest": lengths[-1] if lengths else 0,
            "p95": percentile(0.95), "mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "words": words, "unknown_words": sum(unknown.values()), "distinct_unknown": len(unknown),
            "top_unknown": [w for w, _ in unknown.most_common(8)], "with_unk_token": with_unk}


def format_caption_report(report: dict, *, tokenizer_name: str, text_len_from: str) -> str:
    """The summary lines of :func:`caption_report`, with the fix for what does not fit."""
    n, limit = report["captions"], report["text_len"]
    if not n:
        return "captions: none to check"
    lines = [f"captions: {n} with the text tokenizer {tokenizer_name}: {report['mean']:.1f} tokens on average, "
             f"95% within {report['p95']}, the longest {report['longest']}; the model reads {limit} ({text_len_from})"]
    if report["cut"]:
        p95 = max(report["p95"], limit + 1)
        lengths = (f"`--model text_len={report['longest']}` (all of them whole)" if p95 >= report["longest"] else
                   f"`--model text_len={p95}` (keeps 95% whole) or `--model text_len={report['longest']}` (all)")
        lines.append(f"WARNING: {report['cut']} of {n} captions ({100 * report['cut'] / n:.1f}%) are longer than "
                     f"{limit} tokens and will be cut. Give the model more text positions on the coordinator, "
                     f"{lengths}, or shorten the captions")
    else:
        lines.append(f"no caption is cut at {limit} tokens")
    share = report["unknown_words"] / max(report["words"], 1)
    if report["with_unk_token"] or share > UNKNOWN_WORDS_WARN_SHARE:
        examples = ", ".join(repr(w) for w in report["top_unknown"])
        lines.append(f"WARNING: {100 * share:.0f}% of the caption words ({report['distinct_unknown']} distinct, e.g. "
                     f"{examples}) are not words the text tokenizer knows; it spells them out in pieces"
                     + (f" or as an unknown token ({report['with_unk_token']} captions)" if report["with_unk_token"]
                        else "")
                     + ", which costs text positions and hides what they mean. The shipped tokenizer knows only the "
                       "shapes captions' words: train one on yours, `crowdtrain tokenizer train-text --data DIR --out "
                       "my_text_tokenizer.json`, then check again with `--text-tokenizer my_text_tokenizer.json` and "
                       "give it to the coordinator (`--text-tokenizer`)")
    return "\n".join(lines)
