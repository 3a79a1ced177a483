"""A GPT-2 style language model in plain PyTorch (never imports fxmeg).

Learned positions, pre-LayerNorm blocks, GELU MLP, a fused QKV projection and an
embedding tied to the LM head. ``forward(input_ids, labels)`` returns the mean
cross-entropy over tokens whose label is not -100.

The QKV projection has no bias by default: the key bias's gradient is identically zero
(softmax is shift-invariant per query), so Adam turns its rounding noise into full-size
updates and two correct implementations drift apart on it. ``qkv_bias=True`` restores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32
    qkv_bias: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)  # 3 x (b, s, h)
        # (b, heads, s, head_dim)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors ``module`` itself registers, as ``__init__`` does: one
        module at a time, e.g. for a model built on the meta device. Norms keep
        PyTorch's default (ones, zeros)."""
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
            return
        self._init_weights(module)
        if any(module is b.attn.proj or module is b.mlp.proj for b in self.layers):
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)  # (b, s, h)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))  # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
