"""Megatron-format data: the time to build the sample order of a large indexed dataset,
fxmeg's numpy (fxmeg/data/gpt_order.py, fxmeg/data/blend.py) beside megatron-core's own
(its C++ helpers), and how fast samples are read against what a training step needs.
One JSON line.

The dataset: ``--tokens`` uint16 tokens in documents of 1 to 2000 tokens (random, seeded),
written once with fxmeg's writer. Timed: the order of one epoch's samples at ``--seq``
(document, sample and shuffle indices), and a blend of two copies at weights 0.3 / 0.7
for ``--samples`` samples; the same order through --data-cache-path (fxmeg/data/cache.py),
written by a first run and read by the next. Reading: samples per second of the trainer's own reader
(``TrainData.batch``, fxmeg/data/megatron.py: global batches of ``--gbs`` in stream order,
as int64 tensors, every token id checked).

    python bench/data.py [--tokens 100000000 --seq 2048 --samples 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fxmeg.data import cache  # noqa: E402
from fxmeg.data.blend import blending_indices  # noqa: E402
from fxmeg.data.gpt_order import build_order  # noqa: E402
from fxmeg.data.indexed import IndexedDataset, write_indexed  # noqa: E402
from fxmeg.data.megatron import DataPaths, TrainData, Vocabulary  # noqa: E402


def _documents(tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    left = tokens
    while left > 0:
        n = int(min(left, rng.integers(1, 2001)))
        left -= n
        yield rng.integers(0, 65000, size=n, dtype=np.uint16)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--samples", type=int, default=200_000, help="samples of the blend")
    p.add_argument("--read", type=int, default=2048, help="samples read for the loader's rate")
    p.add_argument("--gbs", type=int, default=32, help="samples per read (a global batch)")
    args = p.parse_args()
    out = {"tokens": args.tokens, "seq": args.seq}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "data")
        t0 = time.perf_counter()
        documents, _ = write_indexed(prefix, _documents(args.tokens), np.uint16)
        out["documents"], out["write_s"] = documents, round(time.perf_counter() - t0, 2)
        data = IndexedDataset(prefix)
        ids = np.arange(documents, dtype=np.int32)
        t0 = time.perf_counter()
        order = build_order(data.lengths, ids, seq_len=args.seq, num_samples=None, seed=1234)
        out["fxmeg_order_s"] = round(time.perf_counter() - t0, 3)
        out["samples"] = len(order)
        t0 = time.perf_counter()
        blending_indices([0.3, 0.7], args.samples)
        out["fxmeg_blend_s"] = round(time.perf_counter() - t0, 3)
        # --data-cache-path: the first run writes, the next reads
        for step in ("cache_write_s", "cache_read_s"):
            t0 = time.perf_counter()
            cache.order(
                os.path.join(tmp, "cache"),
                data,
                (0, documents),
                seq_len=args.seq,
                num_samples=None,
                seed=1234,
            )
            out[step] = round(time.perf_counter() - t0, 3)
        out |= _megatron(prefix, ids, args)
        reader = TrainData(
            DataPaths(blend=(prefix,), split="99,1,0"),
            (args.read, args.gbs, 0),
            seq_len=args.seq,
            seed=1234,
            vocab=Vocabulary(65536, None),
        )
        t0 = time.perf_counter()
        for start in range(0, args.read, args.gbs):
            reader.batch("train", range(start, start + args.gbs))
        out["read_samples_per_s"] = round(args.read / (time.perf_counter() - t0))
    print(json.dumps(out))


def _megatron(prefix: str, ids: np.ndarray, args) -> dict:
    """megatron-core's time for the same order and blend (None where it is not installed)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
            from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
            from megatron.core.datasets.utils import Split
    except ImportError:
        return {"megatron_order_s": None, "megatron_blend_s": None}

    class Tokenizer:
        eod, pad, vocab_size, unique_identifiers = 0, 1, 65536, {"class": "bench"}

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.seq,
        blend=([prefix], None),
        split="1",
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    data = MegatronDataset(prefix)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GPTDataset(data, prefix, ids, None, Split.train, config)
    order = round(time.perf_counter() - t0, 3)
    index = np.zeros(args.samples, dtype=np.int16)
    within = np.zeros(args.samples, dtype=np.int64)
    t0 = time.perf_counter()
    helpers.build_blending_indices(index, within, np.asarray([0.3, 0.7]), 2, args.samples, False)
    return {"megatron_order_s": order, "megatron_blend_s": round(time.perf_counter() - t0, 3)}


if __name__ == "__main__":
    main()
