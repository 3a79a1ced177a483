"""Published large runs, predicted by the layout search's time and memory model (on paper:
nothing runs). For each: does fxmeg judge the published layout to fit, and what TFLOP/s per
GPU does it predict, with the GPU preset's default efficiency and after one calibration
per GPU type (the efficiency scaled so that one published run per GPU is matched, the
others then predicted). Prints JSON; docs/published-layouts.md holds the table.

    OMP_NUM_THREADS=1 python bench/published_layouts.py [--only NAME] [--search]

A publication gives tp, cp, pp and dp, not always the schedule, vpp or recompute mode:
those are searched (fxmeg's variants of the published layout: vpp 1/2/4, recompute
none/selective/full, micro-batch 1) and the fastest that fits is reported beside each
variant's peak. GPU step times are unvalidated until run on those GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fxmeg.errors import FxmegError  # noqa: E402
from fxmeg.planner.cluster import cluster  # noqa: E402
from fxmeg.planner.search import Layout, Searcher, memory_verdict  # noqa: E402


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str  # "llama" or "gpt"
    shape: dict
    seq: int
    global_batch: int
    gpu: str  # a cluster preset
    gpus: int
    tp: int
    cp: int
    pp: int
    tflops: float
    """Published model TFLOP/s per GPU."""
    calibrates: bool = False
    """The run that sets its GPU type's efficiency."""


LLAMA_405B = dict(vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8, n_embd=16384,
                  ffn_hidden=53248, rope_theta=500000.0)
RUNS = [
    Run("llama3-405b-8k", "Llama 3 (Meta 2024): 8K-context pre-training on 16,384 H100s, "
        "tp8 cp1 pp16 dp128, 16M tokens per step", "llama", LLAMA_405B, 8192, 2048, "h100",
        16384, 8, 1, 16, 400.0, calibrates=True),
    Run("llama3-405b-128k", "Llama 3 (Meta 2024): 128K-context training on 16,384 H100s, "
        "tp8 cp16 pp16 dp8, 16M tokens per step", "llama", LLAMA_405B, 131072, 128, "h100",
        16384, 8, 16, 16, 380.0),
    Run("megatron-1t", "Narayanan et al. 2021 (Megatron-LM on A100s): 1T-parameter GPT on "
        "3,072 GPUs at 502 PFLOP/s, 52% of peak; tp8 pp64, batch 3072, sequence 2048",
        "gpt", dict(vocab_size=51200, n_layer=128, n_head=160, n_embd=25600), 2048, 3072,
        "a100", 3072, 8, 1, 64, 163.0, calibrates=True),
]
VARIANTS = [(vpp, rc) for vpp in (1, 2, 4) for rc in ("none", "selective", "full")]


def _model(run: Run):
    with torch.device("meta"):
        if run.model == "llama":
            from models.llama import Llama, LlamaConfig

            net = Llama(LlamaConfig(seq_len=run.seq, **run.shape))
        else:
            from models.gpt import GPT, GPTConfig

            net = GPT(GPTConfig(seq_len=run.seq, **run.shape))
    ids = torch.zeros(1, run.seq, dtype=torch.long, device="meta")
    return net, (ids, ids)


def predict(run: Run) -> dict:
    start = time.perf_counter()
    nodes = run.gpus // 8
    found = cluster(f"{run.gpu}:nodes={nodes}")
    net, example = _model(run)
    s = Searcher(net, example, cluster=found, global_batch_size=run.global_batch,
                 precision="bf16")
    dp = run.gpus // (run.tp * run.cp * run.pp)
    peak_flops = found.device.peak("bf16")
    rows = []
    for vpp, rc in VARIANTS:
        layout = Layout(tp=run.tp, sp=run.tp > 1, cp=run.cp, pp=run.pp, vpp=vpp,
                        schedule="interleaved" if vpp > 1 else "1f1b", dp=dp, zero=1,
                        recompute=rc, micro_batch_size=1)
        try:
            e = s.estimate(layout)
        except FxmegError as exc:  # a variant fxmeg refuses (vpp not dividing the layers...)
            rows.append({"layout": str(layout), "refused": str(exc).split("\n")[0][:160]})
            continue
        verdict = memory_verdict(e.peak, found.device.memory, found.device.memory_error)
        rows.append({"layout": str(layout), "fits": verdict == "fits", "memory": verdict,
                     "peak_gib": round(e.peak / 2**30, 1), "step_s": round(e.step, 3),
                     "tflops_per_gpu": round(e.mfu * peak_flops / 1e12, 1),
                     "breakdown_s": {k: round(v, 3) for k, v in e.breakdown.items() if v}})
    fitting = [r for r in rows if r.get("fits")]
    best = max(fitting, key=lambda r: r["tflops_per_gpu"]) if fitting else None
    return {"name": run.name, "source": run.source, "gpus": run.gpus, "gpu": run.gpu,
            "published_tflops_per_gpu": run.tflops, "fits": best is not None,
            "best_fitting": best, "variants": rows,
            "seconds": round(time.perf_counter() - start, 1)}


def planner_choice(run: Run) -> dict:
    """The search's fastest fitting layout on the run's cluster, in a neighbourhood of the
    published one (tp 4 or 8, its cp or 1, its pp halved, kept or doubled, vpp 1/2/4,
    ZeRO-1, any recompute, micro-batch 1): the whole space of 16,384 ranks is ~10^5 layouts."""
    from fxmeg.planner.search import search

    found = cluster(f"{run.gpu}:nodes={run.gpus // 8}")
    net, example = _model(run)
    near = {"tp": {4, 8}, "cp": {1, run.cp}, "pp": {run.pp // 2, run.pp, run.pp * 2}}
    result = search(net, example, cluster=found, global_batch_size=run.global_batch,
                    precision="bf16", space=lambda c: (
                        c.tp in near["tp"] and c.cp in near["cp"] and c.pp in near["pp"]
                        and c.zero == 1 and c.micro_batch_size == 1))
    best = result.best
    if best is None:
        return {"legal": result.legal}
    e = best.estimate
    return {"layout": str(best.layout), "peak_gib": round(e.peak / 2**30, 1),
            "tflops_per_gpu": round(e.mfu * found.device.peak("bf16") / 1e12, 1),
            "legal": result.legal, "fit": len(result.ranked),
            "seconds": round(result.seconds, 1)}


def calibrate(results: list[dict]) -> None:
    """One efficiency per GPU type: the scale that matches its calibrating run, applied to
    every run on that GPU type (``calibrated_tflops_per_gpu``, ``error``)."""
    scale = {}
    for run, r in zip(RUNS, results):
        if run.calibrates and r["best_fitting"]:
            scale[run.gpu] = run.tflops / r["best_fitting"]["tflops_per_gpu"]
    for run, r in zip(RUNS, results):
        if r["best_fitting"] and run.gpu in scale:
            tf = r["best_fitting"]["tflops_per_gpu"] * scale[run.gpu]
            r["efficiency_scale"] = round(scale[run.gpu], 3)
            r["calibrated_tflops_per_gpu"] = round(tf, 1)
            r["error"] = round(tf / run.tflops - 1, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="one run by name")
    p.add_argument("--search", action="store_true",
                   help="also the planner's own choice near each published layout (minutes)")
    args = p.parse_args()
    runs = [r for r in RUNS if args.only in (None, r.name)]
    results = []
    for run in runs:
        print(f"{run.name}: predicting ...", file=sys.stderr, flush=True)
        results.append(predict(run))
        if args.search:
            results[-1]["planner_choice"] = planner_choice(run)
    if args.only is None:
        calibrate(results)
        for run, r in zip(runs, results):
            choice = r.get("planner_choice", {})
            if "tflops_per_gpu" in choice and "efficiency_scale" in r:
                choice["calibrated_tflops_per_gpu"] = round(
                    choice["tflops_per_gpu"] * r["efficiency_scale"], 1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
