"""fxmeg's pipeline schedules against every torch.distributed.pipelining schedule that
runs on gloo, on the same GPT, pp and micro-batching, in one window.

Variants, all with AdamW(lr=1e-4, fused=True) stepping once per global batch:
- ``one_process``: plain PyTorch on one rank, same micro-batching (the speedup baseline);
- ``one_process_on_every_rank``: the same step on every rank at once (each its own
  copy), which prices the machine: ``ceiling_over_1_process`` = pp x one_process / this
  is the most any pp-way split could reach here, before bubble, imbalance or messages
  (ranks that share cores, memory bandwidth or caches slow each other down);
- ``fxmeg_<S>``: ``fxmeg.parallelize(..., pp, vpp, schedule=S)`` for S in
  ``--fxmeg-schedules`` (vpp=2 for interleaved / zbv / dualpipev, else 1);
- ``torch_*``: the manual frontend on the hand-split stages of bench/pipeline.py (each
  rank clips its own gradients, the tutorial's way): Schedule1F1B (one stage a rank),
  ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (two a rank, stage c on
  rank c % pp), ScheduleZBVZeroBubble and ScheduleDualPipeV (two a rank in a V: rank r
  holds stages r and 2*pp-1-r; these schedules set that placement themselves, so rank 0
  holds both ends and the tied embedding / head weight is one parameter there);
- ``torch_traced_1f1b``: the traced frontend, ``pipeline(...)`` split at the block
  boundaries, ``pipe.build_stage`` and Schedule1F1B.
A variant that fails to build or run reports ``{"failed": "<Type>: <first line>"}``.

Every timed step runs all live variants once, in an order rotated each step (the CPUs
are noisy); each variant's time is the slowest rank's. Prints one JSON line: per variant
tokens/s (rows * seq / median step time) and the speedup over one process, the best
fxmeg and torch variants and their ratio, and the load average around the run.

    python bench/zero_bubble.py     # pp=2, m=8, mbs=2, GPT 4 layers x 128, seq 128, vocab 2048
    python bench/zero_bubble.py --fxmeg-schedules 1f1b,zbh1 --torch-schedules 1f1b,zbv --steps 3
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, plain_step, spawn, timed  # noqa: E402
from bench.pipeline import Stage, lm_loss, setup  # noqa: E402
from fxmeg.schedule_registry import SPECS  # noqa: E402
from models.gpt import GPT  # noqa: E402

FXMEG_VPP = {name: 2 for name, spec in SPECS.items() if spec.vpp != "1"}
"""vpp per fxmeg schedule (1 if absent): 2 where the registry wants more than one chunk per rank."""

TORCH_SCHEDULES = {  # flag name: (variant name, schedule class, stage placement)
    "1f1b": ("torch_1f1b", Schedule1F1B, "single"),
    "interleaved": ("torch_interleaved_1f1b", ScheduleInterleaved1F1B, "loop"),
    "interleaved_zb": ("torch_interleaved_zero_bubble", ScheduleInterleavedZeroBubble, "loop"),
    "zbv": ("torch_zbv_zero_bubble", ScheduleZBVZeroBubble, "v"),
    "dualpipev": ("torch_dualpipev", ScheduleDualPipeV, "v"),
    "traced": ("torch_traced_1f1b", None, "traced"),
}


def stage_indices(placement: str, rank: int, pp: int) -> list[int]:
    """The stage indices ``rank`` holds: one (single), round robin c % pp (loop), or
    the V (r and 2*pp-1-r), in ascending order."""
    if placement == "single":
        return [rank]
    if placement == "loop":
        return list(range(rank, 2 * pp, pp))
    return [rank, 2 * pp - 1 - rank]


def torch_manual(model: GPT, rank: int, pp: int, m: int, cls, placement: str, group):
    """One step of ``cls`` over the hand-split stages this rank holds."""
    n = pp if placement == "single" else 2 * pp
    per = len(model.layers) // n
    mine = stage_indices(placement, rank, pp)
    stages = [
        PipelineStage(Stage(model, range(c * per, (c + 1) * per), c == 0, c == n - 1), c, n,
                      torch.device("cpu"), group=group)
        for c in mine
    ]
    sched = (
        cls(stages[0], m, loss_fn=lm_loss)
        if placement == "single"
        else cls(stages, m, loss_fn=lm_loss)
    )
    return _step(sched, stages, has_first=0 in mine, has_last=n - 1 in mine)


def torch_traced(model: GPT, rank: int, pp: int, m: int, example: torch.Tensor, group):
    """One step of Schedule1F1B over the traced frontend's stages, split evenly at blocks."""
    per = len(model.layers) // pp
    whole = Stage(model, range(len(model.layers)), True, True)  # ids -> logits; the loss is loss_fn
    pipe = pipeline(whole, mb_args=(example,),
                    split_spec={f"layers.{c * per}": SplitPoint.BEGINNING for c in range(1, pp)})
    stage = pipe.build_stage(rank, torch.device("cpu"), group)
    sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
    return _step(sched, [stage], has_first=rank == 0, has_last=rank == pp - 1)


def _step(sched, stages, *, has_first: bool, has_last: bool):
    params = list({id(p): p for s in stages for p in s.submod.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(ids, labels):
        opt.zero_grad()
        args = (ids,) if has_first else ()
        kwargs = dict(target=labels, losses=[]) if has_last else {}
        sched.step(*args, **kwargs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return step


def agree(fn, world: int):
    """Run ``fn`` on every rank; (result, None) if it succeeded everywhere, else
    (None, "<Type>: <first line>") of the first rank that failed, the same on every rank."""
    try:
        out, err = fn(), None
    except Exception as e:  # noqa: BLE001 (a failing variant is a result, not a crash)
        lines = str(e).strip().splitlines()
        out, err = None, f"{type(e).__name__}: {lines[0] if lines else ''}"
    errs = [None] * world
    dist.all_gather_object(errs, err)
    err = next((e for e in errs if e), None)
    return (None, err) if err else (out, None)


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    base, ids, labels = setup(args)
    rows = ids.shape[0]
    timeout = datetime.timedelta(seconds=args.timeout)

    def one_process():
        if rank != 0:
            return lambda: None  # the others wait: timed() takes the slowest rank's time
        model = copy.deepcopy(base)
        return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                          ids, labels, args.m, args.mbs)

    def on_every_rank():
        model = copy.deepcopy(base)
        return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                          ids, labels, args.m, args.mbs)

    builders = [("one_process", one_process), ("one_process_on_every_rank", on_every_rank)]
    for s in filter(None, args.fxmeg_schedules.split(",")):
        def build(s=s):
            engine = fxmeg.parallelize(
                copy.deepcopy(base),
                (ids[: args.mbs], labels[: args.mbs]),
                pp=world,
                vpp=FXMEG_VPP.get(s, 1),
                schedule=s,
                global_batch_size=rows,
                comm_timeout_s=args.timeout,
                optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True),
            )
            return lambda: engine.train_step((ids, labels))
        builders.append((f"fxmeg_{s}", build))
    for key in filter(None, args.torch_schedules.split(",")):
        name, cls, placement = TORCH_SCHEDULES[key]
        # its own tags: no stale messages across variants
        group = dist.new_group(list(range(world)), timeout=timeout)

        def build(cls=cls, placement=placement, group=group):
            model = copy.deepcopy(base)
            step = (
                torch_traced(model, rank, world, args.m, ids[: args.mbs], group)
                if placement == "traced"
                else torch_manual(model, rank, world, args.m, cls, placement, group)
            )
            return lambda: step(ids, labels)
        builders.append((name, build))

    steps, failed = {}, {}
    for name, build in builders:
        fn, err = agree(build, world)
        if err is None:
            _, err = agree(lambda: [fn() for _ in range(args.warmup)], world)
        if err is None:
            steps[name] = fn
        else:
            failed[name] = err
    times = {name: [] for name in steps}
    for i in range(args.steps):  # rotate who goes first
        live = [name for name in steps if name not in failed]
        if not live:
            break
        k = i % len(live)
        for name in live[k:] + live[:k]:
            took, err = agree(lambda: timed(steps[name]), world)
            if err is None:
                times[name].append(took)
            else:
                failed[name] = err

    tokens = rows * args.seq
    single = median(times["one_process"]) if "one_process" not in failed else None
    results = {}
    for name, _ in builders:
        if name in failed:
            results[name] = {"failed": failed[name]}
            continue
        t = median(times[name])
        results[name] = {"tokens_per_s": tokens / t, "median_step_s": t,
                         "speedup_over_1_process": single / t if single else None}

    def best(prefix):
        ok = {
            n: r["tokens_per_s"]
            for n, r in results.items()
            if n.startswith(prefix) and "failed" not in r
        }
        if not ok:
            return None
        n = max(ok, key=ok.get)
        return {"name": n, "tokens_per_s": ok[n]}

    best_fxmeg, best_torch = best("fxmeg_"), best("torch_")
    everywhere = results["one_process_on_every_rank"].get("median_step_s")
    ceiling = world * single / everywhere if single and everywhere else None
    if rank == 0:
        print(
            json.dumps(
                {
                    "bench": "zero_bubble",
                    "pp": world,
                    "m": args.m,
                    "mbs": args.mbs,
                    "model": {
                        "layers": args.layers,
                        "hidden": args.hidden,
                        "seq": args.seq,
                        "vocab": args.vocab,
                    },
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "load_avg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
                    "results": results,
                    "best_fxmeg": best_fxmeg,
                    "best_torch": best_torch,
                    "ceiling_over_1_process": ceiling,
                    "ratio_best_fxmeg_over_best_torch": (
                        best_fxmeg["tokens_per_s"] / best_torch["tokens_per_s"]
                        if best_fxmeg and best_torch
                        else None
                    ),
                }
            )
        )


def main() -> None:
    p = parser(__doc__, pp=2)
    p.add_argument("--fxmeg-schedules", default="1f1b,interleaved,zbh1,zbv,dualpipev",
                   help="comma-separated fxmeg schedules (vpp=2 for interleaved, zbv, dualpipev)")
    p.add_argument(
        "--torch-schedules",
        default=",".join(TORCH_SCHEDULES),
        help="comma-separated torch.distributed.pipelining variants, of "
        f"{','.join(TORCH_SCHEDULES)}",
    )
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a variant's communication may block before it counts as failed")
    args = p.parse_args()
    unknown = set(filter(None, args.torch_schedules.split(","))) - set(TORCH_SCHEDULES)
    if unknown:
        p.error(
            f"--torch-schedules: unknown {sorted(unknown)}; choose from {sorted(TORCH_SCHEDULES)}"
        )
    spawn(args.pp, run, args)


if __name__ == "__main__":
    main()
