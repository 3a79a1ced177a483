"""Tokens per expert: the recorder that ``fxmeg.ir.ops.expert_load`` markers call once bound
(``collectives.bind``), the step's expert-load figures and loss-free balancing
(runtime/step.py).

Each marker sits at a routed-experts block's top-k index (fxmeg/passes/expert_parallel.py).
During a training forward the recorder adds ``bincount(top_k_index, minlength=E)`` (the
(token, slot) pairs routed to each expert) into that layer's slice of one int64 tensor;
a forward without gradients (evaluation) and a recompute region's second run in backward
(``Recomputation.recomputing``) add nothing, so each micro-batch counts once. After the step
(``reduce``) the counts are summed over the dp x cp ranks (every token once: tp ranks
hold the same tokens and are not summed) and over the pipeline stages (each layer lives
on one), so every rank holds every layer's counts of the global batch; ``reset`` clears
them before the next forward.

``GlobalTokens`` is what ``fxmeg.ir.ops.global_tokens`` calls once bound (a router loss's
tokens per expert averaged over the global batch's micro-batches so far: Megatron's
``global_aux_loss``).

Loss-free balancing (``moe_router_bias_update_rate``, DeepSeek-V3; Megatron's
``get_updated_expert_bias``): ``update_biases`` moves each router's expert bias buffer
held on this rank by ``rate * sign(mean(counts) - counts)``, from the reduced counts,
so every rank holding a layer applies the same update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from fxmeg.ir.program import Program, load_marks
from fxmeg.ir.recomputation import Recomputation
from fxmeg.runtime.groups import Groups, all_reduce
from fxmeg.torch_private import resolve_process_group


class ExpertLoad:
    """This rank's tokens per expert of every layer of the model (zero for the layers of
    other pipeline stages until ``reduce``)."""

    def __init__(self, layers: dict[str, int], device: torch.device,
                 recomputation: Recomputation | None = None) -> None:
        self.recomputation = recomputation
        """Whose recomputed forwards are not counted (the rank's; None: every training forward)."""
        self.layers = dict(layers)
        """Every layer of the model (its experts module), in chunk and graph order -> E."""
        self.offsets, offset = {}, 0
        for name, experts in self.layers.items():
            self.offsets[name] = offset
            offset += experts
        self.counts = torch.zeros(offset, dtype=torch.int64, device=device)
        self.biases: dict[str, torch.Tensor] = {}
        """This rank's layers whose router adds an expert bias -> that buffer (bound chunks')."""

    @classmethod
    def of(cls, program: Program, recomputation: Recomputation | None = None) -> ExpertLoad | None:
        """The recorder of ``program``'s marked layers, or None when it has none."""
        layers = {
            n.kwargs["layer"]: n.kwargs["experts"] for gm in program.chunks for n in load_marks(gm)
        }
        return cls(layers, program.device, recomputation) if layers else None

    def hold(self, program: Program, chunks: dict[int, fx.GraphModule]) -> None:
        """Find the router bias buffers of this rank's ``chunks`` (bound copies of
        ``program``'s) by the FQNs the markers name."""
        for c, gm in chunks.items():
            for mark in load_marks(program.chunks[c]):
                if mark.kwargs.get("bias"):
                    self.biases[mark.kwargs["layer"]] = gm.get_buffer(mark.kwargs["bias"])

    def record(
        self, top_k_index: torch.Tensor, *, layer: str, experts: int, bias: str | None = None
    ) -> None:
        """``ops.expert_load`` bound: add this micro-batch's tokens per expert of ``layer``
        (a training forward only, and once: not again when backward recomputes it)."""
        again = self.recomputation is not None and self.recomputation.recomputing()
        if not torch.is_grad_enabled() or again:
            return
        start = self.offsets[layer]
        self.counts[start : start + experts] += torch.bincount(
            top_k_index.detach().reshape(-1), minlength=experts
        )

    def reset(self) -> None:
        self.counts.zero_()

    def reduce(self, groups: Groups) -> dict[str, tuple[int, ...]]:
        """Every layer's tokens per expert over the global batch, the same on every rank
        (module docstring). Collective over the dp x cp and pipeline groups."""
        all_reduce(self.counts, groups.dp_cp)
        all_reduce(self.counts, groups.pp)
        flat = self.counts.tolist()
        return {
            name: tuple(flat[self.offsets[name] : self.offsets[name] + e])
            for name, e in self.layers.items()
        }

    @torch.no_grad()
    def update_biases(self, rate: float) -> None:
        """Loss-free balancing (module docstring), from the counts ``reduce`` summed."""
        for layer, bias in self.biases.items():
            start = self.offsets[layer]
            counts = self.counts[start:start + self.layers[layer]].to(torch.float32)
            bias.add_((rate * torch.sign(counts.mean() - counts)).to(bias.dtype))


def load_imbalance(counts: tuple[int, ...] | list[int]) -> float:
    """max / mean of one layer's tokens per expert (1: perfectly balanced; E: every token
    to one expert); NaN without tokens."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else float("nan")


class GlobalTokens:
    """``ops.global_tokens`` bound: Megatron's global_aux_loss. In a training forward, the
    micro-batch's tokens per expert are summed over the data-parallel ranks (every rank
    runs its i-th micro-batch i-th) and added to the step's running sum; the result is
    their mean over every micro-batch so far, every rank's. ``reset`` starts a step; a
    forward without gradients (evaluation) keeps its micro-batch's own. Called once per
    micro-batch: inside a recompute region, backward's run replays the value forward got
    (``collectives.bind`` calls it through ``Recomputation.once``)."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.total: torch.Tensor | None = None
        self.seen = 0

    def running_mean(self, fraction: torch.Tensor, *, group: str) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return fraction
        summed = fraction.detach().clone()
        if self.dp > 1:
            dist.all_reduce(summed, group=resolve_process_group(group))
        self.total = summed if self.total is None else self.total + summed
        self.seen += 1
        return self.total / (self.seen * self.dp)

    def reset(self) -> None:
        self.total, self.seen = None, 0
