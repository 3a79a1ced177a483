"""An unmodified model under torchrun with fxmeg, in a few lines:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/torchrun_gpt.py [--steps 30]

trains models/gpt.py with pp=2 x dp=2 on synthetic sequences (each row counts up mod
the vocabulary with its own stride), printing the loss on rank 0 every 5 steps and after
the last.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fxmeg  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def batch(step: int, rows: int = 32, seq: int = 32, vocab: int = 128):
    g = torch.Generator().manual_seed(step)
    start, stride = (
        torch.randint(0, vocab, (rows, 1), generator=g),
        torch.randint(1, 4, (rows, 1), generator=g),
    )
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30, help="training steps")
steps = parser.parse_args().steps
dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial model on every rank
model = GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_embd=64))
ids, labels = batch(0)
engine = fxmeg.parallelize(model, (ids[:4], labels[:4]), pp=2, global_batch_size=32,
                           optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3))
for step in range(1, steps + 1):
    result = engine.train_step(batch(step))
    if dist.get_rank() == 0 and (step % 5 == 0 or step == steps):
        print(f"step {step} loss {result.loss:.4f} grad_norm {result.grad_norm:.3f}", flush=True)
dist.destroy_process_group()
