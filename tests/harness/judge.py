"""The judge of rounding: is a gradient that differs from the fp32 reference a bug, or
rounding? (docs/contributing.md, "Judging parity: the rule of rounding", says why it is built
this way and what was measured.)

A gradient within ``GRAD_RTOL`` of the reference's passes at once. Otherwise, at that step:

* **the exact gradient** is the reference's own computation replayed in float64 at the
  weights the reference's forward read at that step (``Replay``: no trajectory of its own,
  so no drift), under ``Float64``, a torch function mode that keeps float64 where the model
  casts down (Hugging Face's ``logits.float()``, RMSNorm's ``.to(torch.float32)``, a
  router's ``softmax(x, dtype=torch.float32)``);
* **the spread of rounding** is how far correct runs land from it: the reference and the
  same training with each micro-batch's rows in other orders (``PERMUTATIONS``: the same
  numbers summed in other orders, their own trajectories drifting as fxmeg's does), the
  farthest of them; never below a **floor**, ``FLOOR_UNITS`` units of rounding of the
  exact gradient's norm over the parameter's block (its module's parent: a gradient that
  is a small difference of the block's large terms carries their rounding, not its own)
  times the square root of the step's tokens (a sum over them);
* the gradient passes when it is finite and no farther from the exact one than
  ``SPREAD_FACTOR`` x that spread or the floor, and never farther than the **ceiling**,
  ``CEILING`` of the exact gradient's norm (or the floor, if larger), whatever the spread
  says.

A router's top-k choice within rounding of a tie at the exact weights makes the gradient
jump with rounding: the judge counts such choices (``Float64.near_ties``) and a failure
says so, rather than a tolerance hiding it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

GRAD_RTOL = 1e-4
"""A gradient this close to the reference's (relative to the reference's norm) passes
without the judge."""
SPREAD_FACTOR = 8.0
"""How much farther from the exact gradient than the farthest correct run a gradient may
land. The correct runs sample orders, not kernels: measured (docs/contributing.md), a
correct run under ATen's default (scalar) kernels lands up to 5.7 x farther than this
machine's AVX-512 runs do (a LayerNorm's weight and bias: sums over every token), under
AVX2 up to 1.9 x; with 8, the worst of them uses 0.60 of what is allowed."""
FLOOR_UNITS = 4.0
"""The floor, in units of rounding of the block's gradient norm times the square root of
the step's tokens (a gradient is a sum over them, whose rounding grows with their number in
the sequential sums of some kernels)."""
CEILING = {torch.float32: 1e-2, torch.bfloat16: 0.5, torch.float16: 0.5}
"""The farthest a gradient may be from the exact one, as a share of its norm, by the
precision of the arithmetic: rounding in fp32 never moves a gradient by 1% here; in
half precision a router's choice flipped by rounding can (measured: 0.3 on a bf16 router)."""
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""The unit of rounding of each precision."""
PERMUTATIONS = ("reversed", "rolled")
"""Each micro-batch's rows in reverse order, and rotated by half: the same training."""

_LOW = (torch.float32, torch.float16, torch.bfloat16)
_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


class Float64(TorchFunctionMode):
    """Every floating dtype a torch function is asked for becomes float64 (``x.float()``,
    ``x.to(torch.float32)``, ``softmax(x, dtype=torch.float32)``, ``torch.zeros(...,
    dtype=torch.bfloat16)``), so a float64 model stays float64 where it casts down. It
    also records, for every ``topk``, how many choices are within ``tie_rtol`` of a tie
    (the k-th and the next value that close, relative to the k-th): ``near_ties``."""

    def __init__(self, tie_rtol: float = 0.0) -> None:
        super().__init__()
        self.tie_rtol, self.near_ties = tie_rtol, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _up(v) for k, v in (kwargs or {}).items()}
        if func in _CASTS:
            return args[0].to(torch.float64)
        out = func(*(_up(a) for a in args), **kwargs)
        if func in (torch.topk, torch.Tensor.topk) and self.tie_rtol > 0:
            self.near_ties += _near_ties(args, kwargs, self.tie_rtol)
        return out


def _up(value):
    return torch.float64 if isinstance(value, torch.dtype) and value in _LOW else value


def _near_ties(args, kwargs, rtol: float) -> int:
    """How many of a topk's rows choose their k-th within ``rtol`` of the first left out."""
    x, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    if k >= x.shape[dim] or not x.is_floating_point():
        return 0
    top = torch.topk(x.detach(), k + 1, dim).values.movedim(dim, -1)
    gap = (top[..., k - 1] - top[..., k]).abs()
    return int((gap <= rtol * top[..., k - 1].abs()).sum())


class Replay(torch.optim.Optimizer):
    """Not an optimizer: it sets its parameters to recorded weights, the first at once and
    the next at each ``step``, so that a reference loop run with it computes each step's
    gradients at the weights another run's forward read at that step. Its groups name
    their parameters (``param_names``, as tests.harness.helpers.reference_groups gives)."""

    def __init__(self, groups: list[dict], weights: Sequence[dict[str, torch.Tensor]]) -> None:
        super().__init__(groups, {})
        self.weights, self.k = weights, 0
        self._load()

    def _load(self) -> None:
        if self.k >= len(self.weights):
            return
        with torch.no_grad():
            for group in self.param_groups:
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    p.copy_(self.weights[self.k][name])

    def step(self, closure=None):
        self.k += 1
        self._load()


def permuted(batches: list, how: str, micro_batch_size: int | None = None) -> list:
    """``batches`` (tuples of tensors with rows first) with the rows of each micro-batch
    (of ``micro_batch_size`` rows; the whole batch if None) reversed or rotated by half:
    the same training for any model whose loss treats rows alike within a micro-batch."""
    def order(rows: int) -> torch.Tensor:
        size = micro_batch_size or rows
        index = torch.arange(rows).view(-1, size)
        index = index.flip(1) if how == "reversed" else index.roll(size // 2, 1)
        return index.reshape(-1)

    return [tuple(t[order(t.shape[0])] for t in batch) for batch in batches]


@dataclass
class Judge:
    """What the rule needs of a reference training, computed on first need.

    ``again(batches, optimizer, dtype)``: the reference's own training loop on these batches,
    with this optimizer factory (None: the reference's own) and in this dtype (None: its
    own), returning its ``Run`` (tests.harness.helpers). ``batches``: the reference's;
    ``weights``: what its forward read at each step; ``precision``: the dtype of its
    arithmetic; ``micro_batch_size``: the rows its loss treats as one (None: the batch)."""

    again: Callable
    batches: list
    weights: list[dict[str, torch.Tensor]]
    precision: torch.dtype = torch.float32
    micro_batch_size: int | None = None

    @functools.cached_property
    def _exact(self) -> tuple[list[dict], list[int]]:
        """Per step: the float64 gradients at the reference's weights, and the near ties."""
        grads, ties = [], []
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            for k, batch in enumerate(self.batches):  # one step at a time: its own ties
                mode = Float64(tie_rtol=UNIT[self.precision] * 8)
                with mode:
                    run = self.again([batch], lambda gs, k=k: Replay(gs, self.weights[k:]),
                                     torch.float64)
                grads.append(run.grads[0])
                ties.append(mode.near_ties)
        finally:
            torch.set_default_dtype(default)
        return grads, ties

    @property
    def exact(self) -> list[dict]:
        return self._exact[0]

    @property
    def near_ties(self) -> list[int]:
        return self._exact[1]

    @functools.cached_property
    def variants(self) -> list:
        """The same training with the rows in ``PERMUTATIONS``' orders (``Run``s)."""
        return [self.again(permuted(self.batches, how, self.micro_batch_size), None, None)
                for how in PERMUTATIONS]

    @functools.cached_property
    def blocks(self) -> list[dict[str, float]]:
        """``block_norms`` of the exact gradients, step by step."""
        return [block_norms(grads) for grads in self.exact]

    @property
    def others(self) -> list[list[dict]]:
        """Each variant's gradients, step by step."""
        return [run.grads for run in self.variants]


def block_norms(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: the norm of all gradients in its block (the parameters under its
    module's parent: ``a.b.c.weight`` -> ``a.``; a top-level module's: the whole model)."""
    def block(name: str) -> str:
        return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""

    sums: dict[str, float] = {}
    for name, g in grads.items():
        sums[block(name)] = sums.get(block(name), 0.0) + float(g.double().norm()) ** 2
    return {name: math.sqrt(sums[block(name)]) for name in grads}


def distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm())


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when equal; inf when want is zero and got is
    not, or when either is not finite)."""
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    diff, norm = distance(got, want), float(want.double().norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


@dataclass(frozen=True)
class Allowance:
    """How far from the exact gradient ``exact`` a gradient of one parameter may land at one
    step (``allowed``), and why: the farthest correct run (``spread``), the ``floor``."""

    exact: torch.Tensor
    spread: float
    floor: float
    allowed: float
    reference: float
    """The reference's own distance."""


def allowance(step: int, name: str, ref: torch.Tensor, judge: Judge) -> Allowance:
    """The rule for parameter ``name`` at ``step`` (``ref``: the reference's gradient)."""
    exact = judge.exact[step][name]
    tokens = judge.batches[step][0].numel()
    floor = FLOOR_UNITS * UNIT[judge.precision] * math.sqrt(tokens) * judge.blocks[step][name]
    runs = [ref, *(o[step][name] for o in judge.others)]
    spread = max(d for d in (distance(r, exact) for r in runs) if math.isfinite(d))
    norm = float(exact.double().norm())
    allowed = min(max(SPREAD_FACTOR * spread, floor), max(CEILING[judge.precision] * norm, floor))
    return Allowance(exact, spread, floor, allowed, distance(ref, exact))


def step_failures(step: int, got: dict, want: dict, judge: Judge) -> list[str]:
    """The rule at one step: for each parameter of ``want`` (the reference's gradients),
    ``got``'s gradient passes or a line says why not."""
    out = []
    for name, ref in want.items():
        g = got[name]
        if not torch.isfinite(g).all():
            out.append(f"step {step}: gradient of {name} is not finite")
            continue
        if relative(g, ref) <= GRAD_RTOL:
            continue
        a = allowance(step, name, ref, judge)
        mine = distance(g, a.exact)
        if mine > a.allowed:
            norm, ties = max(float(a.exact.double().norm()), 1e-300), judge.near_ties[step]
            out.append(
                f"step {step}: gradient of {name} off by {relative(g, ref):.2e} of its norm "
                f"({float(ref.norm()):.2e}); from float64 {mine / norm:.2e}, the farthest "
                f"correct run {a.spread / norm:.2e} (the reference {a.reference / norm:.2e}), "
                f"the floor {a.floor / norm:.2e}, allowed {a.allowed / norm:.2e}"
                + (f"; {ties} top-k choices within rounding of a tie at these weights"
                   if ties else "")
            )
    return out
