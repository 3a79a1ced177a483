"""One packed message per pipeline cut vs one message per tensor (runtime/pipeline/packing.py).

Two gloo ranks ping-pong a Llama-like cut: hidden state (mbs, seq, hidden) fp32, a bool
attention mask (mbs, 1, seq, seq) and the rotary cos / sin tables (seq, head_dim) fp32.
Each round trip sends the cut from rank 0 to rank 1 and back, as the executor would:

  separate  one isend / irecv per tensor, received into fresh tensors
  packed    the sender copies the cut into one uint8 buffer (Layout.pack), the
            receiver receives one fresh buffer and takes views of it (Layout.unpack)

and a cut of the hidden state alone, sent as it is or through a packed copy (what the
executor saves by sending a single tensor as it is). Prints one JSON line: the median
round trip of each in microseconds, over interleaved iterations. With ``--engine`` it
also times fxmeg's Llama training step at pp=2 with packing on and off.

    python bench/p2p.py                 # mbs 2, seq 128, hidden 128, 500 round trips
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg
from bench.common import median, parser, spawn, timed
from fxmeg.ir.program import Boundary
from fxmeg.runtime.pipeline.packing import Layout
from models.llama import Llama, LlamaConfig


def cut(args: argparse.Namespace) -> tuple[Boundary, ...]:
    head_dim = args.hidden // 4
    shapes = [
        ((args.mbs, args.seq, args.hidden), torch.float32),
        ((args.mbs, 1, args.seq, args.seq), torch.bool),
        ((args.seq, head_dim), torch.float32),
        ((args.seq, head_dim), torch.float32),
    ]
    return tuple(Boundary(f"t{i}", s, d, grad=i == 0, src=0) for i, (s, d) in enumerate(shapes))


def separate(
    tensors: list[torch.Tensor], layout: Layout, peer: int, send: bool
) -> list[torch.Tensor]:
    if send:
        works = [dist.isend(t, peer) for t in tensors]
    else:
        tensors = [torch.empty(p.shape, dtype=p.dtype) for p in layout.pieces]
        works = [dist.irecv(t, peer) for t in tensors]
    for w in works:
        w.wait()
    return tensors


def packed(
    tensors: list[torch.Tensor], layout: Layout, peer: int, send: bool
) -> list[torch.Tensor]:
    if send:
        dist.isend(layout.pack(tensors), peer).wait()
        return tensors
    buf = torch.empty((layout.nbytes,), dtype=torch.uint8)
    dist.irecv(buf, peer).wait()
    return layout.unpack(buf)


def round_trip(rank: int, how, tensors: list[torch.Tensor], layout: Layout) -> float:
    """Seconds for rank 0 -> rank 1 -> rank 0 (rank 1 sends back what it received)."""
    t0 = time.perf_counter()
    if rank == 0:
        how(tensors, layout, 1, True)
        how(tensors, layout, 1, False)
    else:
        got = how(tensors, layout, 0, False)
        how(got, layout, 0, True)
    return time.perf_counter() - t0


def messages(rank: int, args: argparse.Namespace) -> dict:
    full = Layout.of(cut(args))
    hidden = Layout.of(cut(args)[:1])
    g = torch.Generator().manual_seed(0)
    values = [
        torch.rand(p.shape, generator=g) > 0.5
        if p.dtype is torch.bool
        else torch.randn(p.shape, generator=g)
        for p in full.pieces
    ]
    cases = {
        "separate": (separate, values, full),
        "packed": (packed, values, full),
        "hidden_as_is": (separate, values[:1], hidden),
        "hidden_packed": (packed, values[:1], hidden),
    }
    times = {name: [] for name in cases}
    for i in range(args.warmup + args.iters):
        for name, (how, tensors, layout) in cases.items():  # interleaved: drift hits all alike
            dist.barrier()
            took = round_trip(rank, how, tensors, layout)
            if i >= args.warmup:
                times[name].append(took)
    return {name: round(1e6 * median(ts), 1) for name, ts in times.items()} | {
        "cut_bytes": full.nbytes,
        "hidden_bytes": hidden.nbytes,
    }


def engine_steps(rank: int, args: argparse.Namespace) -> dict:
    """Median training step time (s) of a Llama at pp=2, packing on and off alternately."""
    cfg = LlamaConfig(
        vocab_size=2048, seq_len=args.seq, n_layer=4, n_embd=args.hidden, ffn_hidden=4 * args.hidden
    )
    torch.manual_seed(0)
    rows = args.mbs * args.m
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    labels = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    engine = fxmeg.parallelize(
        Llama(cfg), (ids[: args.mbs], labels[: args.mbs]), pp=2, global_batch_size=rows
    )
    times = {True: [], False: []}
    for i in range(2 + args.steps):
        for pack, took in times.items():
            engine.context.executor.wire.pack = pack
            t = timed(lambda: engine.train_step((ids, labels)))
            if i >= 2:
                took.append(t)
    return {
        "cut": [list(b.shape) for b in engine.program.specs[0].send],
        "step_s_packed": round(median(times[True]), 4),
        "step_s_separate": round(median(times[False]), 4),
    }


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    report = {
        "bench": "p2p",
        "backend": "gloo",
        "shape": {"mbs": args.mbs, "seq": args.seq, "hidden": args.hidden},
        "iters": args.iters,
        "round_trip_us": messages(rank, args),
    }
    if args.engine:
        report["engine"] = engine_steps(rank, args) | {"m": args.m}
    if rank == 0:
        print(json.dumps(report))


def main() -> None:
    p = parser(__doc__, layers=None, vocab=None, m=8, steps=5, warmup=20)
    p.add_argument("--iters", type=int, default=500, help="timed round trips per case")
    p.add_argument("--engine", action="store_true", help="also time fxmeg's Llama step at pp=2")
    spawn(2, run, p.parse_args())


if __name__ == "__main__":
    main()
