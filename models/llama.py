"""A Llama style language model in plain PyTorch (never imports fxmeg).

RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention with fewer
KV heads than heads, untied LM head. As in Hugging Face's implementation the rotary
table is sliced once before the layers and read by every layer.
``forward(input_ids, labels)`` returns the mean cross-entropy over tokens whose label
is not -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128
    seq_len: int = 16
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 32
    ffn_hidden: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """Computed in fp32 like Hugging Face's LlamaRMSNorm: in fp16, rsqrt's derivative at
    small mean squares (-0.5 * v ** -1.5, ~6e4 here) overflows."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(
    cfg: LlamaConfig, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin tables, (seq_len, head_dim) each."""
    head_dim = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, head_dim, 2, device=device).float() / head_dim
    )
    # (seq, head_dim / 2)
    freqs = torch.outer(torch.arange(cfg.seq_len, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (seq, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, heads, s, head_dim)
        q = self.q_proj(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        assert cfg.n_head % cfg.n_kv_head == 0, "n_head must be a multiple of n_kv_head"
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors ``module`` itself registers, as ``__init__`` does: one
        module at a time, e.g. for a model built on the meta device."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif module is self:
            cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]  # (s, head_dim), read by every layer
        x = self.embed_tokens(input_ids)  # (b, s, h)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
