"""compile=True vs eager fxmeg (and plain PyTorch): same GPT, same micro-batching, one
process, steps alternated in one run. One JSON line: median step times and ratios.

    python bench/compile.py              # GPT 4 layers x 128, seq 128, m=8 x mbs 2
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import median, parser, plain_step  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = parser(__doc__, warmup=3)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    base = GPT(
        GPTConfig(
            vocab_size=args.vocab,
            seq_len=args.seq,
            n_layer=args.layers,
            n_head=4,
            n_embd=args.hidden,
        )
    )
    rows = args.mbs * args.m
    ids = torch.randint(0, args.vocab, (rows, args.seq))
    labels = torch.randint(0, args.vocab, (rows, args.seq))
    example = (ids[: args.mbs], labels[: args.mbs])
    adam = lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True)  # noqa: E731
    t0 = time.perf_counter()
    compiled = fxmeg.parallelize(
        copy.deepcopy(base), example, global_batch_size=rows, compile=True, optimizer=adam
    )
    compiled.train_step((ids, labels))  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    eager = fxmeg.parallelize(copy.deepcopy(base), example, global_batch_size=rows, optimizer=adam)
    plain = copy.deepcopy(base)
    opt = adam(list(plain.parameters()))

    plain_pytorch = plain_step(plain, opt, ids, labels, args.m, args.mbs)

    runs = {"compiled": lambda: compiled.train_step((ids, labels)),
            "eager": lambda: eager.train_step((ids, labels)), "plain_pytorch": plain_pytorch}
    times = {k: [] for k in runs}
    for i in range(args.warmup + args.steps):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    med = {k: median(v) for k, v in times.items()}
    tokens = rows * args.seq
    print(
        json.dumps(
            {
                "bench": "compile",
                "m": args.m,
                "mbs": args.mbs,
                "steps": args.steps,
                "model": {
                    "layers": args.layers,
                    "hidden": args.hidden,
                    "seq": args.seq,
                    "vocab": args.vocab,
                },
                "step_s": med,
                "tokens_per_s": {k: tokens / v for k, v in med.items()},
                "speedup_compiled_over_eager": med["eager"] / med["compiled"],
                "eager_over_plain_pytorch": med["plain_pytorch"] / med["eager"],
                "first_step_with_compilation_s": compile_s,
            }
        )
    )


if __name__ == "__main__":
    main()
