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
    ep: int = 1
    schedule: str | None = None
    """The published schedule, when the publication names one (else vpp 1/2/4 are tried
    under 1F1B and interleaved)."""
    compute_as: str | None = None
    """The GPU type whose calibration this one shares (the H800 computes as an H100)."""
    options: tuple = ()
    """Further flat names every variant shares, as (name, value) pairs."""


LLAMA_405B = dict(vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8, n_embd=16384,
                  ffn_hidden=53248, rope_theta=500000.0)
GPT3 = dict(vocab_size=51200)  # Narayanan et al. 2021: every model, sequence 2048
MEGATRON = ("Narayanan et al. 2021 (Megatron-LM on A100 80GB), Table {table}: {size} GPT "
            "on {gpus} GPUs, model-parallel size {mp} (tp8 inside a node, pp{pp}), batch "
            "{batch}, {tflops} TFLOP/s per GPU")
# DeepSeek's inference/configs/config_671B.json (deepseek-ai/DeepSeek-V3)
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
                   num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                   n_shared_experts=1, num_experts_per_tok=8, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, max_position_embeddings=4096)


def _megatron(table: int, size: str, layers: int, hidden: int, heads: int, gpus: int,
              pp: int, batch: int, tflops: float, **kw) -> Run:
    source = MEGATRON.format(table=table, size=size, gpus=f"{gpus:,}", mp=8 * pp, pp=pp,
                             batch=batch, tflops=tflops)
    return Run(f"megatron-{size.lower()}", source, "gpt",
               dict(GPT3, n_layer=layers, n_head=heads, n_embd=hidden), 2048, batch, "a100",
               gpus, 8, 1, pp, tflops, **kw)


RUNS = [
    Run("llama3-405b-8k", "Llama 3 (Meta 2024): 8K-context pre-training on 16,384 H100s, "
        "tp8 cp1 pp16 dp128, 16M tokens per step", "llama", LLAMA_405B, 8192, 2048, "h100",
        16384, 8, 1, 16, 400.0, calibrates=True),
    Run("llama3-405b-128k", "Llama 3 (Meta 2024): 128K-context training on 16,384 H100s, "
        "tp8 cp16 pp16 dp8, 16M tokens per step", "llama", LLAMA_405B, 131072, 128, "h100",
        16384, 8, 16, 16, 380.0,
        # Llama 3 gathers K and V (with a fused attention kernel); fxmeg's all_gather mode
        # keeps fp32 probabilities over every key (665 GiB a rank here), its ring computes
        # them in pieces (docs/long-context.md)
        options=(("cp_comm_type", "p2p"),)),
    # Table 1 gives the model-parallel size, not its split, nor the heads (those, 96 / 128 /
    # 128 / 160, from third-party copies of the table; the FLOPs do not depend on them)
    _megatron(1, "1T", 128, 25600, 160, 3072, 64, 3072, 163.0, calibrates=True),
    _megatron(1, "145B", 80, 12288, 96, 1536, 8, 2304, 148.0),
    _megatron(1, "310B", 96, 16384, 128, 1920, 16, 2160, 155.0),
    _megatron(1, "530B", 105, 20480, 128, 2520, 35, 2520, 163.0),
    # Table 2 (against ZeRO-3): 174.6B at model-parallel size 96 on 1,536 GPUs
    _megatron(2, "175B", 96, 12288, 96, 1536, 12, 1536, 141.0),
    Run("deepseek-v3", "DeepSeek-V3 (DeepSeek 2024): 2,048 H800s, pp16 (DualPipe) ep64 "
        "ZeRO-1, no tp; 385 TFLOP/s per GPU causal, 432 counting attention's full square "
        "(\"Insights into DeepSeek-V3\", arXiv 2505.09343, Table 4: BF16 peak, FP8 "
        "training); batch 15360 of 4096 tokens", "deepseek-v3", DEEPSEEK_V3, 4096, 15360,
        "h800", 2048, 1, 1, 16, 432.0, ep=64, schedule="dualpipev", compute_as="h100"),
]
RECOMPUTE = ("none", "selective", "full")
VARIANTS = [(vpp, rc) for vpp in (1, 2, 4) for rc in RECOMPUTE]


def _model(run: Run):
    ids = torch.zeros(1, run.seq, dtype=torch.long, device="meta")
    if run.model == "deepseek-v3":
        import transformers

        from fxmeg.interop.hugging_face import keyword_batch

        with torch.device("meta"):
            net = transformers.AutoModelForCausalLM.from_config(
                transformers.DeepseekV3Config(**run.shape))
        return net, keyword_batch(ids, ids)
    with torch.device("meta"):
        if run.model == "llama":
            from models.llama import Llama, LlamaConfig

            net = Llama(LlamaConfig(seq_len=run.seq, **run.shape))
        else:
            from models.gpt import GPT, GPTConfig

            net = GPT(GPTConfig(seq_len=run.seq, **run.shape))
    return net, (ids, ids)


def predict(run: Run) -> dict:
    start = time.perf_counter()
    nodes = run.gpus // 8
    found = cluster(f"{run.gpu}:nodes={nodes}")
    net, example = _model(run)
    s = Searcher(net, example, cluster=found, global_batch_size=run.global_batch,
                 precision="bf16", options=dict(run.options))
    dp = run.gpus // (run.tp * run.cp * run.pp)
    peak_flops = found.device.peak("bf16")
    rows = []
    variants = VARIANTS if run.schedule is None else [
        (2 if run.schedule in ("zbv", "dualpipev") else 1, rc) for rc in RECOMPUTE]
    for vpp, rc in variants:
        schedule = run.schedule or ("interleaved" if vpp > 1 else "1f1b")
        # DualPipe (DeepSeek-V3) overlaps the expert all-to-alls with the other direction
        layout = Layout(tp=run.tp, sp=run.tp > 1, cp=run.cp, ep=run.ep, pp=run.pp, vpp=vpp,
                        schedule=schedule, dp=dp, zero=1, recompute=rc, micro_batch_size=1,
                        overlap_ep=schedule == "dualpipev" and run.ep > 1)
        try:
            e = s.estimate(layout)
        except FxmegError as exc:  # a variant fxmeg refuses (vpp not dividing the layers...)
            rows.append({"layout": str(layout), "refused": str(exc).split("\n")[0][:160]})
            continue
        verdict = memory_verdict(e.peak, found.device.memory, found.device.memory_error)
        capped = s.capped(layout, found.device.memory) if verdict != "fits" else None
        if capped is not None:  # the search's retry: fewer weight gradients deferred
            rows.append({"layout": str(layout), "fits": False, "memory": verdict,
                         "peak_gib": round(e.peak / 2**30, 1)})
            (layout, e), verdict = capped, "fits"
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
    near = {"tp": {run.tp, max(run.tp // 2, 1)}, "cp": {1, run.cp},
            "pp": {run.pp // 2, run.pp, run.pp * 2}, "ep": {run.ep, run.ep // 2, run.ep * 2}}
    result = search(net, example, cluster=found, global_batch_size=run.global_batch,
                    precision="bf16", options=dict(run.options), space=lambda c: (
                        c.tp in near["tp"] and c.cp in near["cp"] and c.pp in near["pp"]
                        and c.ep in near["ep"] and c.zero == 1 and c.micro_batch_size == 1))
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
        kind = run.compute_as or run.gpu
        if r["best_fitting"] and kind in scale:
            tf = r["best_fitting"]["tflops_per_gpu"] * scale[kind]
            r["efficiency_scale"] = round(scale[kind], 3)
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
