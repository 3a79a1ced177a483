"""fxmeg.plan and `fxmeg plan`: per-stage memory, FLOPs and bubble without a process group
or a real tensor, checked against Megatron-LM's weight-and-optimizer formula, the
Program's own records, the closed-form pipeline bubble, and the real (non-meta) program."""

import copy
import json
import re

import pytest
import torch
import torch.distributed as dist

import fxmeg
from fxmeg.diagnostics.layout_plan import plan_of
from fxmeg.errors import ConfigError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.layouts import Shard
from models.llama import Llama, LlamaConfig
from tests.harness.helpers import make_batch
from tests.harness.models import MOE, make_model, tiny_moe


def _batch(rows: int = 2, seq: int = 16, vocab: int = 128):
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


def megatron_weight_and_optimizer_bytes(
    *,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    layers: int,
    vocab: int,
    tp: int,
    pp: int,
    dp: int,
    distributed_optimizer: bool,
) -> float:
    """Megatron-LM's ``compute_weight_and_optimizer_memory``
    (megatron/training/theoretical_memory_usage.py, read at NVIDIA/Megatron-LM 00caa53a)
    for a dense GQA model with RMSNorm, SwiGLU and an untied output layer (no MoE, MTP
    or MLA), in our words: the most loaded pipeline stage holds 1/pp of the transformer
    block (the final norm included) and the input embedding, all divided by tp, at 18
    bytes per parameter (bf16 weight 2, fp32 gradient 4, fp32 master 4 + Adam's two
    fp32 moments 8), or 6 + 12/dp with the distributed optimizer."""
    kv_channels = hidden // heads
    query_projection = kv_channels * heads
    # q, o and k, v
    attention = 2 * hidden * hidden * (1 + kv_heads / heads) * (query_projection / hidden)
    layer = 2 * hidden * (ffn * 3 / 2 + 1) + attention  # SwiGLU (gate, up, down) + two RMSNorms
    block = layer * layers + hidden  # + the final RMSNorm
    embedding = hidden * vocab
    params = (block / pp + embedding) / tp
    if pp == 1:  # the untied output layer shares the only stage
        params += embedding / tp
    return params * (6 + 12 / dp if distributed_optimizer else 18)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_first_stage_agrees_with_megatrons_weight_and_optimizer_formula(distributed_optimizer):
    """What the plan counts that the formula does not: each tp rank keeps the norms whole
    (the formula divides them by tp too); the final norm sits on the last stage (the
    formula spreads it over every stage's 1/pp); with the distributed optimizer the
    gradient buffer is padded (64-element parameter starts, buckets to lcm(dp, 128)).
    fxmeg's gradient buffers are fp32 in bf16 (passes/buckets.py GRAD_DTYPE), as the
    formula assumes, so the byte counts compare like with like."""
    shape = dict(hidden=512, ffn=1408, heads=8, kv_heads=2, layers=8, vocab=32768)
    tp, pp, dp = 2, 2, 2
    with torch.device("meta"):
        model = Llama(
            LlamaConfig(
                vocab_size=shape["vocab"],
                n_layer=shape["layers"],
                n_embd=shape["hidden"],
                n_head=shape["heads"],
                n_kv_head=shape["kv_heads"],
                ffn_hidden=shape["ffn"],
                seq_len=256,
            )
        )
    ids = torch.zeros((1, 256), dtype=torch.long, device="meta")
    plan = fxmeg.plan(
        model,
        (ids, ids.clone()),
        tp=tp,
        pp=pp,
        dp=dp,
        global_batch_size=8,
        precision="bf16",
        # formula: L/pp each
        distributed_optimizer=distributed_optimizer,
        split_points=("layers.4",),
    )
    first = plan.stages[0]
    want = megatron_weight_and_optimizer_bytes(**shape, tp=tp, pp=pp, dp=dp,
                                               distributed_optimizer=distributed_optimizer)
    # the differences named above come to ~0.01% here: 1% still leaves room for other shapes
    assert abs(first.weights_and_optimizer - want) <= 0.01 * want, (
        first.weights_and_optimizer,
        want,
    )
    # the parts as the formula prices them: 2 + 4 + 12 (or 12 / dp) bytes per local element
    n = first.parameter_elements
    assert first.parameters == 2 * n
    assert first.gradient_buffers >= 4 * n
    assert first.optimizer_state == 12 * n // (dp if distributed_optimizer else 1)
    assert not dist.is_initialized()


def test_parameters_are_each_counted_once_per_stage_in_their_local_shape():
    """GPT's embedding is tied (read on the first and the last stage); pp=2 x vpp=2 puts two
    chunks on each stage. Expected counts come from the Program's holders, tp specs and
    full shapes, not from the get_attr nodes the plan reads."""
    tp = 2
    program = transform(make_model("gpt", n_layer=4, n_embd=64, vocab_size=256), _batch(vocab=256),
                        tp=tp, pp=2, vpp=2, global_batch_size=4)
    plan = plan_of(program)
    for s in plan.stages:
        want = 0
        for name, holders in program.holders.items():
            if s.stage in holders:
                full = program.full_shapes[name][0].numel()
                want += full // tp if isinstance(program.tp_specs[name], Shard) else full
        assert s.parameter_elements == want
        assert s.parameters == 4 * want  # fp32
        assert s.gradient_buffers == 4 * want  # fp32, dp=1: no padding
        assert s.optimizer_state == 8 * want  # Adam's two states; fp32 has no master copy
        # each held micro-batch counts its own chunk's (simulator.peak_held_by)
        assert s.activations <= s.activations_per_microbatch * s.microbatches_in_flight
        assert s.total == s.parameters + s.gradient_buffers + s.optimizer_state + s.activations
    assert plan.stages[0].units.startswith("layers.0") and "," in plan.stages[0].units  # two chunks
    # the chunks of a stage keep different amounts (the head's, the embedding's): the most
    # held is less than the largest chunk's times the most micro-batches held
    assert any(s.activations < s.activations_per_microbatch * s.microbatches_in_flight
               for s in plan.stages)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_stage_flops_add_up_to_the_whole_model_over_tensor_parallel_ranks(recompute):
    """Every Llama matmul is split over tp, so the stages' local forward FLOPs times tp are
    the whole model's (counted by the analyse pass before any rewrite); under full
    recompute the blocks sit in checkpointed sub-graphs and must still be counted."""
    tp = 2
    program = transform(make_model("llama", n_layer=4), _batch(), tp=tp, pp=2, global_batch_size=4,
                        recompute=recompute)
    plan = plan_of(program)
    assert all(s.flops_per_microbatch > 0 for s in plan.stages)
    assert sum(s.flops_per_microbatch for s in plan.stages) * tp == plan.flops_per_microbatch


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 1, 2), (2, 2, 4)])
def test_in_flight_and_bubble_follow_the_schedule(pp, vpp, m):
    program = transform(
        make_model("llama", n_layer=4), _batch(), pp=pp, vpp=vpp, global_batch_size=2 * m
    )
    stages = plan_of(program).stages
    # uniform chunk costs: Megatron's (p - 1) / (v m + p - 1)
    bubble = (pp - 1) / (vpp * m + pp - 1)
    assert all(s.bubble == pytest.approx(bubble) for s in stages)
    if vpp == 1:  # 1F1B: stage s warms up with pp - s forwards (at most m)
        assert [s.microbatches_in_flight for s in stages] == [min(pp - s, m) for s in range(pp)]
    else:  # interleaved keeps more (chunk, micro-batch) pairs on the first stage
        assert stages[0].microbatches_in_flight > stages[-1].microbatches_in_flight >= vpp


def test_meta_plan_equals_the_plan_of_the_real_program_and_leaves_the_model_alone():
    model = make_model("llama", n_layer=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = dict(
        tp=2, pp=2, dp=2, global_batch_size=8, precision="bf16", distributed_optimizer=True
    )
    planned = fxmeg.plan(model, _batch(), **options)
    real = plan_of(transform(copy.deepcopy(model), _batch(), **options))
    assert planned == real
    assert not dist.is_initialized()
    state = model.state_dict()  # not cast to bf16, not moved to meta
    assert all(
        state[k].dtype == torch.float32 and torch.equal(state[k], v) for k, v in before.items()
    )


def test_table_and_json():
    plan = fxmeg.plan(make_model("llama", n_layer=4), _batch(), pp=2, global_batch_size=4)
    # 3 header lines, column names, a row each
    table = str(plan).splitlines()[: 4 + len(plan.stages)]
    assert "pp=2" in table[0]
    # a dense model at ep=1: no expert column
    assert "experts" not in table[3] and " ep=" not in table[0]
    assert [line.split()[0] for line in table[-2:]] == ["0", "1"]
    assert "activations per micro-batch, one layer of stage 0" in str(plan)  # then the breakdown
    data = json.loads(plan.to_json())
    assert data["layout"]["pp"] == 2 and data["layout"]["ep"] == 1 and data["num_microbatches"] == 2
    assert all(s["expert_parameter_elements"] == 0 for s in data["stages"])
    assert [s["total"] for s in data["stages"]] == [s.total for s in plan.stages]


def test_options_or_config_not_both():
    model, batch = make_model("llama", n_layer=2), _batch()
    with pytest.raises(ConfigError, match="either config= or options"):
        fxmeg.plan(
            model, batch, config=fxmeg.EngineConfig(micro_batch_size=2, global_batch_size=2), pp=2
        )






def test_context_parallel_ranks_plan_their_share_of_the_sequence():
    """Each cp rank computes and saves activations for 1/cp of every sequence (the
    trainer's first log is this plan)."""
    stages = {
        cp: fxmeg.plan(make_model("gpt", n_layer=2), make_batch(2, seed=0), cp=cp).stages[0]
        for cp in (1, 2, 4)
    }
    for cp in (2, 4):
        assert (
            stages[cp].activations_per_microbatch
            <= 1.05 * stages[1].activations_per_microbatch / cp
        )
        assert stages[cp].flops_per_microbatch == pytest.approx(stages[1].flops_per_microbatch / cp)
        assert stages[cp].parameters == stages[1].parameters


def moe_example(rows: int = 2, seq: int = 16):
    from fxmeg.interop.hugging_face import keyword_batch

    ids = torch.zeros((rows, seq), dtype=torch.long)
    return keyword_batch(ids, ids.clone())


def _expert_and_dense_elements(model) -> tuple[int, int]:
    """By hand, from the model's own parameters: the routed experts' banks (the
    ``mlp.experts`` module of each MoE layer, Granite's ``block_sparse_moe.experts``:
    weights, and GPT-OSS's bias banks) and the rest (attention, router, shared experts,
    dense layers, embeddings, norms); trainable ones only, as the plan counts them (AFMoE's
    expert_bias is a frozen parameter)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    experts = sum(
        p.numel() for n, p in trainable if re.search(r"\.(mlp|block_sparse_moe)\.experts\.", n)
    )
    return experts, sum(p.numel() for _, p in trainable) - experts


@pytest.mark.parametrize("kind", list(MOE))
def test_expert_parallel_halves_each_ranks_expert_elements_and_keeps_the_dense_ones(kind):
    """ep=2 over dp=2: each rank holds 2 of the 4 experts of every layer (half the banks'
    elements, gradients and optimizer state); attention, router, shared experts and
    embeddings stay whole. At ep=1 (no expert-parallel pass) the plan finds the same banks."""
    model = tiny_moe(kind)
    experts, dense = _expert_and_dense_elements(model)
    assert experts and dense
    plans = {
        ep: fxmeg.plan(model, moe_example(), ep=ep, dp=2, global_batch_size=4) for ep in (1, 2)
    }
    for ep, plan in plans.items():
        (s,) = plan.stages
        assert plan.total_parameters == experts + dense  # the whole model, whatever ep
        assert s.expert_parameter_elements == experts // ep
        assert s.parameter_elements - s.expert_parameter_elements == dense
        assert s.parameters == 4 * s.parameter_elements  # fp32
        assert s.optimizer_state == 8 * s.parameter_elements  # Adam's two states, not sharded
        assert s.expert_optimizer_state == 8 * experts // ep
        # gradients: buckets padded to dp=2 for the dense ones; the experts' own buffer at
        # ep=2 is reduced over edp = dp / ep = 1 rank: no padding
        assert 4 * s.parameter_elements <= s.gradient_buffers <= 4 * (s.parameter_elements + 1)
        assert s.expert_gradient_buffers == 4 * experts // ep
    assert plans[1].config.parallel.edp == 2 and plans[2].config.parallel.edp == 1


def test_zero_shards_the_experts_buffer_over_the_expert_data_parallel_ranks():
    """dp=4, ep=2 at zero=2 and 3: the dense gradient buffer is sharded over dp = 4 ranks,
    the experts' own over the edp = 2 ranks holding the same experts (it was counted over 4:
    half the experts' gradients, and at zero=3 their weights, missing from the peak)."""
    model = tiny_moe("mixtral")
    options = dict(ep=2, dp=4, global_batch_size=8, distributed_optimizer=True)
    (whole,) = fxmeg.plan(model, moe_example(), **options).stages
    dense = whole.gradient_buffers - whole.expert_gradient_buffers
    shards = dense // 4 + whole.expert_gradient_buffers // 2  # fp32 bytes
    for zero in (2, 3):
        (s,) = fxmeg.plan(model, moe_example(), zero=zero, **options).stages
        assert s.gradient_buffers == shards, zero
    assert s.parameters == shards  # zero=3: fp32 weights, sharded as their gradients


def test_distributed_optimizer_shards_expert_state_over_the_expert_data_parallel_ranks():
    """dp=4, ep=2: the dense state is sharded over 4 ranks, the experts' (each rank holds
    E/2 of them) over the edp = 2 ranks that hold the same experts. bf16: 3 fp32 states
    per element (master and Adam's two moments), 2-byte weights."""
    model = tiny_moe("mixtral")
    experts, dense = _expert_and_dense_elements(model)
    plan = fxmeg.plan(model, moe_example(), ep=2, dp=4, global_batch_size=8, precision="bf16",
                      distributed_optimizer=True)
    (s,) = plan.stages
    local = experts // 2
    assert s.expert_parameter_elements == local and s.parameter_elements == dense + local
    assert s.parameters == 2 * (dense + local)
    assert s.expert_optimizer_state == 3 * 4 * local // 2
    assert s.optimizer_state - s.expert_optimizer_state == 3 * 4 * dense // 4
    # the experts' buffer: padded so that its buckets cut into edp = 2 equal shards (Megatron's
    # lcm(edp, 128) bucket ends, 64-element parameter starts; 2 banks a layer)
    assert (s.expert_gradient_buffers // 4) % 128 == 0
    assert 4 * local <= s.expert_gradient_buffers < 4 * (local + 4 * 64 + 128)
    assert s.gradient_buffers - s.expert_gradient_buffers >= 4 * dense
    assert s.total == s.parameters + s.gradient_buffers + s.optimizer_state + s.activations
    # at ep=1 every rank holds all experts and shards their state over dp=4: per rank, the
    # same expert state as E/2 experts over 2 ranks; ep saves the weights and gradients
    whole = fxmeg.plan(model, moe_example(), dp=4, global_batch_size=8, precision="bf16",
                       distributed_optimizer=True).stages[0]
    assert whole.expert_optimizer_state == 3 * 4 * experts // 4 == s.expert_optimizer_state
    assert whole.expert_parameter_elements == 2 * s.expert_parameter_elements
    assert whole.expert_gradient_buffers >= 2 * 4 * local > s.expert_gradient_buffers




# ---------------------------------------------------------------- the verdict, the activation
# account










@pytest.mark.parametrize(
    "kind,options",
    [
        ("gpt", {}),
        ("llama", {}),
        ("hf-llama", {}),
        ("gpt", {"recompute": "full"}),
        ("hf-llama", {"recompute": "selective"}),
    ],
)
def test_activation_bytes_are_what_autograd_saves(kind, options):
    """The plan's per-micro-batch activations against what autograd really packs in a
    training step (``SavedBytes``, one process, one micro-batch). The Hugging Face model
    differs by its attention mask: the CPU kernel keeps a float copy of it per layer."""
    from fxmeg.diagnostics.layout_plan import activation_bytes
    from fxmeg.diagnostics.measured_activations import SavedBytes
    from fxmeg.interop.hugging_face import keyword_batch

    batch = make_batch(4, seed=1)
    batch = keyword_batch(*batch) if kind.startswith("hf-") else batch
    engine = fxmeg.parallelize(make_model(kind, n_layer=2), batch, global_batch_size=4, **options)
    meter = SavedBytes(engine.named_parameters.values())
    with meter.hooks():
        engine.train_step(batch)
    predicted = activation_bytes(engine.context.chunks[0])
    assert (
        abs(predicted - meter.peak) <= (0.05 if kind.startswith("hf-") else 0.005) * meter.peak
    ), (predicted, meter.peak)


def test_a_llama_layer_keeps_megatrons_formula_plus_the_named_differences():
    """Korthikanti et al. 2022 count, per layer and bf16, s*b*h*34/t bytes with tp + sp and
    flash attention for GPT; for Llama (SwiGLU of width F, GQA with g = kv_heads / heads,
    RMSNorm, no dropout) the same terms give (12 + 4g + 6F/h) s*b*h/t: norm inputs 2 + 2,
    QKV input 2, Q 2, K and V 4g, attention output 2 (the output projection's input),
    MLP input 2, gate and up 4F/h, down's input 2F/h. An eager Hugging Face layer under
    fxmeg's tp + sp keeps, besides: the all-gathered inputs of the QKV and gate / up
    projections whole (2 x 2sbh (1 - 1/t): Megatron keeps the shard and gathers again in
    backward); each RMSNorm's fp32 input and its normalised bf16 copy (4sbh/t more per norm,
    and the fp32 rsqrt, 4sb/t); SwiGLU's silu output (2F sbh/(h t)); the per-row
    log-sum-exp (4 s b a/t); the chunk's boolean attention mask (b s^2) and the rotary cos and
    sin (2 x 2 s d), each shared by the chunk's layers."""
    import transformers as T

    s, b, h, F, heads, kv, t, layers = 64, 1, 64, 224, 8, 2, 2, 2
    config = T.LlamaConfig(
        vocab_size=256,
        hidden_size=h,
        intermediate_size=F,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=s,
    )
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    from fxmeg.interop.hugging_face import keyword_batch

    ids = torch.zeros((b, s), dtype=torch.long)
    stage = fxmeg.plan(
        model,
        keyword_batch(ids, ids.clone()),
        tp=t,
        sequence_parallel=True,
        precision="bf16",
        global_batch_size=1,
    ).stages[0]
    per_layer = (
        sum(v for k, v in stage.activation_breakdown.items() if k.startswith("layer: "))
        / stage.layers
    )
    sbh, g = s * b * h, kv / heads
    megatron = (12 + 4 * g + 6 * F / h) * sbh / t
    named = (2 * 2 * sbh * (1 - 1 / t) + 2 * (4 * sbh / t + 4 * s * b / t) + 2 * F / h * sbh / t
             + 4 * s * b * heads / t + (b * s * s + 2 * 2 * s * h // heads) / layers)
    assert per_layer == pytest.approx(megatron + named, rel=0.01), (per_layer, megatron, named)


def test_zero_bubble_schedules_are_planned_and_save_what_one_f_one_b_saves():
    """``fxmeg.plan`` transforms a meta twin; its zero-bubble split is traced on CPU fakes
    (split_backward.RUN_DEVICE). Forward saves the same tensors whichever backward runs
    them: under zbh1 each stage's activations per micro-batch are the 1F1B plan's, within
    the few tensors the split keeps for W (5%), and the forward FLOPs are the same. zbv and
    dualpipev (V placement) are planned."""
    model = make_model("gpt", n_layer=4)
    zb = fxmeg.plan(model, _batch(1), pp=2, schedule="zbh1", global_batch_size=8)
    one = fxmeg.plan(model, _batch(1), pp=2, schedule="1f1b", global_batch_size=8)
    for a, b in zip(zb.stages, one.stages, strict=True):
        assert a.activations_per_microbatch == pytest.approx(b.activations_per_microbatch,
                                                             rel=0.05)
        assert a.flops_per_microbatch == b.flops_per_microbatch  # the split's graphs aside
    for schedule in ("zbv", "dualpipev"):
        v = fxmeg.plan(model, _batch(1), pp=2, vpp=2, schedule=schedule, global_batch_size=8)
        assert all(s.activations > 0 and len(s.chunks) == 2 for s in v.stages)
