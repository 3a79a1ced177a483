"""fxmeg zero=3 against torch FSDP2 (``fully_shard`` per block, then the root) and against
fxmeg zero=1 (and zero=3 with backward_prefetch='post'): the same GPT, the same global
batches, dp=2 on gloo, AdamW, clipping at 1.0.
One JSON line.

Each run is its own spawn, so that its peak resident set (``VmHWM``:
``devices.peak_resident``, above the rank's baseline after imports, the worst rank) is its
own; the runs alternate ``--rounds`` times in one window and each reports the median of its
rounds' median step times, as tokens/s. FSDP2
reduce-scatters every micro-batch's gradients, as fxmeg's zero=2 and 3 do.

    python bench/fsdp.py [--layers 4 --hidden 128 --seq 128 --m 8 --mbs 2 --steps 6 --rounds 2]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, spawn, timed, write_gathered  # noqa: E402
from fxmeg.diagnostics.devices import peak_resident  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

RUNS = ("fxmeg-zero3", "fsdp2", "fxmeg-zero1", "fxmeg-zero3-post")
"""fxmeg-zero3-post: zero=3 with backward_prefetch='post' (less memory, less overlap)."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return peak_resident()


def _data(args, world: int):
    g = torch.Generator().manual_seed(0)
    rows = args.mbs * args.m * world
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def run(rank: int, world: int, args, name: str, out: str) -> None:
    base = _rss()
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.hidden
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    ids, labels = _data(args, world)
    adamw = lambda g: torch.optim.AdamW(g, lr=1e-4)  # noqa: E731
    if name == "fsdp2":
        step = _fsdp2(model, rank, world, ids, labels, args)
    else:
        zero = (
            dict(zero=3, backward_prefetch="post")
            if name.endswith("-post")
            else dict(zero=int(name[-1]))
        )
        engine = fxmeg.parallelize(
            model,
            (ids[: args.mbs], labels[: args.mbs]),
            global_batch_size=len(ids),
            optimizer=adamw,
            **zero,
        )
        step = lambda: engine.train_step((ids, labels))  # noqa: E731
    times = [timed(step) for _ in range(args.warmup + args.steps)][args.warmup:]
    write_gathered({"peak": _peak() - base, "step_s": median(times)}, out)


def _fsdp2(model, rank: int, world: int, ids, labels, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mine = slice(rank * args.mbs * args.m, (rank + 1) * args.mbs * args.m)
    ids, labels = ids[mine], labels[mine]

    def step() -> None:
        opt.zero_grad()
        valid = torch.tensor(float((labels != -100).sum()))  # token-weighted over the global batch
        dist.all_reduce(valid)
        for i in range(args.m):
            rows = slice(i * args.mbs, (i + 1) * args.mbs)
            logits_loss = model(ids[rows], labels[rows])  # mean over the micro-batch's tokens
            (logits_loss * (labels[rows] != -100).sum() * world / valid).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def main() -> None:
    p = parser(__doc__, steps=6, rounds=2)
    args = p.parse_args()
    got: dict[str, list] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in RUNS:
                out = os.path.join(tmp, f"{name}.json")
                spawn(2, run, args, name, out)
                with open(out) as f:
                    got[name].append(json.load(f))
    tokens = args.mbs * args.m * 2 * args.seq
    result = {"model": vars(args), "world": 2}
    for name, rounds in got.items():
        step = median([max(r["step_s"] for r in ranks) for ranks in rounds])
        result[name] = {
            "tokens_per_s": round(tokens / step, 1),
            "step_s": round(step, 4),
            "peak_bytes": max(r["peak"] for ranks in rounds for r in ranks),
            "step_s_per_round": [round(max(r["step_s"] for r in ranks), 4) for ranks in rounds],
        }
    result["zero3_over_fsdp2"] = {
        "tokens_per_s": round(
            result["fxmeg-zero3"]["tokens_per_s"] / result["fsdp2"]["tokens_per_s"], 3
        ),
        "peak": round(result["fxmeg-zero3"]["peak_bytes"] / result["fsdp2"]["peak_bytes"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
