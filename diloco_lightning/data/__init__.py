"""Data: stdlib/text/pre-tokenized corpora, tokenizers, sharded token streams.

``TextDataModule`` (which imports Lightning) is loaded lazily; the rest is plain
torch/numpy/tokenizers.
"""

from __future__ import annotations

from diloco_lightning.data.corpus import DEFAULT_STDLIB_BYTES, CorpusFile, stdlib_corpus, text_corpus
from diloco_lightning.data.dataset import HeldOutDataset, ShardedTokenDataset, held_out_start
from diloco_lightning.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    BPETokenizer,
    ByteTokenizer,
    load_or_train_bpe,
    load_tokenizer,
    train_bpe,
)
from diloco_lightning.data.tokens import build_token_file, open_tokens

__all__ = [
    "DEFAULT_STDLIB_BYTES",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "BPETokenizer",
    "ByteTokenizer",
    "CorpusFile",
    "HeldOutDataset",
    "ShardedTokenDataset",
    "TextDataModule",
    "build_token_file",
    "held_out_start",
    "load_or_train_bpe",
    "load_tokenizer",
    "open_tokens",
    "stdlib_corpus",
    "text_corpus",
    "train_bpe",
]


def __getattr__(name: str):
    if name == "TextDataModule":
        from diloco_lightning.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module 'diloco_lightning.data' has no attribute {name!r}")
