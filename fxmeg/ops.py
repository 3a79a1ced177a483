"""Graph-level markers the passes insert. They show by name in printed graphs.

The pipeline pass marks every tensor that crosses a chunk boundary: ``recv`` where it
enters a chunk, ``send`` where it leaves, ``deallocate`` where the producer may free it.
Communication itself is the executor's work (lowered schedule actions RECV_F/SEND_F/...);
when a chunk graph runs, these markers are identities, so the parent graph that chains
all chunks in one process computes exactly what the captured model computes.

``wait_param_gather`` (param-gather pass) is the one marker with behaviour: it waits for
a bucket's pending parameter all-gather, which the runtime hangs on the bucket's
parameters as ``_fxmeg_gather``; with nothing pending it does nothing.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect


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
def wait_param_gather(param: torch.Tensor, *, bucket: tuple[int, int]) -> None:
    """Wait for the all-gather of ``bucket`` (chunk, index), which holds ``param``, before
    forward first reads any of its parameters (Megatron: overlap_param_gather)."""
    pending = getattr(param, "_fxmeg_gather", None)
    if pending is not None:
        pending.wait()


for _fn in (recv, send, deallocate, wait_param_gather):
    _fn.__module__ = "fxmeg.ops"  # printed graphs read fxmeg_ops_recv(...)


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
