"""The layout search's predictions against measured runs on this machine (issue 47). One
JSON line per model.

For each model (the bench GPT, and a tiny Hugging Face Mixtral so that ep is in the space),
``fxmeg.planner.search`` lists every legal layout on 2 ranks of ``--cluster local`` at a fixed
global batch (micro-batches of 1 and 2 samples, vpp up to 2); each is then trained for real
(2 gloo processes, the layout's own split points): ``--steps`` timed steps after
``--warmup``, the median step and each rank's peak resident set above its baseline (after
imports, glibc's mmap threshold at 64 KiB as bench/memory.py sets it; denormals flushed).
Reported: Spearman's rank correlation of predicted and measured step times, whether the
measured best is in the predicted top 3, the median step-time error, per layout the
predicted peak over the measured one, and the "no false fits" check: with a per-rank cap
just under the measured peaks of the largest quarter of the layouts, which layouts the
planner calls fitting that measured over it, which it rejects that measured under, and how
many it calls tight (predicted within its memory error of the cap: neither).

Exits 1 after printing, naming each metric past its bar (``failures``: Spearman, the top 3,
the median step error, false fits, the share of peaks within the memory error).

With ``--memory-ranks 4,8`` also the peaks of a sample of 4- and 8-rank layouts (time is
not meaningful there: 8 ranks share 2 cores), predicted with the 2-rank calibration's
reserve (``search(timed=False)``).

    python bench/search_check.py                   # both models, every layout (~45 min)
    python bench/search_check.py --models gpt --limit 12
    python bench/search_check.py --models gpt --limit 1 --memory-ranks 4,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import spawn, timed, write_gathered  # noqa: E402
from fxmeg.diagnostics.devices import peak_resident  # noqa: E402

SEQ, GBS = 256, 8

# The bars, from the measured runs in docs/planner.md (2 ranks, every legal layout, a quiet
# machine, 2026-12-06: GPT 96 layouts, tiny Mixtral 138), each with margin for this machine's
# noise (the same layout's step varies by up to 30% between runs).
SPEARMAN_MIN = 0.9
"""Spearman of predicted and measured step times: measured 0.976 (GPT) and 0.952 (Mixtral)."""
SPEARMAN_MIN_LAYOUTS = 10
"""Fewer measured layouts (``--limit``) are not held to SPEARMAN_MIN: over 4, one swapped
pair alone gives 0.8."""
MEDIAN_STEP_ERROR_MAX = 0.15
"""Median of |predicted - measured| / measured step: 7.2% and 8.7% in that run, 4.3-9.6% in
earlier ones; 1.5x the worst of them. A calibration taken while another process shared the
cores gave 32%: a failure here may be that (move ~/.cache/fxmeg/twin-*.json away, rerun)."""
FALSE_FITS_MAX = 0
"""Layouts called fitting that measured over the cap: 0 of 96 and of 138 (no margin: a false
fit is the planner's one promise broken, `fxmeg train --layout auto` would pick it)."""
PEAKS_WITHIN_ERROR_MIN = 0.9
"""The share of layouts whose predicted peak is within 10% (``memory_error``) of the measured
one, at 2 ranks and in each ``--memory-ranks`` sample: measured all of them (96 of 96, 138
of 138; 4 of 4 at 4 and 8 ranks)."""


def build(kind: str, device: str, seq: int = SEQ):
    with torch.device(device):
        torch.manual_seed(0)
        if kind == "gpt":
            from models.gpt import GPT, GPTConfig

            return GPT(GPTConfig(vocab_size=8192, seq_len=seq, n_layer=4, n_head=8, n_embd=256))
        import transformers as T

        cfg = T.MixtralConfig(vocab_size=4096, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                              num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=seq)
        return T.AutoModelForCausalLM.from_config(cfg)


def batch(kind: str, rows: int, device: str = "cpu", seq: int = SEQ):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (rows, seq), generator=g).to(device)
    labels = torch.roll(ids, -1, 1)
    if kind == "gpt":
        return ids, labels
    from fxmeg.interop.hugging_face import keyword_batch

    return keyword_batch(ids, labels)


def _rows(b, a: int, z: int):
    return {k: t[a:z] for k, t in b.items()} if isinstance(b, dict) else tuple(t[a:z] for t in b)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train(rank: int, world: int, kind: str, options: dict, split, args, out: str) -> None:
    import fxmeg

    torch.set_flush_denormal(True)  # as the calibration: denormals slow a CPU 5-10x
    base = _rss()
    # built on meta, its values made by fxmeg (as `fxmeg train` does a large model): what the
    # rank holds is fxmeg's alone
    seq = getattr(args, "seq", SEQ)
    model = build(kind, "meta", seq)
    init = {"init_fn": model.init_weights} if kind == "gpt" else {}
    mbs = options["micro_batch_size"]
    data = batch(kind, GBS, seq=seq)
    engine = fxmeg.parallelize(
        model, _rows(data, 0, mbs), global_batch_size=GBS, split_points=split, seed=0, **init,
        **{k: v for k, v in options.items() if k != "micro_batch_size"},
        optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4))
    times = []
    for i in range(args.warmup + args.steps):
        t = timed(lambda: engine.train_step(data if engine.needs_data else None))
        if i >= args.warmup:
            times.append(t)
    peak = peak_resident() - base
    write_gathered({"step": statistics.median(times), "peak": peak}, out)


def space(layout) -> bool:
    """The layouts measured: micro-batches of 1 and 2 samples, vpp up to 2."""
    return layout.micro_batch_size <= 2 and layout.vpp <= 2


def run(kind: str, world: int, pool, args, tag: str) -> list[dict]:
    """Each ranked layout of ``pool`` trained on ``world`` ranks: predicted and measured."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(pool):
            out = os.path.join(tmp, f"{i}.json")
            print(f"[{tag} {i + 1}/{len(pool)}] {r.layout} ...", file=sys.stderr, flush=True)
            try:
                spawn(world, train, kind, r.layout.options(), r.estimate.split_points, args,
                      out)
            except Exception as e:  # a layout fxmeg accepts and fails to run: reported
                failed = str(e).strip().splitlines()[-1][:300]
                rows.append({"layout": str(r.layout), "failed": failed})
                print(f"[{tag} {i + 1}/{len(pool)}] {r.layout}: FAILED {failed}",
                      file=sys.stderr, flush=True)
                continue
            with open(out) as f:
                ranks = json.load(f)
            step, peak = max(x["step"] for x in ranks), max(x["peak"] for x in ranks)
            rows.append({"layout": str(r.layout), "predicted_step": r.estimate.step,
                         "measured_step": step, "predicted_peak": r.estimate.peak,
                         "measured_peak": peak, "peak_ratio": round(r.estimate.peak / peak, 3)})
            print(f"[{tag} {i + 1}/{len(pool)}] {r.layout}: step {step:.3f} s (predicted "
                  f"{r.estimate.step:.3f}), peak {peak / 2**20:.0f} MiB (predicted "
                  f"{r.estimate.peak / 2**20:.0f})", file=sys.stderr, flush=True)
    return rows


def no_false_fits(rows: list[dict], error: float) -> dict:
    """A cap just under the measured peaks of the largest quarter, and the planner's verdict
    on each layout against it (``memory_verdict`` with the cluster's ``memory_error``):
    those it calls fitting that measured over the cap, those it rejects that measured under,
    and how many it calls tight (within its error of the cap: neither)."""
    from fxmeg.planner.search import memory_verdict

    peaks = sorted(x["measured_peak"] for x in rows)
    cap = peaks[min(len(peaks) - 1, (3 * len(peaks)) // 4)] - 2**20
    verdict = {x["layout"]: memory_verdict(x["predicted_peak"], cap, error) for x in rows}
    return {"cap": cap, "error": error,
            "called_fitting": sum(v == "fits" for v in verdict.values()),
            "tight": sum(v == "tight" for v in verdict.values()),
            "rejected": sum(v == "over" for v in verdict.values()),
            "measured_fitting": sum(x["measured_peak"] <= cap for x in rows),
            "false_fits": [x["layout"] for x in rows
                           if verdict[x["layout"]] == "fits" and x["measured_peak"] > cap],
            "false_rejects": [x["layout"] for x in rows
                              if verdict[x["layout"]] == "over" and x["measured_peak"] <= cap]}


def memory(kind: str, world: int, reserved: int, args) -> dict:
    """Peaks of a sample of ``world``-rank layouts against the planner's (the 2-rank
    calibration's ``reserved``; time not modelled: ``timed=False``)."""
    from fxmeg.planner.cluster import cluster
    from fxmeg.planner.search import search

    local = cluster(f"local:ranks_per_node={world},memory=1TB,reserved={reserved}B")
    found = search(build(kind, "meta"), batch(kind, 1, "meta"), cluster=local,
                   global_batch_size=GBS, precision="fp32", space=space, timed=False)
    pool = sorted(found.ranked, key=lambda r: r.layout)
    pool = random.Random(world).sample(pool, min(args.memory_limit, len(pool)))
    rows = run(kind, world, pool, argparse.Namespace(warmup=1, steps=1), f"{kind} {world}")
    failed = [x for x in rows if "failed" in x]
    rows = [x for x in rows if "failed" not in x]
    return {"ranks": world, "legal": found.legal, "measured": len(rows), "failed": failed,
            "layouts_peak_within_10pct": sum(abs(x["peak_ratio"] - 1) <= 0.1 for x in rows),
            "peak_ratio_range": [min(x["peak_ratio"] for x in rows),
                                 max(x["peak_ratio"] for x in rows)],
            "rows": [{k: x[k] for k in ("layout", "predicted_peak", "measured_peak",
                                        "peak_ratio")} for x in rows]}


def check(kind: str, args) -> dict:
    from fxmeg.planner.cluster import cluster
    from fxmeg.planner.estimate import spearman
    from fxmeg.planner.search import search

    local = cluster("local:ranks_per_node=2,memory=1TB")
    example = batch(kind, 1, "meta")
    start = time.perf_counter()
    found = search(build(kind, "meta"), example, cluster=local, global_batch_size=GBS,
                   precision="fp32", space=space)
    searched = time.perf_counter() - start
    pool = sorted(found.ranked, key=lambda r: r.layout)  # the same sample every run
    if args.limit and len(pool) > args.limit:
        pool = random.Random(0).sample(pool, args.limit)
    rows = run(kind, 2, pool, args, kind)
    failed = [x for x in rows if "failed" in x]
    rows = [x for x in rows if "failed" not in x]
    reserved = found.ranked[0].estimate.stages[0].reserved
    pred = [x["predicted_step"] for x in rows]
    meas = [x["measured_step"] for x in rows]
    order = sorted(range(len(rows)), key=lambda i: pred[i])
    best = min(range(len(rows)), key=lambda i: meas[i])
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    return {
        "model": kind, "legal": found.legal, "searched_s": round(searched, 1),
        "measured": len(rows), "spearman": round(spearman(pred, meas), 3),
        "best_measured_in_predicted_top3": best in order[:3],
        "median_step_error": round(statistics.median(errors), 3),
        "peak_ratio_range": [min(x["peak_ratio"] for x in rows),
                             max(x["peak_ratio"] for x in rows)],
        "layouts_peak_within_10pct": sum(abs(x["peak_ratio"] - 1) <= 0.1 for x in rows),
        "no_false_fits": no_false_fits(rows, local.device.memory_error),
        "reserved": reserved, "failed": failed,
        "memory": [memory(kind, int(w), reserved, args) for w in args.memory_ranks.split(",")
                   if w],
        "cluster": local.to_dict(), "rows": rows,
    }


def failures(report: dict) -> list[str]:
    """One model's ``check`` report against the bars above: a line per metric past its bar,
    naming the metric, its value and the bar."""
    model, n = report["model"], report["measured"]
    out = []
    if n >= SPEARMAN_MIN_LAYOUTS and report["spearman"] < SPEARMAN_MIN:
        out.append(f"{model}: spearman {report['spearman']} < SPEARMAN_MIN {SPEARMAN_MIN} "
                   f"over {n} layouts")
    if not report["best_measured_in_predicted_top3"]:
        out.append(f"{model}: best_measured_in_predicted_top3 is false: the measured fastest "
                   f"of {n} layouts is not among the 3 predicted fastest")
    if report["median_step_error"] > MEDIAN_STEP_ERROR_MAX:
        out.append(f"{model}: median_step_error {report['median_step_error']} > "
                   f"MEDIAN_STEP_ERROR_MAX {MEDIAN_STEP_ERROR_MAX}")
    false_fits = report["no_false_fits"]["false_fits"]
    if len(false_fits) > FALSE_FITS_MAX:
        out.append(f"{model}: {len(false_fits)} false fits > FALSE_FITS_MAX {FALSE_FITS_MAX} "
                   f"(called fitting, measured over the cap): {', '.join(false_fits)}")
    for sample in [dict(report, ranks=2), *report["memory"]]:
        share = sample["layouts_peak_within_10pct"] / sample["measured"]
        if share < PEAKS_WITHIN_ERROR_MIN:
            out.append(f"{model} at {sample['ranks']} ranks: layouts_peak_within_10pct "
                       f"{sample['layouts_peak_within_10pct']} of {sample['measured']} "
                       f"({share:.0%}) < PEAKS_WITHIN_ERROR_MIN {PEAKS_WITHIN_ERROR_MIN:.0%}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,moe")
    p.add_argument("--limit", type=int, default=0, help="measure this many layouts (0: all)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-ranks", default="", help="e.g. 4,8: peaks of larger layouts too")
    p.add_argument("--memory-limit", type=int, default=6, help="layouts per --memory-ranks")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = []
    for kind in args.models.split(","):
        report = check(kind, args)
        print(json.dumps({"bench": "search_check"} | report), flush=True)
        failed += failures(report)
    if failed:
        sys.exit("search_check: predictions past their bars (docs/planner.md):\n  "
                 + "\n  ".join(failed))


if __name__ == "__main__":
    main()
