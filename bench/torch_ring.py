"""The peer of bench/long_context.py: PyTorch's own ring attention
(``torch.distributed.tensor.experimental.context_parallel``, torch 2.13) on the same model
and shapes, on CPU / gloo.

Stock torch 2.13 does not run it on a CPU: context parallelism maps only the CUDA SDPA
kernels (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and their
backwards, torch/distributed/tensor/experimental/_context_parallel/_attention.py) to its ring;
on a CPU, SDPA lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no
ring handler and no sharding strategy: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered". ``install_cpu_shim`` routes that op and its backward into torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` (torch's rotation,
head-tail load balancing and log-sum-exp merge, the CPU kernel per block); nothing else
changes. ``torch_ring_step(..., cpu_shim=False)`` runs stock torch and returns its error.
Checked at sequence 256 on 4 ranks against one process: logits within 7.2e-7, parameter
gradients within 5.6e-7 (relative), for rotate 'alltoall' and 'allgather'.

The model, ``Decoder``: token and learned position embeddings, 2 pre-norm blocks of causal
SDPA (4 heads of 32) and a GELU MLP, vocabulary 256; ``Loss`` is it with its mean
cross-entropy, which fxmeg trains in bench/long_context.py.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxmeg.diagnostics.devices import peak_resident

VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 256, 128, 4, 32, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        # (b, heads, s, d): sequence dim is 2, as torch CP expects.
        # Must be looked up through the module F at call time: context_parallel
        # monkey-patches F.scaled_dot_product_attention.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, max_seq):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(max_seq, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, pos):
        x = self.tok(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class Loss(nn.Module):
    """``Decoder`` and its mean cross-entropy: what fxmeg trains."""

    def __init__(self, max_seq: int) -> None:
        super().__init__()
        self.decoder = Decoder(max_seq)

    def forward(self, tokens, pos, labels):
        return F.cross_entropy(self.decoder(tokens, pos).flatten(0, 1), labels.flatten())


def _maxrss_bytes() -> int:
    return peak_resident()


def _make(seq):
    torch.manual_seed(0)
    model = Decoder(seq)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    # .clone(), not .contiguous(): with batch 1 the slices are already
    # "contiguous" views sharing one storage, and context_parallel shards its
    # buffers IN PLACE (resize_ + copy_), so aliased buffers corrupt each other.
    tokens = data[:, :-1].clone()
    labels = data[:, 1:].clone()
    pos = torch.arange(seq).unsqueeze(0)
    return model, tokens, labels, pos


def _cp_imports():
    from torch.distributed.device_mesh import init_device_mesh

    # torch 2.13: context_parallel is re-exported from ...experimental, but
    # context_parallel_unshard / set_rotate_method live only in ._attention.
    from torch.distributed.tensor.experimental._attention import (
        context_parallel,
        context_parallel_unshard,
        set_rotate_method,
    )

    return init_device_mesh, context_parallel, context_parallel_unshard, set_rotate_method


_SHIM_INSTALLED = False


def install_cpu_shim():
    """Teach torch's CP dispatcher the CPU flash-attention ops.

    torch 2.13's CP only maps aten._scaled_dot_product_{flash,efficient,cudnn}
    _attention(_backward) (the CUDA kernels) to its ring implementation; on CPU
    SDPA lowers to aten._scaled_dot_product_flash_attention_for_cpu, which has
    neither a CP handler nor any DTensor sharding strategy.  This shim reuses
    torch's own _templated_ring_attention / _templated_ring_attention_backward
    (same rotater, same head-tail load balancing, same LSE merger) with the CPU
    kernels plugged in as the per-block op.  Nothing else is changed.
    """
    global _SHIM_INSTALLED
    if _SHIM_INSTALLED:
        return
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    aten = torch.ops.aten

    def fwd(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
            scale=None):
        if attn_mask is not None or dropout_p != 0.0:
            raise NotImplementedError("CPU CP shim: attn_mask/dropout unsupported")
        return A._templated_ring_attention(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
            query=query, key=key, value=value, is_causal=is_causal,
            dropout_p=dropout_p, scale=scale,
        )

    def bwd(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
            attn_mask=None, scale=None):
        if attn_mask is not None or dropout_p != 0.0:
            raise NotImplementedError("CPU CP shim: attn_mask/dropout unsupported")
        return A._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
        )

    def make_handler(fn):
        def handler(op_call, args, kwargs):
            op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
            mesh = op_info.compute_mesh
            local = fn(mesh, *op_info.local_args, **op_info.local_kwargs)
            # every output (out, lse / dq, dk, dv) is sharded on the sequence dim 2
            return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local)

        return handler

    # A.custom_ops is read each time the context_parallel dispatcher is enabled.
    A.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = make_handler(fwd)
    A.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = \
        make_handler(bwd)
    _SHIM_INSTALLED = True


def _cp_step(model, mesh, context_parallel, tokens, labels, pos):
    """One fwd+bwd under context_parallel. Buffers are sharded (head-tail load
    balanced) in place inside the context and restored on exit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # On CPU, FLASH_ATTENTION selects aten._scaled_dot_product_flash_attention_for_cpu
    # (EFFICIENT/CUDNN have no CPU kernel; MATH decomposes into plain DTensor ops).
    backend = getattr(SDPBackend, os.environ.get("TORCHCP_SDPA", "FLASH_ATTENTION"))
    with sdpa_kernel([backend]):
        with context_parallel(
            mesh,
            buffers=[tokens, labels, pos],
            buffer_seq_dims=[1, 1, 1],
        ):
            logits = model(tokens, pos)
            loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
            loss.backward()
    return loss.detach(), logits.detach()


def torch_ring_step(rank: int, world: int, seq: int, steps: int, *, rotate: str = "alltoall",
                    cpu_shim: bool = True) -> dict:
    """One warm-up and ``steps`` timed forward-backward steps of ``Decoder`` under torch's
    context_parallel over the ``world`` ranks of the initialised group: the mean step
    time and the peak resident set above the baseline taken once the model exists; or
    ``ok`` False with the error (stock torch on a CPU: ``cpu_shim=False``)."""
    try:
        if cpu_shim:
            install_cpu_shim()
        init_device_mesh, context_parallel, _, set_rotate_method = _cp_imports()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        set_rotate_method(rotate)
        model, tokens, labels, pos = _make(seq)
        dist.barrier()
        baseline = _maxrss_bytes()
        times = []
        for i in range(1 + steps):  # the first is the warm-up
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            _cp_step(model, mesh, context_parallel, tokens, labels, pos)
            if i > 0:
                times.append(time.perf_counter() - t0)
        return {"ok": True, "rank": rank, "step_s": sum(times) / len(times),
                "peak_rss_bytes_above_baseline": _maxrss_bytes() - baseline, "rotate": rotate,
                "cpu_shim": cpu_shim}
    except Exception as e:  # noqa: BLE001  (reported: a peer that does not run here)
        return {"ok": False, "rank": rank, "error": f"{type(e).__name__}: {str(e)[:300]}"}
