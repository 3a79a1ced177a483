"""Pipeline bubble measured from fxmeg's own timeline vs the 1F1B theory (p-1)/(m+p-1).

A GPT whose blocks dominate (small vocabulary) split evenly over pp ranks, so the stages
cost the same and the bubble is the schedule's, not an imbalance's. For each m, the
median over traced steps of every rank's idle share of the step's schedule span
(fxmeg.runtime.timelines.analyze). One JSON line.

    python bench/bubble.py               # pp=2, m in 4 8 16, mbs 2 (the pipeline bench's)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, spawn  # noqa: E402
from fxmeg.runtime import timelines  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.hidden
    )
    per = args.layers // world
    rows = []
    for m in args.ms:
        torch.manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (m * args.mbs, cfg.seq_len))
        labels = torch.randint(0, cfg.vocab_size, (m * args.mbs, cfg.seq_len))
        engine = fxmeg.parallelize(
            GPT(cfg),
            (ids[: args.mbs], labels[: args.mbs]),
            pp=world,
            global_batch_size=m * args.mbs,
            split_points=[f"layers.{per * k}" for k in range(1, world)],
        )
        for _ in range(args.warmup):
            engine.train_step((ids, labels))
        bubbles = []
        for _ in range(args.steps):
            engine.train_step((ids, labels), trace=True)
            gathered = timelines.gather(engine.context.tracer.events, f"rank {rank}")
            if gathered:
                bubbles.append([r["bubble"] for r in timelines.analyze(gathered[0])["ranks"]])
        if rank == 0:
            measured = [median([b[r] for b in bubbles]) for r in range(world)]
            theory = (world - 1) / (m + world - 1)
            rows.append({"m": m, "theory": theory, "measured_per_rank": measured,
                         "max_abs_diff_pp": 100 * max(abs(b - theory) for b in measured)})
    if rank == 0:
        print(json.dumps({"bench": "bubble", "pp": world, "schedule": "1f1b", "steps": args.steps,
                          "model": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                                    "vocab": args.vocab}, "results": rows}))


def main() -> None:
    p = parser(__doc__, pp=2, m=None, layers=8, vocab=128, steps=5)
    p.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16], help="micro-batch counts")
    args = p.parse_args()
    spawn(args.pp, run, args)


if __name__ == "__main__":
    main()
