"""Data: tokenisers, a tokenised corpus on disk, fixed-length samples and samplers."""

from fxmeg.data.corpus import Corpus, prepare
from fxmeg.data.samples import Samples, Sampler
from fxmeg.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "Corpus", "Sampler", "Samples", "load_tokenizer", "prepare"]
