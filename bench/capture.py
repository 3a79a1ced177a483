"""Capture and graph-pass time for a 24-layer GPT: torch.export, then every pass fxmeg
runs for tp=2 x pp=4 x vpp=2 (fxmeg.transform's own per-pass timing: no process group
needed), then a whole single-process parallelize(). One JSON line, seconds.

    python bench/capture.py              # GPT 24 layers x 256, seq 128, vocab 2048
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    args = p.parse_args()
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=8, n_embd=args.hidden
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = (
        torch.randint(0, args.vocab, (2, args.seq)),
        torch.randint(0, args.vocab, (2, args.seq)),
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("fxmeg.frontend.pass_driver")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    fxmeg.transform(
        model,
        batch,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        dp=2,
        sequence_parallel=True,
        global_batch_size=2 * 2 * args.pp,
        distributed_optimizer=True,
        recompute="full",
    )
    log.removeHandler(handler)
    seconds = {r.step: r.seconds for r in records}
    nodes = next(r.nodes for r in records if r.step == "capture")
    passes = sum(seconds.values())
    start = time.perf_counter()
    fxmeg.parallelize(GPT(cfg), batch)
    seconds["parallelize_single_process"] = time.perf_counter() - start
    print(json.dumps({"bench": "capture", "model": {"layers": args.layers, "hidden": args.hidden,
                      "seq": args.seq, "vocab": args.vocab}, "graph_nodes": nodes,
                      "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp},
                      "seconds": seconds, "capture_and_passes_s": passes}))


if __name__ == "__main__":
    main()
