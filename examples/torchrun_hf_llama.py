"""An unmodified Hugging Face Llama (built from a config: no download) trained with
tp=2 x pp=2 x dp=2:

    pip install 'fxmeg[hf]'
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 \\
        examples/torchrun_hf_llama.py [--steps 30]

(dp is the world size over tp x pp: on 4 ranks it trains with dp=1.) fxmeg passes labels
and use_cache=False and takes .loss itself; Hugging Face causal LMs shift the labels, so
labels are the input ids.
"""

import argparse

import torch
import torch.distributed as dist
import transformers

import fxmeg

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30, help="training steps")
steps = parser.parse_args().steps
dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial model on every rank
config = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
model = transformers.AutoModelForCausalLM.from_config(config)


def batch(step: int, rows: int = 32, seq: int = 32):
    g = torch.Generator().manual_seed(step)
    start, stride = (
        torch.randint(0, 256, (rows, 1), generator=g),
        torch.randint(1, 4, (rows, 1), generator=g),
    )
    ids = (start + stride * torch.arange(seq)) % 256  # count up with a stride: learnable
    return ids, ids


ids, labels = batch(0)
engine = fxmeg.parallelize(model, (ids[:4], labels[:4]), tp=2, pp=2, global_batch_size=32,
                           optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3))
for step in range(1, steps + 1):
    result = engine.train_step(batch(step))
    if dist.get_rank() == 0 and (step % 5 == 0 or step == steps):
        print(f"step {step} loss {result.loss:.4f}", flush=True)
dist.destroy_process_group()
