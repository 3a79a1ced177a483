"""`fxmeg.plan` at scale: a Llama-3-70B-shaped model (80 layers, hidden 8192, 64 heads /
8 KV heads, FFN 28672, vocabulary 128256) at tp=8 x pp=8 x vpp=2, seq 4096, micro-batch
1, global batch 64, bf16, built on the meta device twice: fxmeg's own models/llama.py and
transformers' LlamaForCausalLM (AutoModelForCausalLM.from_config). Each runs in a fresh
process so its peak RSS is its own. One JSON line: seconds (model build, capture, each
pass, the plan), peak RSS in MiB, and the first stage's numbers.

    python bench/plan.py                 # both models
    python bench/plan.py --layers 16     # a shallower model of the same width
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fxmeg.diagnostics.devices import peak_resident  # noqa: E402

SHAPE = {"vocab": 128256, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672}
LAYOUT = {"tp": 8, "pp": 8, "vpp": 2, "global_batch_size": 64, "precision": "bf16"}


def build(kind: str, layers: int, seq: int) -> torch.nn.Module:
    s = SHAPE
    with torch.device("meta"):
        if kind == "fxmeg":
            from models.llama import Llama, LlamaConfig

            return Llama(
                LlamaConfig(
                    vocab_size=s["vocab"],
                    n_layer=layers,
                    n_embd=s["hidden"],
                    n_head=s["heads"],
                    n_kv_head=s["kv_heads"],
                    ffn_hidden=s["ffn"],
                    seq_len=seq,
                )
            )
        import transformers as T

        cfg = T.LlamaConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            intermediate_size=s["ffn"],
            num_hidden_layers=layers,
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            max_position_embeddings=seq,
        )
        return T.AutoModelForCausalLM.from_config(cfg)


def one(kind: str, layers: int, seq: int) -> dict:
    """Plan one model in this process."""
    import fxmeg

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("fxmeg.frontend.pass_driver")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    start = time.perf_counter()
    model = build(kind, layers, seq)
    built = time.perf_counter()
    ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
    plan = fxmeg.plan(model, (ids, ids.clone()), **LAYOUT)
    end = time.perf_counter()
    passes = {r.step: round(r.seconds, 3) for r in records}
    first = plan.stages[0]
    return {
        "model": kind,
        "seconds": round(end - start, 2),
        "build_s": round(built - start, 2),
        "passes_s": passes,
        "plan_s": round(end - built - sum(passes.values()), 2),
        "max_rss_mib": round(peak_resident() / 2**20),
        "total_parameters": plan.total_parameters,
        "stage0": {
            k: getattr(first, k)
            for k in (
                "parameter_elements",
                "weights_and_optimizer",
                "activations",
                "microbatches_in_flight",
                "total",
                "bubble",
            )
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--one", choices=("fxmeg", "hf"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.layers, args.seq)))
        return
    runs = []
    for kind in ("fxmeg", "hf"):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--layers", str(args.layers),
                              "--seq", str(args.seq)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"bench": "plan", "shape": SHAPE | {"layers": args.layers, "seq": args.seq},
                      "layout": LAYOUT, "runs": runs}))


if __name__ == "__main__":
    main()
