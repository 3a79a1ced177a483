"""Capture and graph-pass time for a 24-layer GPT: torch.export, then every pass fxmeg
runs for tp=2 x pp=4 x vpp=2 (pure functions: no process group needed), then a whole
single-process parallelize(). One JSON line, seconds.

    python bench/capture.py              # GPT 24 layers x 256, seq 128, vocab 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from fxmeg import program  # noqa: E402
from fxmeg.capture import capture  # noqa: E402
from fxmeg.passes.partition import partition  # noqa: E402
from fxmeg.passes.buckets import buckets  # noqa: E402
from fxmeg.passes.loss import loss  # noqa: E402
from fxmeg.passes.pipeline import pipeline  # noqa: E402
from fxmeg.passes.recompute import recompute  # noqa: E402
from fxmeg.passes.tensor_parallel import tensor_parallel  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=8, n_embd=args.hidden)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = (torch.randint(0, args.vocab, (2, args.seq)), torch.randint(0, args.vocab, (2, args.seq)))
    seconds = {}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        seconds[name] = time.perf_counter() - start
        return out

    captured = timed("capture", lambda: capture(model, batch))
    gm = timed("loss", lambda: loss(captured.gm, explicit=captured.explicit_loss))
    gm = timed("tensor_parallel", lambda: tensor_parallel(gm, tp=args.tp, rank=0, plan={}, sequence_parallel=True))
    chunks = args.pp * args.vpp
    timed("partition", lambda: partition(gm, num_chunks=chunks, split_points=None))
    parent = timed("pipeline", lambda: pipeline(gm, num_chunks=chunks))
    timed("recompute_full", lambda: [recompute(c, granularity="full") for c in program.chunks(parent)])
    timed("buckets", lambda: buckets(parent, pp=args.pp, dp=2, bucket_size=40_000_000, shard=True))
    passes = sum(seconds.values())
    timed("parallelize_single_process", lambda: fxmeg.parallelize(GPT(cfg), batch))
    nodes = sum(1 for _ in captured.gm.graph.nodes)
    print(json.dumps({"bench": "capture", "model": {"layers": args.layers, "hidden": args.hidden,
                      "seq": args.seq, "vocab": args.vocab}, "graph_nodes": nodes,
                      "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp},
                      "seconds": seconds, "capture_and_passes_s": passes}))


if __name__ == "__main__":
    main()
