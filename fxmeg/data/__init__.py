"""Data: tokenisers, Megatron's indexed format, its sample order and blends, and the
trainer's splits (fxmeg.data.megatron)."""

from fxmeg.data.corpus import Corpus, prepare
from fxmeg.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "Corpus", "load_tokenizer", "prepare"]
