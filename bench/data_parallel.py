"""fxmeg dp=2 vs torch.nn.parallel.DistributedDataParallel: same GPT, same global batch,
micro-batching and bucket size, steps alternated in one run. One JSON line.

Also: the fraction of gradient-reduction time fxmeg hides behind backward,
1 - (wait left at finish_grad_sync with overlap) / (the same wait without overlap, when
every bucket is reduced after backward).

    python bench/data_parallel.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, spawn, timed  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.hidden
    )
    torch.manual_seed(0)
    base = GPT(cfg)
    rows = args.mbs * args.m * world
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    labels = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    opt = lambda g: torch.optim.AdamW(g, lr=1e-4)  # noqa: E731
    engines = {
        overlap: fxmeg.parallelize(copy.deepcopy(base), (ids[: args.mbs], labels[: args.mbs]),
                                   global_batch_size=rows, bucket_size=args.bucket, optimizer=opt,
                                   overlap_grad_reduce=overlap)
        for overlap in (True, False)
    }
    waits = {True: [], False: []}
    for overlap, engine in engines.items():
        engine.context.ddp.finish_grad_sync = _timing(
            engine.context.ddp.finish_grad_sync, waits[overlap]
        )
    ddp_step = _torch_ddp(copy.deepcopy(base), rank, world, ids, labels, args)
    ours = lambda: engines[True].train_step((ids, labels))  # noqa: E731
    ours_no_overlap = lambda: engines[False].train_step((ids, labels))  # noqa: E731
    for _ in range(args.warmup):
        ours(), ddp_step(), ours_no_overlap()
    for overlap in waits:
        waits[overlap].clear()
    t_ours, t_ddp, t_off = [], [], []
    for i in range(args.steps):
        runs = [(ours, t_ours), (ddp_step, t_ddp), (ours_no_overlap, t_off)]
        for fn, out in runs if i % 2 == 0 else runs[::-1]:
            out.append(timed(fn))
    tokens = rows * cfg.seq_len
    exposed = torch.tensor([median(waits[True]), median(waits[False])], dtype=torch.float64)
    dist.all_reduce(exposed, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        print(
            json.dumps(
                {
                    "bench": "data_parallel",
                    "dp": world,
                    "m": args.m,
                    "mbs": args.mbs,
                    "params": params,
                    "bucket_elements": args.bucket,
                    "fxmeg_tokens_per_s": tokens / median(t_ours),
                    "torch_ddp_tokens_per_s": tokens / median(t_ddp),
                    "ratio_fxmeg_over_ddp": median(t_ddp) / median(t_ours),
                    "fxmeg_no_overlap_tokens_per_s": tokens / median(t_off),
                    "exposed_reduction_wait_s": {
                        "overlap": float(exposed[0]),
                        "no_overlap": float(exposed[1]),
                    },
                    "fraction_of_reduction_hidden": 1.0 - float(exposed[0]) / float(exposed[1]),
                }
            )
        )


def _timing(fn, out: list[float]):
    def wrapped():
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return wrapped


def _torch_ddp(model, rank, world, ids, labels, args):
    """Megatron-style accumulation with DDP: no_sync for the first m-1 micro-batches."""
    ddp = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        for i in range(args.m):
            row = (i * world + rank) * args.mbs
            sl = slice(row, row + args.mbs)
            if i < args.m - 1:
                with ddp.no_sync():
                    (ddp(ids[sl], labels[sl]) / args.m).backward()
            else:
                (ddp(ids[sl], labels[sl]) / args.m).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()

    return step


def main() -> None:
    p = parser(__doc__, dp=2, m=4, mbs=4, hidden=256)
    p.add_argument("--bucket", type=int, default=1_000_000, help="elements per bucket (both)")
    args = p.parse_args()
    spawn(args.dp, run, args)


if __name__ == "__main__":
    main()
