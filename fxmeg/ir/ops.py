"""Every op and marker that fxmeg's passes write into graphs, by schema. They show by name
in printed graphs. This module is pure: no process group is touched here; the
torch.distributed kernels of the collectives are registered by
``fxmeg.runtime.collectives`` (docs/architecture.md §2).

What each marker and collective does, and how the runtime binds it:
docs/architecture.md §8.1.
"""

from __future__ import annotations

import inspect

import torch
from torch.fx.node import has_side_effect

from fxmeg.ir import moe, moe_split


def recv(tensor: torch.Tensor, *, src_chunk: int, shape, dtype, grad: bool) -> torch.Tensor:
    """A boundary tensor received from ``src_chunk``; ``grad``: its gradient is sent back."""
    return tensor


def send(tensor: torch.Tensor, *, dst_chunk: int, shape, dtype, grad: bool) -> torch.Tensor:
    """A boundary tensor sent to ``dst_chunk``; ``grad``: a gradient for it comes back."""
    return tensor


@has_side_effect
def deallocate(tensor: torch.Tensor) -> None:
    """The executor frees ``tensor``'s storage once its send completed and keeps its
    autograd node; backward runs through it anyway (Megatron: deallocate_output_tensor).
    A no-op when the graph runs in one process."""


@has_side_effect
def wait_param_gather(param: torch.Tensor, *, bucket: tuple) -> None:
    """Wait for the all-gather of ``bucket`` (chunk, index; in the chunk's buffer of expert
    banks: (chunk, index, 'experts'), ``BucketSlot.gather_key``), which holds ``param``,
    before forward first reads any of its parameters (Megatron: overlap_param_gather). A
    no-op until the runtime binds it."""


@has_side_effect
def zero_gather(param: torch.Tensor, *, bucket: tuple, prefetch: tuple | None) -> None:
    """zero=3: ``bucket`` (``wait_param_gather``'s key), which holds ``param``, must be
    whole from here on; start gathering ``prefetch``, the bucket forward reads next. A
    no-op until bound."""


@has_side_effect
def zero_release(param: torch.Tensor, *, bucket: tuple) -> None:
    """zero=3: forward reads no parameter of ``bucket`` after this; free it until backward
    needs it again. A no-op until bound."""


def early_linear(x: torch.Tensor, weight: torch.Tensor, *, name: str) -> torch.Tensor:
    """``linear(x, weight)`` for a read of the parameter ``weight`` (named ``name``) that
    backward reaches long before its first read: a tied embedding's output head
    (param-gather pass, zero >= 2). The runtime binds it to a product whose backward
    frees the weight (zero=3) before it makes the weight's gradient, sums that gradient
    over the data-parallel ranks at once and keeps this rank's part, instead of autograd
    holding it whole until the parameter's first read (fxmeg/runtime/data_parallel/zero.py)."""
    return torch.nn.functional.linear(x, weight)


@has_side_effect
def expert_load(
    top_k_index: torch.Tensor, *, layer: str, experts: int, bias: str | None = None
) -> None:
    """The experts ``top_k_index [T, k]`` routes each of T tokens to, in the block of
    ``experts`` experts of module ``layer``; ``bias``: the FQN of the buffer its router
    adds to the scores before the top-k (DeepSeek-V3's ``e_score_correction_bias``), if
    any. Nothing reads a result: a no-op until the runtime binds it to a recorder."""


def global_tokens(fraction: torch.Tensor, *, group: str) -> torch.Tensor:
    """A router loss's tokens per expert (``fraction``: of the micro-batch's routed pairs;
    no gradient flows through it) replaced by their mean over the global batch's
    micro-batches so far, every data-parallel rank's (``group``): Megatron's
    ``global_aux_loss``. Unbound, the micro-batch's own; the runtime binds it to
    ``fxmeg.runtime.expert_load.GlobalTokens``."""
    return fraction


@has_side_effect
def tp_rng_fork(x, *, group: str):
    """``x`` unchanged; from here to the matching ``tp_rng_join`` random ops draw from this
    tp rank's stream (a no-op until the runtime binds it)."""
    return x


@has_side_effect
def tp_rng_join(y, *, group: str):
    """``y`` unchanged; the default random stream is back (a no-op until bound)."""
    return y


RNG_MARKERS = (tp_rng_fork, tp_rng_join)

EP = "ep"
"""Symbolic expert-parallel group name in graphs before binding."""
DP = "dp"
"""Symbolic data-parallel group name in graphs before binding."""


@moe.as_op
def routed_experts(*args, group: str, **options):
    """A routed-experts block (expert-parallel pass; ``fxmeg.ir.moe``), with
    ``moe.routed_experts``' arguments (its signature; ``moe.as_op``) but for the exchange:
    ``middle`` is the model's activation between the two expert matmuls (a sub-graph);
    ``capacity_factor`` (None: dropless), ``layer`` (the block's module, naming its dropped
    pairs) and ``probs_on_input`` (the weights scale the experts' input rows). Unbound,
    every expert is local (the parent graph in one process); the runtime binds it to
    ``fxmeg.runtime.experts.RankExperts.routed_experts``, which exchanges rows over ``group``."""
    return moe.routed_experts(*args, **options)


@moe.as_op
def routed_experts_split(*args, group: str, **options):
    """``routed_experts`` in a zero-bubble split's forward graph (split_backward pass):
    returns (its result, a ``moe_split.SplitExperts`` kept for ``experts_input_grad`` and
    ``experts_weight_grad``). Unbound every expert is local; the runtime binds it to
    ``fxmeg.runtime.experts.RankExperts.routed_experts_split``."""
    return moe_split.SplitExperts.run(moe.routed_experts, *args, **options)


def experts_input_grad(grad: torch.Tensor, state: moe_split.SplitExperts, *, hidden: bool,
                       weights: bool, banks: bool):
    """A split routed-experts block's I: (its hidden rows' gradient, its routing weights')
    from its result's ``grad`` (``SplitExperts.input_grad``; the reverse all-to-alls), and
    ``state`` again, which its W reads after this."""
    return (*state.input_grad(grad, hidden=hidden, weights=weights, banks=banks), state)


def experts_weight_grad(state: moe_split.SplitExperts, after: moe_split.SplitExperts):
    """A split routed-experts block's W: its banks' gradients (``SplitExperts.weight_grad``);
    ``after``: the block's I's state, read so the graph runs W after I."""
    return state.weight_grad()


def routed_experts_call(*args, **kwargs) -> tuple[tuple, dict]:
    """The (args, kwargs) of a ``routed_experts`` node, checked against its signature
    (a misspelt or missing option fails when the pass writes the node, not when it runs)."""
    bound = inspect.signature(routed_experts).bind(*args, **kwargs)
    return bound.args, bound.kwargs


for _fn in (
    recv,
    send,
    deallocate,
    wait_param_gather,
    zero_gather,
    zero_release,
    early_linear,
    expert_load,
    tp_rng_fork,
    tp_rng_join,
    routed_experts,
    routed_experts_split,
    experts_input_grad,
    experts_weight_grad,
    global_tokens,
):
    _fn.__module__ = "fxmeg.ir.ops"  # printed graphs read fxmeg_ir_ops_recv(...)


@torch.library.custom_op("fxmeg::scale_aux_loss", mutates_args=())
def scale_aux_loss(loss: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged; in backward, ``aux`` receives the incoming gradient times
    ``scale`` (Megatron's MoEAuxLossAutoScaler): an auxiliary loss (a router's load
    balancing) enters the gradients with a weight the runtime sets, not token-weighted
    like the language-model loss it rides on."""
    return loss.clone()


@scale_aux_loss.register_fake
def _(loss, aux, scale):
    return torch.empty_like(loss)


def _aux_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _aux_backward(ctx, grad):
    aux, scale = ctx.saved_tensors
    return grad, (grad * scale).expand_as(aux).to(aux.dtype), None


scale_aux_loss.register_autograd(_aux_backward, setup_context=_aux_setup)
AUX_SCALE = "fxmeg_aux_loss_scale"
"""The buffer holding the aux-loss gradient weight in a graph that has one."""


# ---------------------------------------------------------------- tensor-parallel collectives

TP = "tp"
"""Symbolic group name in graphs before binding."""

_LIB = torch.library.Library("fxmeg", "FRAGMENT")
_SCHEMAS = {
    "tp_copy": "(Tensor x, str group) -> Tensor",
    "tp_reduce": "(Tensor x, str group) -> Tensor",
    "sp_gather": "(Tensor x, int dim, int size, str group) -> Tensor",
    "sp_scatter": "(Tensor x, int dim, int size, str group) -> Tensor",
    # Megatron's gather_from_sequence_parallel_region(tensor_parallel_output_grad=False) and
    # scatter_to_sequence_parallel_region: a sequence-split value made whole where every rank
    # then computes the same values (a routed-experts block under sp), and back
    "sp_whole": "(Tensor x, int dim, int size, str group) -> Tensor",
    "sp_split": "(Tensor x, int dim, int size, str group) -> Tensor",
    "tp_max": "(Tensor x, str group) -> Tensor",
    "tp_slice": "(Tensor x, int dim, int size, str group) -> Tensor",
    "tp_pad": "(Tensor x, int dim, int size, str group) -> Tensor",
    "vocab_shard_ids": "(Tensor ids, int rows, str group) -> (Tensor, Tensor)",
    # (per-token loss, softmax of the local logits, target index in the local rows or -1)
    "vocab_parallel_cross_entropy": "(Tensor logits, Tensor target, int ignore_index, str group) "
    "-> (Tensor, Tensor, Tensor)",
    "cp_slice": "(Tensor x, int dim, int size, str group) -> Tensor",
    "cp_unslice": "(Tensor x, int dim, int size, str group) -> Tensor",
    "cp_gather": "(Tensor x, int dim, int size, str group) -> Tensor",
    "cp_reduce_scatter": "(Tensor x, int dim, int size, str group) -> Tensor",
    "cp_causal_mask": "(Tensor q, int dim, int size, str group) -> Tensor",
    "cp_all_reduce": "(Tensor x, str group) -> Tensor",
    "cp_attention": "(Tensor q, Tensor k, Tensor v, float? scale, bool enable_gqa, int size, "
    "str group) -> Tensor",
    "cp_attention_backward": "(Tensor grad, Tensor q, Tensor k, Tensor v, float? scale, "
    "bool enable_gqa, int size, str group) -> (Tensor, Tensor, Tensor)",
    # cp_comm_type a2a and a2a+p2p (DeepSpeed-Ulysses): sequence parts <-> heads parts
    # within each run of ``inner`` consecutive cp ranks; ``dim`` is the sequence dim, the
    # heads are dim - 1 (docs/long-context.md)
    "cp_to_heads": "(Tensor x, int dim, int size, int inner, str group) -> Tensor",
    "cp_from_heads": "(Tensor x, int dim, int size, int inner, str group) -> Tensor",
    # cp_comm_type p2p and a2a+p2p: ring attention; (output, log-sum-exp of each query's
    # scores in fp32). ``mask`` is whole ((..., 1 or seq, 1 or seq): the kernel picks each
    # block's rows and columns)
    "cp_ring_attention": "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, "
    "float? scale, bool enable_gqa, int size, int inner, str group) -> (Tensor, Tensor)",
    "cp_ring_attention_backward": "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, Tensor? mask, bool causal, float? scale, bool enable_gqa, int size, "
    "int inner, str group) -> (Tensor, Tensor, Tensor)",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)
fx_ops = torch.ops.fxmeg
COLLECTIVES = frozenset(getattr(fx_ops, n).default for n in _SCHEMAS)
"""Every op that takes a group name (bound by the runtime)."""


def _resized(x, dim: int, factor: float):
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


torch.library.register_fake("fxmeg::tp_copy", lambda x, group: torch.empty_like(x))
torch.library.register_fake("fxmeg::tp_reduce", lambda x, group: torch.empty_like(x))
torch.library.register_fake("fxmeg::tp_max", lambda x, group: torch.empty_like(x))
torch.library.register_fake("fxmeg::sp_gather", lambda x, dim, size, group: _resized(x, dim, size))
torch.library.register_fake("fxmeg::tp_pad", lambda x, dim, size, group: _resized(x, dim, size))
torch.library.register_fake("fxmeg::sp_whole", lambda x, dim, size, group: _resized(x, dim, size))
torch.library.register_fake(
    "fxmeg::sp_split", lambda x, dim, size, group: _resized(x, dim, 1 / size)
)
torch.library.register_fake(
    "fxmeg::sp_scatter", lambda x, dim, size, group: _resized(x, dim, 1 / size)
)
torch.library.register_fake(
    "fxmeg::tp_slice", lambda x, dim, size, group: _resized(x, dim, 1 / size)
)
torch.library.register_fake(
    "fxmeg::cp_slice", lambda x, dim, size, group: _resized(x, dim, 1 / size)
)
torch.library.register_fake("fxmeg::cp_unslice", lambda x, dim, size, group: _resized(x, dim, size))
torch.library.register_fake("fxmeg::cp_gather", lambda x, dim, size, group: _resized(x, dim, size))
torch.library.register_fake(
    "fxmeg::cp_reduce_scatter", lambda x, dim, size, group: _resized(x, dim, 1 / size)
)
torch.library.register_fake("fxmeg::cp_all_reduce", lambda x, group: torch.empty_like(x))
# queries' rows, values' features (latent attention's values are narrower than its keys)
torch.library.register_fake(
    "fxmeg::cp_attention",
    lambda q, k, v, scale, gqa, size, group: q.new_empty((*q.shape[:-1], v.shape[-1])),
)
# contiguous, as the kernel's products and reduce-scatters are (not q's strides)
torch.library.register_fake(
    "fxmeg::cp_attention_backward",
    lambda grad, q, k, v, scale, gqa, size, group: (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    ),
)
torch.library.register_fake(
    "fxmeg::cp_to_heads",
    lambda x, dim, size, inner, group: _resized(_resized(x, dim, inner), dim - 1, 1 / inner),
)
torch.library.register_fake(
    "fxmeg::cp_from_heads",
    lambda x, dim, size, inner, group: _resized(_resized(x, dim, 1 / inner), dim - 1, inner),
)
torch.library.register_fake(
    "fxmeg::cp_ring_attention",
    lambda q, k, v, mask, causal, scale, gqa, size, inner, group: (
        q.new_empty((*q.shape[:-1], v.shape[-1])),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
    ),
)
torch.library.register_fake(
    "fxmeg::cp_ring_attention_backward",
    lambda grad, q, k, v, out, lse, mask, causal, scale, gqa, size, inner, group: (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    ),
)
torch.library.register_fake(
    "fxmeg::cp_causal_mask",
    lambda q, dim, size, group: q.new_empty((q.shape[dim], q.shape[dim] * size), dtype=torch.bool),
)
torch.library.register_fake(
    "fxmeg::vocab_shard_ids",
    lambda ids, rows, group: (torch.empty_like(ids), torch.empty_like(ids, dtype=torch.bool)),
)
torch.library.register_fake(
    "fxmeg::vocab_parallel_cross_entropy",
    lambda logits, target, ignore_index, group: (
        logits.new_empty(target.shape, dtype=torch.float32),
        logits.new_empty(logits.shape, dtype=torch.float32),
        torch.empty_like(target),
    ),
)


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]


def _autograd(name: str, backward) -> None:
    torch.library.register_autograd(f"fxmeg::{name}", backward, setup_context=_keep_args)


_autograd("tp_copy", lambda ctx, g: (fx_ops.tp_reduce(g, *ctx.args), None))
_autograd("tp_reduce", lambda ctx, g: (g, None))


def _tp_max_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)
    ctx.group = inputs[1]


def _tp_max_backward(ctx, grad):
    """amax's rule over ranks: the gradient goes to the ranks whose value is the maximum,
    shared evenly between them when several are (ties)."""
    x, out = ctx.saved_tensors
    won = (x == out).to(grad.dtype)
    return grad * won / fx_ops.tp_reduce(won, ctx.group), None


torch.library.register_autograd("fxmeg::tp_max", _tp_max_backward, setup_context=_tp_max_setup)
_autograd("sp_gather", lambda ctx, g: (fx_ops.sp_scatter(g, *ctx.args), None, None, None))
_autograd("sp_scatter", lambda ctx, g: (fx_ops.sp_gather(g, *ctx.args), None, None, None))
_autograd("tp_slice", lambda ctx, g: (fx_ops.tp_pad(g, *ctx.args), None, None, None))
_autograd("tp_pad", lambda ctx, g: (fx_ops.tp_slice(g, *ctx.args), None, None, None))
# every rank's gradient of the whole value is the same: each keeps its part, and back
_autograd("sp_whole", lambda ctx, g: (fx_ops.sp_split(g, *ctx.args), None, None, None))
_autograd("sp_split", lambda ctx, g: (fx_ops.sp_whole(g, *ctx.args), None, None, None))
_autograd("cp_slice", lambda ctx, g: (fx_ops.cp_unslice(g, *ctx.args), None, None, None))
_autograd("cp_unslice", lambda ctx, g: (fx_ops.cp_slice(g, *ctx.args), None, None, None))
_autograd("cp_gather", lambda ctx, g: (fx_ops.cp_reduce_scatter(g, *ctx.args), None, None, None))
_autograd("cp_reduce_scatter", lambda ctx, g: (fx_ops.cp_gather(g, *ctx.args), None, None, None))
_autograd("cp_causal_mask", lambda ctx, g: (None, None, None, None))


def _cp_attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])  # the local q, k, v only
    ctx.args = inputs[3:]


def _cp_attention_grad(ctx, grad):
    q, k, v = ctx.saved_tensors
    return (*fx_ops.cp_attention_backward(grad, q, k, v, *ctx.args), None, None, None, None)


torch.library.register_autograd(
    "fxmeg::cp_attention", _cp_attention_grad, setup_context=_cp_attention_setup
)
_autograd("cp_to_heads", lambda ctx, g: (fx_ops.cp_from_heads(g, *ctx.args), *[None] * 4))
_autograd("cp_from_heads", lambda ctx, g: (fx_ops.cp_to_heads(g, *ctx.args), *[None] * 4))


def _ring_setup(ctx, inputs, output):
    q, k, v, mask = inputs[:4]
    ctx.save_for_backward(q, k, v, *output, *([] if mask is None else [mask]))
    ctx.args = inputs[4:]


def _ring_grad(ctx, grad, _grad_lse):
    """The ring's backward (fxmeg/runtime/ring_attention.py) from the forward's output and
    log-sum-exp; the mask and the flags have no gradient."""
    q, k, v, out, lse, *mask = ctx.saved_tensors
    grads = fx_ops.cp_ring_attention_backward(
        grad, q, k, v, out, lse, mask[0] if mask else None, *ctx.args
    )
    return (*grads, *[None] * 7)


torch.library.register_autograd(
    "fxmeg::cp_ring_attention", _ring_grad, setup_context=_ring_setup
)

CP = "cp"
"""Symbolic context-parallel group name in graphs before binding."""


def cp_positions(seq: int, size: int, rank: int) -> list[int]:
    """Global positions of cp rank ``rank``'s rows of a sequence of length ``seq``: chunks
    ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` (Megatron's load balancing for
    causal attention; ``seq`` must be divisible by ``2 * size``)."""
    chunk = seq // (2 * size)
    assert chunk * 2 * size == seq, (seq, size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return [*range(first, first + chunk), *range(second, second + chunk)]


def cp_held(seq: int, size: int, rank: int, inner: int = 1) -> list[int]:
    """Global positions a cp rank's attention holds after ``cp_to_heads`` over runs of
    ``inner`` consecutive cp ranks (1: none): the sorted positions of its run's ranks."""
    first = rank - rank % inner
    return sorted(p for r in range(first, first + inner) for p in cp_positions(seq, size, r))


def _vpce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2], inputs[1])
    ctx.ignore_index, ctx.dtype = inputs[2], inputs[0].dtype


def _vpce_backward(ctx, grad_loss, _grad_softmax, _grad_local):
    """d loss / d logits = softmax - one_hot(target), on this rank's columns. Static
    shapes (no nonzero), so AOT autograd can trace it: rows whose target is another
    rank's add 0."""
    softmax, local, target = ctx.saved_tensors
    g = grad_loss.masked_fill(target == ctx.ignore_index, 0.0).unsqueeze(-1)
    grad = softmax * g
    mine = (local >= 0).unsqueeze(-1)
    grad = grad.scatter_add(
        -1, local.clamp_min(0).unsqueeze(-1), torch.where(mine, -g, torch.zeros_like(g))
    )
    return grad.to(ctx.dtype), None, None, None


torch.library.register_autograd(
    "fxmeg::vocab_parallel_cross_entropy", _vpce_backward, setup_context=_vpce_setup
)
