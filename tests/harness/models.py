"""Tiny models the tests train: fxmeg's own GPT and Llama (``make_model``), Hugging Face
decoders built from a config (``hf_model``), and small mixtures of experts (``tiny_moe``)."""

from __future__ import annotations

import torch

from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig

MOE: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        # a shared expert and its one-feature gate
        shared_expert_intermediate_size=48,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    # block_sparse_moe.router / .experts
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48
    ),  # a dense shared MLP beside the experts
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),  # attention sinks, biased experts
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),  # latent attention (MLA); layer 0 dense
    # sigmoid router initialised to zero: at step 1 every token picks the same two experts
    # (ties), so at ep=2 one rank's experts get no rows; a shared expert; layer 0 dense
    "afmoe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1
    ),
    # issue 68: latent attention whose keys are expanded per query head (so as many
    # key/value heads as heads: with 2 it fails in plain PyTorch once a mask is built),
    # a shared expert, layer 0 dense
    "glm4_moe_lite": dict(
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
    # issue 68: Gated DeltaNet layers (a depthwise conv1d weight of 3 dims: not an expert
    # bank) then attention, every layer's MLP routed with a gated shared expert
    "qwen3_5_moe_text": dict(
        full_attention_interval=2,  # linear, full, linear, full, ... at any depth
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=48,
    ),
}
"""Hugging Face mixtures of experts (config fields of AutoConfig.for_model): 4 experts, top-2."""

BATCHED_MOE: dict[str, dict] = {
    "llama4_text": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        interleave_moe_layer_step=2,
        intermediate_size_mlp=48,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
        floor_scale=4,
    ),
}
"""Mixtures of experts whose experts run over every token, the routing zeroing the rows
it skips (Llama 4's Llama4TextExperts; fxmeg/passes/ep_batched.py), 4 experts, top-2.
Llama 4's layers alternate: even layers dense (intermediate_size_mlp) with complex rotary,
q/k L2 norm and chunked attention (chunks of 8), odd ones routed experts plus a shared
expert, no rotary, full attention and the attention temperature (floor_scale=4: it
varies within 16 positions)."""
MODELS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}

def make_model(name: str, seed: int = 0, **cfg) -> torch.nn.Module:
    if name.startswith("hf-"):
        return hf_model(name[3:], seed=seed, **cfg)
    # a Hugging Face mixture of experts (MOE), as transformers builds it
    if name.startswith("moe-"):
        return tiny_moe(name[4:], vocab_size=128, **cfg)
    cls, config = MODELS[name]
    torch.manual_seed(seed)
    return cls(config(**cfg))

def hf_model(
    kind: str,
    *,
    seed: int = 0,
    n_layer: int = 2,
    vocab_size: int = 128,
    attn_implementation: str | None = None,
    pad_token_id: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
) -> torch.nn.Module:
    """A tiny Hugging Face causal LM built from a config (random init, no download, no
    dropout: parity needs the same arithmetic on both sides). With ``pad_token_id`` the
    embedding has that padding_idx: its row gets no gradient. ``heads`` and ``kv_heads``:
    the query and key/value heads of the models with ``common``'s."""
    import transformers as T

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        pad_token_id=pad_token_id,
    )
    configs = {
        "llama": lambda: T.LlamaConfig(**common),
        "qwen2": lambda: T.Qwen2Config(**common),
        "mistral": lambda: T.MistralConfig(**common),
        "gpt2": lambda: T.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=n_layer,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "phi3": lambda: T.Phi3Config(**common),  # fused qkv_proj and gate_up_proj
        "olmo2": lambda: T.Olmo2Config(**common),  # q_norm / k_norm over the whole projection
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=8),  # q_norm / k_norm per head
        # eager attention with logit softcapping, softcapped tied head
        "gemma2": lambda: T.Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8),
        # ALiBi through baddbmm, heads merged into the batch; eager attention only
        "bloom": lambda: T.BloomConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            n_layer=n_layer,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=pad_token_id,
        ),
        "mixtral": lambda: T.MixtralConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    }
    torch.manual_seed(seed)
    extra = {"experts_implementation": "batched_mm"} if kind == "mixtral" else {}
    if attn_implementation:
        extra["attn_implementation"] = attn_implementation
    return T.AutoModelForCausalLM.from_config(configs[kind](), **extra)

def tiny_moe(kind: str, *, n_layer: int = 2, vocab_size: int = 96, **extra) -> torch.nn.Module:
    """A tiny Hugging Face mixture of experts of ``MOE`` or ``BATCHED_MOE`` (random init, no
    download, no dropout), its experts implementation as transformers picks it unless
    ``extra`` names one (``experts_implementation="eager"``); GPT-OSS has eager attention only."""
    import transformers as T

    base = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    cfg = T.AutoConfig.for_model(kind, **(base | (MOE | BATCHED_MOE)[kind]))
    torch.manual_seed(0)
    attn = "eager" if kind == "gpt_oss" else "sdpa"
    return T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, **extra)


def saved_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Mixtral's state_dict in the names transformers' save_pretrained writes (each
    expert's w1, w2 and w3 apart: gate_up_proj[e] is w1 over w3, down_proj[e] is w2),
    written out here, not by transformers (the names are checked against its files in
    tests/parity/test_expert_parallel.py)."""
    saved = {}
    for name, t in model.state_dict().items():
        layer, _, bank = name.partition(".experts.")
        if not bank:
            saved[name] = t
        for e, expert in enumerate(t if bank else []):
            if bank == "gate_up_proj":
                w1, w3 = expert.chunk(2)
                saved[f"{layer}.experts.{e}.w1.weight"] = w1
                saved[f"{layer}.experts.{e}.w3.weight"] = w3
            else:
                saved[f"{layer}.experts.{e}.w2.weight"] = expert
    return saved
