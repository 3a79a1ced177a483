"""Megatron's training loop around your own model, under torchrun:

    fxmeg prepare-data --input pydoc:topics --output runs/topics
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/torchrun_trainer.py \
        [--steps 40] [--data runs/topics] [--run-dir runs/llama]

Any nn.Module whose forward(input_ids, labels) returns the mean loss works unchanged.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fxmeg.train.trainer import TrainConfig, Trainer  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40, help="training steps")
parser.add_argument("--data", default="runs/topics", help="corpus prefix from `fxmeg prepare-data`")
parser.add_argument("--run-dir", default="runs/llama", help="where metrics.jsonl goes")
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = Llama(
    LlamaConfig(
        vocab_size=384, seq_len=64, n_layer=4, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=128
    )
)
config = TrainConfig.from_flat(data=args.data, seq_len=64, micro_batch_size=4, global_batch_size=32,
                               train_iters=args.steps, tp=2, pp=2, lr=3e-3, lr_warmup_samples=128,
                               eval_interval=20, eval_iters=4, log_interval=min(5, args.steps),
                               run_dir=args.run_dir)
Trainer(config, model=model).run()
dist.destroy_process_group()
