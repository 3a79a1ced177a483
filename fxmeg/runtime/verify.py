"""``Engine.verify``: one global batch through the parallel program and through the
single-device graph, losses and every parameter's gradient compared
(docs/megatron-semantics.md §1.10).

Parallel side: the engine's own forward / backward (``step.forward_backward``: schedule,
bucketed reductions, finalize), no optimizer step; each parameter's reduced gradient (its
``main_grad``, already divided by the global token count) is made whole as
``gather_full_state`` makes parameters whole: tensor-parallel shards all-gathered,
broadcast from the parameter's first pipeline holder (with the distributed optimizer each
bucket is first all-gathered over data-parallel ranks, since after its reduce-scatter a
rank holds only its shard). The gradient buffers are zeroed afterwards and the RNG states
restored; parameters, optimizer state, loss scaler and lr schedule are not touched.

Reference (global rank 0 only): ``Program.reference``, the graph captured from the user's
model after the loss pass (no parallel rewrite), with the current full parameter values,
run on each micro-batch of the global batch in order; ``loss_sum`` backward per
micro-batch, gradients accumulated in float64 and divided by the global token count. The
graph runs in the training dtype (its casts are the model's own; a float64 copy of a
captured graph would break at any hard-coded cast), so the tolerances are those of two
correct fp32 computations that sum in another order.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from fxmeg.config import cast_inputs
from fxmeg.errors import BatchError
from fxmeg.ir.layouts import is_split, reduces_grad
from fxmeg.ir.ops import AUX_SCALE
from fxmeg.ir.program import Program
from fxmeg.ir.tags import tag
from fxmeg.runtime.batches import Batch, UserBatch, check, microbatches, positional
from fxmeg.runtime.context import RankContext
from fxmeg.runtime.state import gather_full_grads, gather_full_state, graph_order
from fxmeg.runtime.step import _any_rank, forward_backward

TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, 5e-2), "fp16": (1e-2, 2e-2)}
"""precision -> (loss, gradient) relative tolerance. fp32: the parity bounds of
docs/megatron-semantics.md §1.9 (gradients: 1e-4, as the grad-norm parity check). Half
precision: the parallel and the reference side each round in bf16 / fp16 (chosen, not measured: pass
rtol= to tighten them)."""


@dataclass(frozen=True)
class ParamError:
    """One parameter's gradient, parallel vs reference."""

    name: str
    error: float
    """||g - g_ref|| / ||g_ref|| (0 when both are zero, inf when only the reference is)."""
    norm: float
    """||g_ref||."""
    chunk: int | None
    """The first chunk that reads the parameter; None when no chunk graph reads it
    (``Program.unread``)."""
    node: str
    """Its get_attr node in that chunk graph ('' when none reads it)."""
    readers: tuple[tuple[str, str, str], ...]
    """(node name, op, the pass that inserted it or 'capture') of the nodes reading it."""
    tp: tuple | None
    """Its tensor-parallel spec (set by the tensor_parallel pass), if any."""
    pass_: str
    """The pass that rewrote what reads it: tensor_parallel for a parameter it shards or
    whose gradient it all-reduces over tp, else the pass that inserted its first
    rewritten reader, else 'capture' (the graph as captured)."""

    def describe(self) -> str:
        if self.chunk is None:
            return (
                f"{self.name}: relative error {self.error:.3e} (reference norm {self.norm:.3e}); "
                "read by no chunk graph"
            )
        readers = ", ".join(f"{n} ({op}, {p})" for n, op, p in self.readers)
        tp = f"; tensor_parallel spec {self.tp}" if self.tp is not None else ""
        return (f"{self.name}: relative error {self.error:.3e} (reference norm {self.norm:.3e}); "
                f"chunk {self.chunk}, node {self.node}, read by {readers}{tp}; pass {self.pass_}")


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of ``Engine.verify``; identical on every rank."""

    ok: bool
    loss: float
    """The parallel program's token-weighted loss of the batch."""
    reference_loss: float
    num_tokens: int
    reference_num_tokens: int
    loss_error: float
    loss_rtol: float
    grad_rtol: float
    first_failure: ParamError | None
    """The first parameter, in graph order (chunk order, then node order), whose gradient
    differs by more than grad_rtol."""
    worst: ParamError | None
    """The parameter with the largest relative error."""
    errors: tuple[ParamError, ...] = field(default=(), repr=False)
    """Every trainable parameter of the model: those the chunk graphs read in graph order,
    then those none reads (``unread``)."""

    @property
    def unread(self) -> tuple[str, ...]:
        """Trainable parameters no chunk graph reads: neither side gives them a gradient.
        The reference is the same capture, so verify cannot tell whether the model should
        read them (docs/cli.md): listed in the report, not counted as a mismatch unless the
        reference has a gradient for one."""
        return tuple(e.name for e in self.errors if e.chunk is None)

    def report(self) -> str:
        lines = [
            f"fxmeg verify: {'OK' if self.ok else 'MISMATCH'}",
            f"  loss {self.loss:.8g} vs reference {self.reference_loss:.8g}: relative error "
            f"{self.loss_error:.3e} (tolerance {self.loss_rtol:.0e}); tokens {self.num_tokens} vs "
            f"{self.reference_num_tokens}",
            f"  {len(self.errors)} parameter gradients compared (tolerance {self.grad_rtol:.0e})",
        ]
        if self.unread:
            lines.append(
                f"  {len(self.unread)} trainable parameter(s) read by no chunk graph (no gradient, "
                f"not trained): {', '.join(self.unread)}"
            )
        if self.worst is not None:
            lines.append(f"  worst: {self.worst.name} {self.worst.error:.3e}")
        if self.first_failure is not None:
            lines.append("  first mismatch in graph order: " + self.first_failure.describe())
            bad = [e.name for e in self.errors if not e.error <= self.grad_rtol]
            lines.append(f"  {len(bad)} parameter(s) beyond tolerance: {', '.join(bad[:10])}"
                         + (" ..." if len(bad) > 10 else ""))
        return "\n".join(lines)


def verify(
    program: Program,
    ctx: RankContext,
    batch: UserBatch | None,
    *,
    loss_rtol: float | None = None,
    grad_rtol: float | None = None,
) -> VerifyResult:
    """See ``fxmeg.Engine.verify``. Collective."""
    if program.reference is None:
        raise BatchError(
            "this Program has no reference graph (built by an older fxmeg): transform again"
        )
    rank0 = ctx.groups.rank == 0
    m = ctx.config.num_microbatches
    refused = ordered = None
    try:  # the reference reads the inputs in order; the parallel side takes the batch as given
        ordered = positional(program, batch, what="global batch") if batch is not None else None
    except BatchError as err:
        refused = err
    # every rank raises
    if _any_rank(refused is not None or (rank0 and not isinstance(ordered, tuple)), ctx):
        raise refused or BatchError(
            "verify needs the global batch (a tuple or dict of tensors, like the example) "
            "on rank 0, which runs the reference, and a valid one on every rank that passes one"
        )
    rng = _rng_state()
    ctx.ddp.wait_for_params()
    try:
        loss_sum, num_tokens = forward_backward(program, ctx, microbatches(program, ctx, batch, m))
        grads = gather_full_grads(program, ctx)
    finally:
        ctx.ddp.zero_grad_buffer()
        _set_rng_state(rng)
    state = gather_full_state(program, ctx)
    result = None
    if rank0:
        default = TOLERANCES[ctx.config.precision]
        result = _compare(program, ctx, ordered, state, grads, loss_sum, num_tokens,
                          loss_rtol if loss_rtol is not None else default[0],
                          grad_rtol if grad_rtol is not None else default[1])
        _set_rng_state(rng)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def _reference(program: Program, ctx: RankContext, batch: Batch, state: dict, num_tokens: float):
    """The single-device graph on every micro-batch of the global batch: (loss_sum,
    num_tokens, float64 gradients / global tokens)."""
    ref = program.reference
    names = {n: c for c, ns in program.aliases.items() for n in ns}
    memo: dict[int, torch.Tensor] = {}
    for name, p in ref.named_parameters():
        value = state.get(name)
        if value is None:
            value = next(state[k] for k, c in names.items() if c == name and k in state)
        # a gathered copy already
        memo[id(p)] = nn.Parameter(value.detach(), requires_grad=p.requires_grad)
    for b in ref.buffers():
        memo.setdefault(id(b), b)
    aux = getattr(ref, AUX_SCALE, None)
    if aux is not None:
        memo[id(aux)] = aux.clone()
    gm = copy.deepcopy(ref, memo)
    mbs, dp, m = ctx.config.micro_batch_size, ctx.config.parallel.dp, ctx.config.num_microbatches
    # each micro-batch's aux loss weighs 1 / (m * dp) of the global tokens (step.weigh_aux_loss)
    if aux is not None:
        getattr(gm, AUX_SCALE).fill_(max(num_tokens, 1.0) / (m * dp))
    check(program, batch, rows=m * mbs * dp, what="global batch")
    params = {n: p for n, p in gm.named_parameters() if p.requires_grad}
    acc = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    loss_sum = tokens = 0.0
    for i in range(m * dp):
        mb = cast_inputs(
            tuple(t[i * mbs : (i + 1) * mbs].to(ctx.device) for t in batch), ctx.config.dtype
        )
        out = gm(*mb)
        ls, nt = out[0], out[1]
        ls.backward()
        loss_sum += float(ls.detach().double())
        tokens += float(nt)
        for n, p in params.items():
            if p.grad is not None:
                acc[n] += p.grad.double()
                p.grad = None
    grads = {n: g / max(tokens, 1.0) for n, g in acc.items()}
    return loss_sum, tokens, grads


def _compare(
    program, ctx, batch, state, grads, loss_sum, num_tokens, loss_rtol, grad_rtol
) -> VerifyResult:
    ref_sum, ref_tokens, ref_grads = _reference(program, ctx, batch, state, num_tokens)
    loss, ref_loss = loss_sum / max(num_tokens, 1.0), ref_sum / max(ref_tokens, 1.0)
    loss_error = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    errors = []
    for name, chunk, node in graph_order(program):
        r = ref_grads.get(name)
        g = grads[name].double()
        r = torch.zeros_like(g) if r is None else r.to(g.device)
        diff, norm = float((g - r).norm()), float(r.norm())
        err = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
        if not math.isfinite(float(g.abs().sum())):
            err = math.inf
        errors.append(_describe(name, chunk, node, err, norm))
    for name in program.unread:  # no chunk graph reads it: its parallel gradient is zero
        r = ref_grads.get(name)
        norm = float(r.norm()) if r is not None else 0.0
        errors.append(
            ParamError(
                name=name,
                error=0.0 if norm == 0 else math.inf,
                norm=norm,
                chunk=None,
                node="",
                readers=(),
                tp=None,
                pass_="capture",
            )
        )
    bad = [e for e in errors if not e.error <= grad_rtol]
    ok = loss_error <= loss_rtol and int(num_tokens) == int(ref_tokens) and not bad
    return VerifyResult(
        ok=ok, loss=loss, reference_loss=ref_loss, num_tokens=int(num_tokens),
        reference_num_tokens=int(ref_tokens), loss_error=loss_error, loss_rtol=loss_rtol,
        grad_rtol=grad_rtol, first_failure=bad[0] if bad else None,
        worst=max(errors, key=lambda e: e.error) if errors else None, errors=tuple(errors),
    )


def _describe(name: str, chunk: int, node: fx.Node, err: float, norm: float) -> ParamError:
    readers = tuple((u.name, str(u.target), tag(u, "pass", "capture")) for u in node.users)
    tp = tag(node, "tp")
    rewritten = [p for _, _, p in readers if p != "capture"]
    split = is_split(tp) or reduces_grad(tp)
    pass_ = "tensor_parallel" if split else (rewritten[0] if rewritten else "capture")
    return ParamError(name=name, error=err, norm=norm, chunk=chunk, node=node.name, readers=readers,
                      tp=tp, pass_=pass_)


def _rng_state():
    cuda = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
