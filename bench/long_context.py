"""Long context under each ``cp_comm_type`` (issue 48): memory and speed at cp=4. One JSON line.

A 2-layer decoder (bench/torch_ring.py's ``Decoder``: learned positions, 4 heads of 32, a GELU
MLP, vocabulary 256) at sequence 16384, micro-batch 1, fp32, on 4 gloo ranks at cp=4 (4096
tokens each). Every measurement runs in its own spawn, so each process's peak is its own; glibc's
mmap threshold is fixed at 64 KiB (as bench/memory.py does) so freed blocks leave the
resident set.

  attention  the attention alone, as the cp pass emits it for the mode (all_gather:
             fxmeg::cp_attention; p2p: cp_ring_attention; a2a: cp_to_heads, SDPA over the
             whole sequence, cp_from_heads; a2a+p2p: both, all-to-all in pairs), forward and
             backward of one layer's q, k, v (1, 4, 4096, 32): the peak resident set above
             the baseline taken once the inputs exist, i.e. the attention's working set
             per rank (``working_set_vs_all_gather``: over all_gather's)
  step       training steps of the model (AdamW; one warm-up, then ``--steps`` timed): the
             slowest rank's step time, tokens/s (the global batch's tokens over it), and the
             peak resident set above the baseline taken after parallelize
  torch      torch's own ring attention (torch.distributed.tensor.experimental
             .context_parallel) on the same model and shapes, forward and backward (no
             optimizer step): stock torch does not run it on a CPU (``torch_stock``: its
             error); ``torch`` is it with bench/torch_ring.py's shim, which hands the CPU
             attention kernel to torch's own ring code

The 4 ranks share this machine's cores: step times compare the modes with each other on
one machine; they say nothing of a GPU cluster's.

    python bench/long_context.py [--seq 16384 --steps 2 --modes all_gather,p2p,a2a,a2a+p2p]
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
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxmeg  # noqa: E402
from bench.common import spawn, write_gathered  # noqa: E402
from bench.torch_ring import Loss, _make, torch_ring_step  # noqa: E402
from fxmeg.diagnostics.devices import peak_resident  # noqa: E402

CP, HEADS, HEAD_DIM, VOCAB = 4, 4, 32, 256
MODES = ("all_gather", "p2p", "a2a", "a2a+p2p")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    return peak_resident()


def _options(mode: str) -> dict:
    return {"cp_comm_type": mode} | ({"cp_a2a_size": 2} if mode == "a2a+p2p" else {})


def attention(rank: int, world: int, seq: int, mode: str, out: str) -> None:
    """One layer's attention under ``mode``, forward and backward, on this rank's rows."""
    import fxmeg.runtime.collectives  # noqa: F401  (registers the kernels)
    from fxmeg.torch_private import release_world_capture

    release_world_capture()  # as an engine does (docs/reliability.md, "Process exit")

    ops, group = torch.ops.fxmeg, dist.group.WORLD.group_name
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, HEADS, seq // world, HEAD_DIM, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, HEADS, seq // world, HEAD_DIM)
    dist.barrier()
    base = rss()
    inner = fxmeg.ParallelConfig(cp=world, **_options(mode)).cp_inner
    t0 = time.perf_counter()
    if mode == "all_gather":
        y = ops.cp_attention(q, k, v, None, False, world, group)
    else:
        qh, kh, vh = ((ops.cp_to_heads(t, 2, world, inner, group) for t in (q, k, v))
                      if inner > 1 else (q, k, v))
        if inner == world:
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            y = ops.cp_ring_attention(qh, kh, vh, None, True, None, False, world, inner, group)[0]
        y = ops.cp_from_heads(y, 2, world, inner, group) if inner > 1 else y
    y.backward(grad)
    took = time.perf_counter() - t0
    write_gathered({"rank": rank, "working_set": peak() - base, "seconds": took}, out)


def step(rank: int, world: int, seq: int, mode: str, steps: int, out: str) -> None:
    """Training steps of the 2-layer model at cp=world under ``mode``."""
    _, tokens, labels, pos = _make(seq)
    torch.manual_seed(0)
    model = Loss(seq)
    batch = (tokens, pos, labels)
    engine = fxmeg.parallelize(model, batch, cp=world, global_batch_size=1, **_options(mode),
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    base = rss()
    engine.train_step(batch)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(batch)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    write_gathered({"rank": rank, "peak": peak() - base, "step_s": min(times)}, out)


def torch_ring(rank: int, world: int, seq: int, steps: int, shim: bool, out: str) -> None:
    """torch's own ring attention on the same model and shapes (bench/torch_ring.py)."""
    write_gathered(torch_ring_step(rank, world, seq, steps, cpu_shim=shim), out)


def _run(fn, *args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        spawn(CP, fn, *args, out)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-torch", action="store_true", help="skip torch's ring")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ["OMP_NUM_THREADS"] = "1"
    report: dict = {"seq": args.seq, "cp": CP, "heads": HEADS, "head_dim": HEAD_DIM, "modes": {}}
    for mode in args.modes.split(","):
        print(f"[long_context] {mode}: attention alone", file=sys.stderr, flush=True)
        att = _run(attention, args.seq, mode)
        print(f"[long_context] {mode}: training steps", file=sys.stderr, flush=True)
        run = _run(step, args.seq, mode, args.steps)
        step_s = max(r["step_s"] for r in run)
        report["modes"][mode] = {
            "attention_working_set_mib": round(max(r["working_set"] for r in att) / 2**20, 1),
            "attention_s": round(max(r["seconds"] for r in att), 3),
            "step_peak_mib": round(max(r["peak"] for r in run) / 2**20, 1),
            "step_s": round(step_s, 3),
            "tokens_per_s": round(args.seq / step_s, 1),
        }
    modes = report["modes"]
    if "all_gather" in modes:
        whole = modes["all_gather"]["attention_working_set_mib"]
        for m in modes.values():
            m["working_set_vs_all_gather"] = round(m["attention_working_set_mib"] / whole, 3)
    if not args.no_torch:
        print("[long_context] torch's ring, stock", file=sys.stderr, flush=True)
        stock = _run(torch_ring, args.seq, args.steps, False)[0]
        report["torch_stock"] = {k: stock[k] for k in ("ok", "error") if k in stock}
        print("[long_context] torch's ring, with the CPU shim", file=sys.stderr, flush=True)
        ranks = _run(torch_ring, args.seq, args.steps, True)
        if not ranks[0]["ok"]:
            report["torch"] = ranks[0]
        else:
            took = max(r["step_s"] for r in ranks)
            report["torch"] = {
                "ok": True, "shim": True,
                "step_peak_mib": round(max(r["peak_rss_bytes_above_baseline"] for r in ranks)
                                       / 2**20, 1),
                "forward_backward_s": round(took, 3),
                "tokens_per_s": round(args.seq / took, 1),
            }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
