"""Expert parallelism: a Mixtral-like Hugging Face model at ep=2 against its experts
replicated (ep=1), on 2 gloo ranks (dp=2 both), same global batch. One JSON line.

The model: ``transformers.MixtralConfig`` with 8 experts, top-2, hidden 256, 4 layers,
intermediate 512, 4 heads (2 key-value), vocabulary 2048, built with
``AutoModelForCausalLM.from_config`` (experts implementation as transformers picks it),
fp32, AdamW; seq 128, m micro-batches of mbs rows per rank.

  ep1   experts replicated: each rank holds all 8 experts of every layer
  ep2   ep=2 over the 2 dp ranks: each rank holds 4, tokens routed to the other's experts
        go there and back by all-to-all (fxmeg/runtime/experts.py)

Speed: both engines in one spawn, steps alternated (ep1, ep2, ep2, ep1, ...), each step
timed as the slowest rank's; tokens/s from the median step, spread as min / max. Every
timed step of both is traced (``train_step(trace=True)``): the all-to-all time is the
sum of a rank's ``ep_a2a`` spans (counts exchange, dispatch, combine, and backward's two
gradient all-to-alls; on gloo they block, so the time includes waiting for the other
rank), its share of the step the median over steps of that sum over the rank's step span.

Memory, per rank: ``state_bytes``, what the engine holds (parameters, gradient buffers,
optimizer state: Adam's moments, fp32 masters where they are copies), counted exactly;
and, as bench/memory.py measures it, the peak resident set above the process's baseline
(after imports, before the model is built), in a fresh 2-rank spawn per run: ``peak``
over the whole run, ``peak_after_parallelize``, and ``peak_training``, the peak of the
training steps alone (the high-water mark is reset after parallelize; each rank builds the
whole model first, so the whole-run peak mostly shows that).

    python bench/moe.py                  # m 4, mbs 2, 10 timed steps each, 3 for memory
    python bench/moe.py --steps 2 --warmup 1 --layers 2 --hidden 128 --mem-steps 1
    # also writes ep1.json / ep2.json for fxmeg plot-schedule:
    python bench/moe.py --trace runs/moe-trace
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, spawn, timed, write_gathered  # noqa: E402
from bench.memory import peak, rss  # noqa: E402
from fxmeg.diagnostics.devices import peak_resident  # noqa: E402
from fxmeg.runtime import timelines  # noqa: E402

RUNS = {"ep1": 1, "ep2": 2}


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as T

    cfg = T.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg)


def batch(args: argparse.Namespace, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.mbs * args.m * world, args.seq), generator=g)
    return ids, torch.randint(0, args.vocab, ids.shape, generator=g)


def engine(args: argparse.Namespace, ep: int, ids: torch.Tensor, labels: torch.Tensor):
    return fxmeg.parallelize(make_model(args), (ids[: args.mbs], labels[: args.mbs]), ep=ep,
                             global_batch_size=len(ids),
                             optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True))


def state_bytes(engine) -> dict[str, int]:
    """What the engine holds on this rank: parameters, gradient buffers, optimizer state
    (each storage counted once: an fp32 master that is the parameter itself is not)."""
    ctx = engine.context
    params = list(ctx.named_parameters.values())
    grads = [b.data for b in ctx.ddp.all()]
    seen = {t.untyped_storage().data_ptr() for t in params + grads}
    opt = [
        p.master for p in ctx.optimizer.pieces if p.master.untyped_storage().data_ptr() not in seen
    ]
    opt += [v for s in ctx.optimizer.inner.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in
           (("params", params), ("grads", grads), ("optimizer", opt))}
    return out | {"total": sum(out.values())}


def a2a(events: list[tuple]) -> tuple[float, float, dict[str, float]]:
    """From one traced step: seconds in expert all-to-alls, the step's seconds, and the
    all-to-all seconds by span name."""
    by_name: dict[str, float] = {}
    for name, cat, start, end in events:
        if cat == "ep_a2a":
            by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e9
    step = next(end - start for _, cat, start, end in events if cat == "step") / 1e9
    return sum(by_name.values()), step, by_name


def speed(rank: int, world: int, args: argparse.Namespace) -> None:
    ids, labels = batch(args, world)
    engines = {name: engine(args, ep, ids, labels) for name, ep in RUNS.items()}
    steps = {
        name: (lambda e=e: e.train_step((ids, labels), trace=True)) for name, e in engines.items()
    }
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    traced = {name: [] for name in steps}
    load_before = os.getloadavg()[0]
    for i in range(args.steps):  # alternate who goes first: the CPUs are noisy
        order = list(steps) if i % 2 == 0 else list(steps)[::-1]
        for name in order:
            times[name].append(timed(steps[name]))
            traced[name].append(a2a(engines[name].context.tracer.events))
    mine = {name: {"state_bytes": state_bytes(e),
                   "a2a_s": median([t[0] for t in traced[name]]),
                   "a2a_share": median([t[0] / t[1] for t in traced[name]]),
                   "a2a_by_name_s": {k: median([t[2].get(k, 0.0) for t in traced[name]])
                                     for k in sorted({k for t in traced[name] for k in t[2]})}}
            for name, e in engines.items()}
    if args.trace:
        for name, e in engines.items():  # the last step's timeline, every rank's
            gathered = timelines.gather(e.context.tracer.events, f"rank {rank} ({name})")
            if gathered:
                os.makedirs(args.trace, exist_ok=True)
                timelines.write(os.path.join(args.trace, f"{name}.json"), *gathered)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank != 0:
        return
    tokens = len(ids) * args.seq
    result = {"load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]}}
    for name, ep in RUNS.items():
        t = times[name]
        result[name] = {
            "ep": ep,
            "tokens_per_s": tokens / median(t),
            "median_step_s": median(t),
            "min_step_s": min(t),
            "max_step_s": max(t),
            "state_bytes_per_rank": [r[name]["state_bytes"] for r in ranks],
            "all_to_all": {
                "s_per_step": [r[name]["a2a_s"] for r in ranks],
                "share_of_step": [r[name]["a2a_share"] for r in ranks],
                "by_name_s": [r[name]["a2a_by_name_s"] for r in ranks],
            }
            if ep > 1
            else None,
        }
    result["ratio_ep2_over_ep1_tokens_per_s"] = median(times["ep1"]) / median(times["ep2"])
    result["ratio_ep2_over_ep1_state_bytes"] = max(
        s["total"] for s in result["ep2"]["state_bytes_per_rank"]
    ) / max(s["total"] for s in result["ep1"]["state_bytes_per_rank"])
    with open(args.out, "w") as f:
        json.dump(result, f)


def hwm() -> int:
    """Peak resident set since the last reset (``reset_hwm``), bytes."""
    return peak_resident()


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak resident set starts again from the current one
        return True
    except OSError:
        return False


def memory(rank: int, world: int, args: argparse.Namespace, ep: int, out: str) -> None:
    base = rss()
    ids, labels = batch(args, world)
    e = engine(args, ep, ids, labels)
    built = peak() - base
    reset = reset_hwm()
    for _ in range(args.mem_steps):
        e.train_step((ids, labels))
    training = (hwm() if reset else peak()) - base
    report = {"peak": max(built, training), "peak_after_parallelize": built,
              "peak_training": training if reset else None, "state_bytes": state_bytes(e)["total"]}
    write_gathered(report, out)


def main() -> None:
    p = parser(__doc__, m=4, mbs=2, layers=4, hidden=256, seq=128, vocab=2048, steps=10, warmup=2)
    p.add_argument("--intermediate", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--mem-steps", type=int, default=3, help="steps of each memory spawn (0: none)")
    p.add_argument("--trace", default="", help="write each run's last timed step's trace here")
    args = p.parse_args()
    world = 2
    result = {
        "bench": "moe",
        "backend": "gloo",
        "dp": world,
        "m": args.m,
        "mbs": args.mbs,
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "experts": args.experts,
            "top_k": args.top_k,
            "seq": args.seq,
            "vocab": args.vocab,
        },
        "steps": args.steps,
        "warmup": args.warmup,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args.out = os.path.join(tmp, "speed.json")
        spawn(world, speed, args)
        with open(args.out) as f:
            speed_result = json.load(f)
        for name, ep in RUNS.items() if args.mem_steps else ():
            out = os.path.join(tmp, f"{name}.json")
            spawn(world, memory, args, ep, out)
            with open(out) as f:
                ranks = json.load(f)
            speed_result[name]["rss"] = {
                k: [r[k] for r in ranks]
                for k in ("peak", "peak_after_parallelize", "peak_training")
            }
    result |= speed_result
    if (
        args.mem_steps
        and None
        not in result["ep1"]["rss"]["peak_training"] + result["ep2"]["rss"]["peak_training"]
    ):
        result["ratio_ep2_over_ep1_peak_training"] = (max(result["ep2"]["rss"]["peak_training"])
                                                      / max(result["ep1"]["rss"]["peak_training"]))
    result["experts_implementation"] = make_model(args).config._experts_implementation
    result["wall_s"] = time.perf_counter() - t0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
