"""The pipeline executor's own cost, per schedule, against torch.distributed.pipelining.

Two measurements, one JSON line:

- ``empty``: a model whose chunks do almost nothing (the GPT's embeddings and head, each
  block one 8 x 8 linear map; one block per chunk, seq 4, one row per micro-batch: compute
  is ~0), every fxmeg schedule and every peer schedule
  that runs on gloo (bench/zero_bubble.py's manual frontend on the same hand-split
  stages). For each, the median step time at m and at 2m micro-batches (rotated, the
  slowest rank's), and the cost of one more micro-batch: (t(2m) - t(m)) / m, which the
  step's fixed costs (optimizer, gradient sync, clipping) do not enter. For fxmeg also per
  action: the same difference over the difference in this rank's lowered actions
  (compute, send, receive, deallocate, grad-sync steps).
- ``traced``: the bench GPT (bench/zero_bubble.py's model, pp=2, m=8) under each fxmeg
  schedule, ``--traced-steps`` traced steps, per rank: the step's mean time split into
  chunk compute (the F / B / I / W actions), point-to-point (posting and waiting),
  optimizer and finalize, and the rest: the interpreter between actions. And the bound:
  the schedule run in fxmeg.runtime.pipeline.simulator with each (chunk, kind)'s mean measured
  time and free communication (``bound_s``, ``rank_busy_s``), beside ``pipeline_s``, the
  step less optimizer and finalize: their gap is what the executor and the wire cost;
  the bound's own excess over the busiest rank's compute is the schedule's bubble.
  ``bound_latency_s`` is the same bound when each message arrives ``--latency-ms`` after
  both ends posted it: how much of the wire the schedule could hide if the cost were
  latency alone.

    python bench/overhead.py                # pp=2, m=8
    python bench/overhead.py --steps 5 --fxmeg-schedules 1f1b,zbv --torch-schedules 1f1b

On the empty model torch's zbv, dualpipev and interleaved zero bubble fail in their
input-gradient action, so the peer runs 1F1B and interleaved there.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, spawn, timed  # noqa: E402
from bench.zero_bubble import FXMEG_VPP, TORCH_SCHEDULES, agree, torch_manual  # noqa: E402
from fxmeg.runtime import timelines  # noqa: E402
from fxmeg.runtime.pipeline.schedules import Action  # noqa: E402
from fxmeg.runtime.pipeline.simulator import simulate  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

EMPTY = dict(layers=4, hidden=8, seq=4, vocab=32, mbs=1)
"""The near-empty model: 4 blocks (pp=2 x vpp=2 chunks of one block), 8 wide, 4 tokens."""


class Empty(nn.Module):
    """The GPT's shape (embeddings, ``layers``, ``ln_f``, ``lm_head``: bench/pipeline.py's
    Stage splits it) with a block that is one 8 x 8 linear map: a chunk is a few ops."""

    def __init__(self, layers: int, hidden: int, seq: int, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.ln_f, self.lm_head = nn.Identity(), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), labels.flatten())


def _model(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, n_embd=hidden)
    )


def _batch(rows: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(
        0, vocab, (rows, seq), generator=g
    )


def _fxmeg(base: GPT, ids, labels, mbs: int, pp: int, schedule: str):
    engine = fxmeg.parallelize(
        copy.deepcopy(base),
        (ids[:mbs], labels[:mbs]),
        pp=pp,
        vpp=FXMEG_VPP.get(schedule, 1),
        schedule=schedule,
        global_batch_size=ids.shape[0],
        optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True),
    )
    return engine, lambda: engine.train_step((ids, labels))


def _actions(engine) -> int:
    """This rank's lowered actions in the last step (each point-to-point group counts once)."""
    return len(engine.context.executor.steps)


def empty(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Step times of the near-empty model at m and 2m, per schedule of both."""
    base = Empty(EMPTY["layers"], EMPTY["hidden"], EMPTY["seq"], EMPTY["vocab"])
    variants, actions, failed = {}, defaultdict(dict), {}
    for m in (args.m, 2 * args.m):
        ids, labels = _batch(m * EMPTY["mbs"], EMPTY["seq"], EMPTY["vocab"])
        for s in filter(None, args.empty_fxmeg_schedules.split(",")):
            made, err = agree(lambda s=s: _fxmeg(base, ids, labels, EMPTY["mbs"], world, s), world)
            if err:
                failed[f"fxmeg_{s}"] = err
                continue
            engine, step = made
            step()
            variants[(f"fxmeg_{s}", m)] = step
            actions[f"fxmeg_{s}"][m] = _actions(engine)
        for key in filter(None, args.torch_schedules.split(",")):
            name, cls, placement = TORCH_SCHEDULES[key]
            if placement == "traced":
                continue
            group = dist.new_group(
                list(range(world)), timeout=datetime.timedelta(seconds=args.timeout)
            )

            def build(cls=cls, placement=placement, group=group, m=m, ids=ids, labels=labels):
                step = torch_manual(copy.deepcopy(base), rank, world, m, cls, placement, group)
                return lambda: step(ids, labels)

            made, err = agree(build, world)
            if err:
                failed[name] = err
                continue
            variants[(name, m)] = made
    times = _rotated(variants, args, world, failed)
    out = {}
    for name in sorted({n for n, _ in variants} | set(failed)):
        if name in failed:
            out[name] = {"failed": failed[name]}
            continue
        t1, t2 = median(times[(name, args.m)]), median(times[(name, 2 * args.m)])
        row = {
            "step_ms": {args.m: 1e3 * t1, 2 * args.m: 1e3 * t2},
            "per_microbatch_us": 1e6 * (t2 - t1) / args.m,
        }
        if name in actions:
            a1, a2 = actions[name][args.m], actions[name][2 * args.m]
            row |= {
                "actions": {args.m: a1, 2 * args.m: a2},
                "per_action_us": 1e6 * (t2 - t1) / (a2 - a1),
            }
        out[name] = row
    return out


def _rotated(variants: dict, args, world: int, failed: dict) -> dict:
    """Median-ready step times of every variant: warmed up, then timed in an order rotated
    each round (the CPUs are noisy); a variant that fails is dropped with its error."""
    for (name, _), step in list(variants.items()):
        _, err = agree(lambda step=step: [step() for _ in range(args.warmup)], world)
        if err:
            failed[name] = err
    live = [k for k in variants if k[0] not in failed]
    times = {k: [] for k in live}
    for i in range(args.steps if live else 0):
        k = i % len(live)
        for key in live[k:] + live[:k]:
            took, err = agree(lambda key=key: timed(variants[key]), world)
            if err:
                failed[key[0]] = err
            else:
                times[key].append(took)
    return times


def traced(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Traced steps of the bench GPT per fxmeg schedule: where the slowest rank's time
    went, and how far the schedule ran from its bound with the measured action times."""
    base = _model(args.layers, args.hidden, 4, args.seq, args.vocab)
    ids, labels = _batch(args.m * args.mbs, args.seq, args.vocab)
    out = {}
    for s in filter(None, args.fxmeg_schedules.split(",")):
        engine, step = _fxmeg(base, ids, labels, args.mbs, world, s)
        for _ in range(args.warmup):
            step()
        steps = []
        for _ in range(args.traced_steps):
            engine.train_step((ids, labels), trace=True)
            steps.append(timelines.gather(engine.context.tracer.events, f"rank {rank}"))
        if rank == 0:
            ranks = [[span for gathered in steps for span in gathered[0][r]] for r in range(world)]
            bound = _bound(engine, ranks, world, args.latency_ms / 1e3)
            out[s] = [_split(spans, len(steps)) | bound for spans in ranks]
    return out


def _bound(engine, ranks: list[list[tuple]], world: int, latency: float) -> dict:
    """The schedule's makespan in the simulator (fxmeg.runtime.pipeline.simulator) with each
    (chunk, kind)'s mean measured time and free communication: what the step's pipeline
    part (all but optimizer and finalize) would take with no executor and no wire."""
    times = defaultdict(list)
    for spans in ranks:
        for name, cat, start, end, *_ in spans:
            if cat in timelines.COMPUTE:  # one compute action a span, named by it ("1W3")
                a = Action.parse(name)
                times[(a.chunk, a.kind)].append((end - start) / 1e9)
    costs = {key: sum(t) / len(t) for key, t in times.items()}
    ctx = engine.context
    lowered, placement = ctx.lower(ctx.schedule), engine.partition.placement
    sim = simulate(lowered, pp=world, placement=placement, costs=costs)
    late = simulate(lowered, pp=world, placement=placement, costs=costs, latency=latency)
    return {"bound_s": sim.makespan, "bound_latency_s": late.makespan,
            "rank_busy_s": [sim.busy[r] for r in range(world)]}


def _split(spans: list[tuple], n: int) -> dict:
    """A rank's mean step time over ``n`` traced steps by category (seconds), the share
    left to the interpreter, and the pipeline part (all but optimizer and finalize)."""
    total = sum(s[3] - s[2] for s in spans if s[1] == "step")
    by = defaultdict(float)
    for _, cat, start, end, *_ in spans:
        if cat != "step":
            by["compute" if cat in timelines.COMPUTE else cat] += (end - start) / 1e9 / n
    step_s = total / 1e9 / n
    other = step_s - sum(by.values())
    return {"step_s": step_s} | {f"{cat}_s": t for cat, t in sorted(by.items())} | {
        "other_s": other, "other_share": other / step_s,
        "pipeline_s": step_s - by["optimizer"] - by["finalize"]}


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    report = {"empty": empty(rank, world, args), "traced": traced(rank, world, args)}
    if rank == 0:
        print(
            json.dumps(
                {
                    "bench": "overhead",
                    "pp": world,
                    "m": args.m,
                    "empty_model": EMPTY,
                    "traced_model": {
                        "layers": args.layers,
                        "hidden": args.hidden,
                        "seq": args.seq,
                        "vocab": args.vocab,
                        "mbs": args.mbs,
                    },
                    "steps": args.steps,
                    **report,
                }
            )
        )


def main() -> None:
    p = parser(__doc__, pp=2)
    p.add_argument(
        "--fxmeg-schedules", default="1f1b,interleaved,zbh1,zbv,dualpipev", help="traced"
    )
    p.add_argument(
        "--traced-steps",
        type=int,
        default=3,
        help="traced steps per schedule (times are their means)",
    )
    p.add_argument(
        "--latency-ms", type=float, default=1.0, help="each message's latency in bound_latency_s"
    )
    p.add_argument("--empty-fxmeg-schedules", default="1f1b,interleaved,zbh1,zbv,dualpipev",
                   help="on the empty model")
    p.add_argument(
        "--torch-schedules",
        default="1f1b,interleaved",
        help="on the empty model; its zbv, dualpipev and interleaved_zb fail there "
        "(their I action)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a peer variant's communication may block before it counts as failed",
    )
    args = p.parse_args()
    spawn(args.pp, run, args)


if __name__ == "__main__":
    main()
