"""make demo: train a small GPT (models/gpt.py, unmodified) with fxmeg on CPU.

Spawns its own ranks on localhost (gloo). The data are arithmetic sequences mod the
vocabulary with a random start and stride, so the loss has somewhere to fall.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def batch(step: int, rows: int, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def train(rank: int, world: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)  # every rank builds the same initial model
    cfg = GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_head=4, n_embd=64)
    model = GPT(cfg)
    example = batch(0, args.mbs, cfg)
    engine = fxmeg.parallelize(
        model, example, tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp,
        global_batch_size=args.gbs,
        optimizer=lambda groups: torch.optim.AdamW(groups, weight_decay=0.1),
        distributed_optimizer=True,
        lr_schedule=fxmeg.LRSchedule(max_lr=3e-3, min_lr=3e-4, warmup_samples=4 * args.gbs,
                                     decay_samples=args.steps * args.gbs, style="cosine"),
    )
    if rank == 0:
        layout = f"tp={args.tp} pp={args.pp} vpp={args.vpp} dp={args.dp}, distributed optimizer"
        print(f"fxmeg demo: GPT {cfg.n_layer} layers, hidden {cfg.n_embd}, {world} rank(s), "
              f"{layout}, schedule {engine.config.parallel.resolved_schedule}, "
              f"m={engine.config.num_microbatches} micro-batches of {args.mbs}", flush=True)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        r = engine.train_step(batch(step, args.gbs, cfg))
        if rank == 0 and (step == 1 or step % 5 == 0):
            tok_s = step * args.gbs * cfg.seq_len / (time.perf_counter() - t0)
            print(f"step {step:3d}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  "
                  f"lr {r.lr:.1e}  {tok_s:,.0f} tokens/s", flush=True)
    final = engine.eval_step(batch(10_000, args.gbs, cfg))
    if rank == 0:
        print(f"final loss on held-out batch: {final.loss:.4f}", flush=True)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    world = args.tp * args.pp * args.dp
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        if world == 1:
            train(0, 1, args, store)
        else:
            mp.spawn(train, args=(world, args, store), nprocs=world)


if __name__ == "__main__":
    main()
