"""Peak memory of a rank against plain single-process training (issue 17). One JSON line.

The model: GPT, 24 layers, hidden 1024, vocabulary 8192 (about 310M parameters), seq 128,
micro-batch 1, fp32, AdamW, distributed optimizer off, a few steps. Each process measures
its peak resident set (``VmHWM``: ``devices.peak_resident``) above its own baseline (after
imports, before the model is built), so the interpreter and torch's libraries do not count.

  plain          one process, the model trained with plain PyTorch (the reference)
  real-pp4       fxmeg at pp=4, the model built with real tensors on every rank
  real-tp2pp2    fxmeg at tp=2 x pp=2, real tensors
  meta-pp4       fxmeg at pp=4, the model built on meta (init_fn, seed)
  meta-tp2pp2    fxmeg at tp=2 x pp=2, built on meta
  real-dp4z1     fxmeg at dp=4, zero=1 (the distributed optimizer), and likewise
  real-dp4z2     zero=2 (gradients sharded too) and
  real-dp4z3     zero=3 (parameters sharded too)
  real-dp4z3b4m  zero=3 with buckets of at most 4M elements (bucket_size) instead of a block
  real-dp4z3b4mpost  and backward_prefetch='post' (one bucket of parameters and one of
                 gradients whole at a time in backward)
  meta-dp4z3     zero=3, the model built on meta: each rank makes only what its shard covers

Every process runs with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_,
unless set): by default glibc raises it as blocks are freed (up to 32 MiB), so freed tensors
stay resident and a run that frees much (zero=3 frees its parameters bucket by bucket) would
be charged for memory it no longer uses. The same setting for every run, plain's included.

``ratio`` is a run's largest rank peak over plain's peak. For the meta runs,
``largest_module_bytes`` is the largest module's parameters (the most a rank ever makes
full size at once) and ``share_bytes`` the most-loaded rank's parameters + gradients +
Adam state. ``peak_after_parallelize`` is a rank's peak once parallelize returned
(parameters and gradient buffers made, Adam's state not yet): for a meta run it stays
far below the full model (``plain.params`` x 4 bytes), i.e. no rank ever made it whole.
``plan`` is ``fxmeg.plan``'s total for the most loaded stage (no process: the model on meta),
and ``plan_over_worst`` that prediction over the measured worst peak.

    python bench/memory.py [--layers 24 --hidden 1024 --vocab 8192 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import spawn, write_gathered  # noqa: E402
from fxmeg.diagnostics.devices import peak_resident  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def rss() -> int:
    """Current resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """Peak resident set of this process so far, bytes (its own: ``peak_resident``)."""
    return peak_resident()


def config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=16, n_embd=args.hidden
    )


def batch(args, rows: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def plain(args, out: str) -> None:
    torch.set_num_threads(1)
    base = rss()
    torch.manual_seed(0)
    model = GPT(config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, labels = batch(args, args.m)
    for _ in range(args.steps):
        opt.zero_grad()
        for i in range(args.m):
            model(ids[i : i + 1], labels[i : i + 1]).div(args.m).backward()
        opt.step()
    with open(out, "w") as f:
        json.dump({"peak": peak() - base, "params": sum(p.numel() for p in model.parameters())}, f)


def parallel(rank: int, world: int, args, layout: dict, meta: bool, out: str) -> None:
    base = rss()
    with torch.device("meta") if meta else torch.device("cpu"):
        torch.manual_seed(0)
        model = GPT(config(args))
    largest = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
    )
    ids, labels = batch(args, args.m)
    init = dict(init_fn=model.init_weights, seed=0) if meta else {}
    engine = fxmeg.parallelize(
        model,
        (ids[:1], labels[:1]),
        global_batch_size=args.m,
        **layout,
        **init,
        optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True),
    )
    # parameters and gradient buffers exist; Adam's state comes with the first step
    built = peak() - base
    for _ in range(args.steps):
        engine.train_step((ids, labels) if engine.needs_data else None)
    held = sum(p.numel() * p.element_size() for p in engine.named_parameters.values())
    report = {"rank": rank, "peak": peak() - base, "peak_after_parallelize": built,
              "largest_module_bytes": largest, "share_bytes": 4 * held, "params_bytes": held}
    write_gathered(report, out)


def _planned(args, layout: dict) -> int:
    """fxmeg.plan's total bytes of the most loaded stage, for 4 ranks (no process)."""
    with torch.device("meta"):
        model = GPT(config(args))
    ids, labels = batch(args, args.m)
    dp = 4 // (layout.get("tp", 1) * layout.get("pp", 1))
    plan = fxmeg.plan(model, (ids[:1], labels[:1]), global_batch_size=args.m, dp=dp, **layout)
    return max(s.total for s in plan.stages)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--m", type=int, default=4, help="micro-batches (of 1 row) per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--runs",
        default="plain,real-pp4,real-tp2pp2,meta-pp4,meta-tp2pp2,real-dp4z1,real-dp4z2,real-dp4z3,"
        "real-dp4z3b4m,real-dp4z3b4mpost,meta-dp4z3",
    )
    args = p.parse_args()
    # read by each (spawned) process
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    layouts = {"pp4": dict(pp=4, schedule="1f1b"), "tp2pp2": dict(tp=2, pp=2, schedule="1f1b"),
               **{f"dp4z{z}": dict(zero=z) for z in (1, 2, 3)},
               "dp4z3b4m": dict(zero=3, bucket_size=4_000_000),
               "dp4z3b4mpost": dict(zero=3, bucket_size=4_000_000, backward_prefetch="post")}
    result = {"model": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs.split(","):
            out = os.path.join(tmp, f"{run}.json")
            if run == "plain":  # a fresh process: its peak is its own
                proc = multiprocessing.get_context("spawn").Process(target=plain, args=(args, out))
                proc.start(), proc.join()
                with open(out) as f:
                    result["plain"] = json.load(f)
                continue
            kind, layout = run.split("-")
            spawn(4, parallel, args, layouts[layout], kind == "meta", out)
            with open(out) as f:
                ranks = json.load(f)
            worst = max(ranks, key=lambda r: r["peak"])
            result[run] = {
                "peak_per_rank": [r["peak"] for r in ranks],
                "worst": worst["peak"],
                "peak_after_parallelize": max(r["peak_after_parallelize"] for r in ranks),
                "params_bytes_per_rank": [r["params_bytes"] for r in ranks],
                "largest_module_bytes": worst["largest_module_bytes"],
                "share_bytes": max(r["share_bytes"] for r in ranks),
                "plan": _planned(args, layouts[layout]),
            }
            result[run]["plan_over_worst"] = round(result[run]["plan"] / worst["peak"], 3)
    if "plain" in result:
        for run, r in result.items():
            if isinstance(r, dict) and "worst" in r:
                r["ratio"] = round(r["worst"] / result["plain"]["peak"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
