"""fxmeg vs torch.distributed.pipelining: same GPT, same pp, m and schedule, one run.

Prints one JSON line: per schedule, the median tokens/s of each over rotated timed
steps, their ratio, the speedup over one process with the same micro-batching against
the ideal (p*m/(m+p-1) for 1F1B, p/(1+(p-1)/(v*m)) interleaved), the peak activation
bytes autograd saved per rank, and where fxmeg's time went in one traced step. The peer
runs twice: as the tutorial writes it, and with the same math as fxmeg (tied embedding
gradient all-reduced, global-norm clipping); see torch_pipeline.

    python bench/pipeline.py            # pp=2, m=8, mbs=2, GPT 4 layers x 128, seq 128
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, plain_step, spawn, timed  # noqa: E402
from fxmeg.diagnostics.measured_activations import SavedBytes  # noqa: E402
from fxmeg.runtime import timelines  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


class Stage(nn.Module):
    """A contiguous run of the GPT's blocks, with the embedding / head at the ends."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def torch_pipeline(
    model: GPT, rank: int, pp: int, vpp: int, m: int, *, same_math: bool, tied_group=None
):
    """Schedule1F1B (vpp=1) or ScheduleInterleaved1F1B over stages c = rank + k * pp.

    As a user writes it from the tutorial, each stage owns a copy of the tied embedding /
    LM-head weight and clips its own gradients: a different model from the one given.
    ``same_math`` adds what single-device training implies (and fxmeg does): all-reduce the
    tied weight's gradient between first and last stage, clip by the global norm."""
    n = pp * vpp
    per = len(model.layers) // n
    stages = [
        PipelineStage(Stage(model, range(c * per, (c + 1) * per), c == 0, c == n - 1), c, n,
                      torch.device("cpu"))
        for c in range(rank, n, pp)
    ]
    sched = (Schedule1F1B(stages[0], m, loss_fn=lm_loss) if vpp == 1
             else ScheduleInterleaved1F1B(stages, m, loss_fn=lm_loss))
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # what fxmeg's default uses

    def step(ids, labels):
        opt.zero_grad()
        args = (ids,) if rank == 0 else ()
        kwargs = dict(target=labels, losses=[]) if rank == (n - 1) % pp else {}
        sched.step(*args, **kwargs)
        if not same_math:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            last = (n - 1) % pp
            tied = [s.submod.wte.weight for s in stages if s.submod.first] + \
                [s.submod.lm_head.weight for s in stages if s.submod.last]
            if rank in (0, last) and pp > 1:
                dist.all_reduce(tied[0].grad, group=tied_group)
            grads = [
                p.grad
                for p in params
                if p.grad is not None and not (rank == last and rank != 0 and p is tied[-1])
            ]
            total = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum().reshape(1)
            dist.all_reduce(total)
            coeff = 1.0 / (float(total.sqrt()) + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_([p.grad for p in params if p.grad is not None], coeff)
        opt.step()

    return step, params


def setup(args: argparse.Namespace) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """The benchmark GPT (seeded, the same on every rank) and one global batch of
    ``mbs * m`` random rows."""
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers,
                    n_head=4, n_embd=args.hidden)
    torch.manual_seed(0)
    base = GPT(cfg)
    rows = args.mbs * args.m
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    labels = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    return base, ids, labels


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    base, ids, labels = setup(args)
    rows = ids.shape[0]
    tokens = rows * args.seq
    report = {}
    single = _single_process_time(rank, base, ids, labels, args)
    # first and last stage (any vpp: rank of chunk 0 and n-1)
    tied_group = dist.new_group(sorted({0, world - 1}))
    for name, vpp, split, p2p in _variants(world, args.layers):
        engine = fxmeg.parallelize(
            copy.deepcopy(base), (ids[: args.mbs], labels[: args.mbs]), pp=world, vpp=vpp,
            global_batch_size=rows, split_points=split, p2p=p2p,
            optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True))
        peer, peer_params = torch_pipeline(
            copy.deepcopy(base), rank, world, vpp, args.m, same_math=False
        )
        exact, _ = torch_pipeline(copy.deepcopy(base), rank, world, vpp, args.m, same_math=True,
                                  tied_group=tied_group)
        ours = lambda: engine.train_step((ids, labels))  # noqa: E731
        theirs = lambda: peer(ids, labels)  # noqa: E731
        theirs_exact = lambda: exact(ids, labels)  # noqa: E731
        for _ in range(args.warmup):
            ours(), theirs(), theirs_exact()
        t_ours, t_theirs, t_exact = [], [], []
        for i in range(args.steps):  # rotate who goes first: the CPUs are noisy
            runs = [(ours, t_ours), (theirs, t_theirs), (theirs_exact, t_exact)]
            k = i % 3
            for fn, out in runs[k:] + runs[:k]:
                out.append(timed(fn))
        engine.train_step((ids, labels), trace=True)
        gathered = timelines.gather(engine.context.tracer.events, f"rank {rank}")
        timeline = timelines.analyze(gathered[0]) if gathered else None
        mem_ours = _saved_peak(ours, engine.named_parameters.values())
        mem_theirs = _saved_peak(theirs, peer_params)
        ideal = (
            world * args.m / (args.m + world - 1)
            if vpp == 1
            else world / (1 + (world - 1) / (vpp * args.m))
        )
        report[name] = {
            "fxmeg_chunks": [list(engine.partition.chunk_units(c)) for c in range(world * vpp)],
            "fxmeg_tokens_per_s": tokens / median(t_ours),
            "torch_tokens_per_s": tokens / median(t_theirs),
            "ratio_fxmeg_over_torch": median(t_theirs) / median(t_ours),
            "ratio_fxmeg_over_torch_same_math": median(t_exact) / median(t_ours),
            "fxmeg_speedup_over_1_process": single / median(t_ours),
            "torch_speedup_over_1_process": single / median(t_theirs),
            "torch_same_math_speedup_over_1_process": single / median(t_exact),
            "ideal_speedup": ideal,
            "fxmeg_saved_activation_bytes_per_rank": mem_ours,
            "torch_saved_activation_bytes_per_rank": mem_theirs,
        }
        if timeline:  # one traced step: where fxmeg's time goes, per rank
            report[name]["fxmeg_trace"] = [
                {"compute_s": r["compute_s"], "bubble": r["bubble"], "p2p_s": r["p2p_s"]}
                for r in timeline["ranks"]
            ]
    if rank == 0:
        print(
            json.dumps(
                {
                    "bench": "pipeline",
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
                    "results": report,
                }
            )
        )


def _variants(pp: int, layers: int):
    """(name, vpp, split_points, p2p): fxmeg's own cost-balanced cut and the peer's even
    cut, with eager point-to-point posting (fxmeg's choice on gloo); and Megatron's paired
    exchange on the even cut, to show what eager posting buys."""
    for name, vpp in (("1f1b", 1), ("interleaved", 2)):
        per = layers // (pp * vpp)
        even = [f"layers.{c * per}" for c in range(1, pp * vpp)]
        yield name, vpp, None, "auto"
        if vpp == 1:  # with one block per chunk the cost-balanced cut is the even one
            yield f"{name}_even_split", vpp, even, "auto"
        yield f"{name}_even_split_paired_p2p", vpp, even, "paired"


def _single_process_time(rank: int, base: GPT, ids, labels, args) -> float:
    """Median step time of plain PyTorch on rank 0 alone (others wait), same micro-batching."""
    took = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = plain_step(model, opt, ids, labels, args.m, args.mbs)
        times = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        took[0] = median(times[args.warmup:])
    dist.broadcast(took, 0)
    return float(took)


def _saved_peak(step, params) -> list[int]:
    meter = SavedBytes(params)
    with meter.hooks():
        step()
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([meter.peak]))
    return [int(p) for p in peaks]


def main() -> None:
    p = parser(__doc__, pp=2)
    spawn(p.parse_args().pp, run, p.parse_args())


if __name__ == "__main__":
    main()
