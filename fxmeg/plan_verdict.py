"""Does a plan fit a device, and if not, what would make it fit (``fxmeg plan
--device-memory``). Every remedy is predicted from the plan's own numbers, per stage:

  full recompute     the blocks keep only their inputs per micro-batch (the plan's
                     ``recompute_inputs``), and backward holds one block's own tensors
                     while it runs it again (the largest block's, once)
  distributed        the optimizer state divided by dp x cp (Megatron's distributed
  optimizer          optimizer, ZeRO-1)
  zero=2 / zero=3    besides, the gradient buffers (zero=2) and the parameters (zero=3)
                     divided by dp x cp; the buckets being reduced or gathered stay whole
                     (neglected here)
  pp x 2             each stage holds half the blocks: weights, gradients, optimizer
                     state and each micro-batch's activations halve, while 1F1B keeps up
                     to twice as many micro-batches in flight on the first stages
  micro-batch 1      each micro-batch's activations scale with its size; the number in
                     flight is the schedule's, at most pp, so it does not grow

Each is applied alone to the stage's total, so the savings do not add up exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxmeg.errors import ConfigError

if TYPE_CHECKING:
    from fxmeg.layout_plan import Plan, StagePlan

GiB = 2**30
DEVICES = {  # usable memory as nvidia-smi reports it (MiB)
    "h100": 81559 * 2**20,
    "h200": 143771 * 2**20,
    "a100-40gb": 40960 * 2**20,
    "a100-80gb": 81920 * 2**20,
}
"""--device-memory presets: an accelerator's memory as nvidia-smi reports it."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def device_bytes(text: str) -> int:
    """Bytes of '80GB' (10^9), '80GiB' / '79.6GiB' (2^30), or a preset of ``DEVICES``."""
    key = text.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?", key)
    if not match:
        raise ConfigError(f"--device-memory {text!r} is neither a size (80GB, 80GiB, 79.6GiB) nor a device "
                          f"({', '.join(DEVICES)})")
    return int(float(match[1]) * _UNITS[match[2] or ""])


@dataclass(frozen=True)
class Remedy:
    """One change and the stage's total it predicts (bytes)."""

    change: str
    saves: int
    total: int
    fits: bool


def remedies(plan: Plan, stage: StagePlan, device: int) -> list[Remedy]:
    """The changes that lower ``stage``'s total, most saving first."""
    cfg, par = plan.config, plan.config.parallel
    ranks, out = par.dp_cp, []

    def add(change: str, total: int) -> None:
        if total < stage.total:
            out.append(Remedy(change, stage.total - total, total, total <= device))

    if cfg.recompute != "full" and stage.recompute_inputs:
        acts = stage.recompute_inputs * stage.microbatches_in_flight + stage.largest_block
        add("--recompute full", stage.total - stage.activations - stage.recompute_working_set + acts)
    if ranks > 1 and not cfg.distributed_optimizer and cfg.zero_stage < 2:
        add(f"--distributed-optimizer (optimizer state / {ranks})",
            stage.total - stage.optimizer_state + stage.optimizer_state // ranks)
    if ranks > 1 and cfg.zero_stage < 2:
        optimizer = stage.optimizer_state if cfg.distributed_optimizer else stage.optimizer_state // ranks
        saved = stage.optimizer_state - optimizer + stage.gradient_buffers - stage.gradient_buffers // ranks
        add(f"--zero-stage 2 (optimizer state and gradients / {ranks})", stage.total - saved)
        add(f"--zero-stage 3 (optimizer state, gradients and parameters / {ranks})",
            stage.total - saved - stage.parameters + stage.parameters // ranks)
    blocks = len(plan.blocks) if plan.blocks else 0
    if blocks >= 2 * par.pp * par.vpp:
        weights = stage.parameters + stage.gradient_buffers + stage.optimizer_state
        flight = min(2 * stage.microbatches_in_flight, cfg.num_microbatches)
        add(f"--pp {2 * par.pp} (half the blocks per stage)",
            stage.total - weights // 2 - stage.activations + stage.activations_per_microbatch // 2 * flight)
    if cfg.micro_batch_size > 1:
        add(f"--micro-batch-size 1 (activations / {cfg.micro_batch_size})",
            stage.total - stage.activations + stage.activations // cfg.micro_batch_size)
    return sorted(out, key=lambda r: -r.saves)


def verdict(plan: Plan, device: int) -> list[dict]:
    """Per stage: free bytes or the excess, and when it exceeds, the remedies."""
    rows = []
    for s in plan.stages:
        row = {"stage": s.stage, "total": s.total, "fits": s.total <= device, "free": device - s.total}
        if s.total > device:
            row["remedies"] = [r.__dict__ for r in remedies(plan, s, device)]
        rows.append(row)
    return rows


def verdict_lines(plan: Plan, device: int) -> list[str]:
    """The verdict as text: one line per stage, then the remedies of the stages that exceed."""
    lines = [f"  device memory {device / GiB:,.1f} GiB per rank:"]
    for row in verdict(plan, device):
        state = (f"fits ({row['free'] / GiB:,.2f} GiB free)" if row["fits"]
                 else f"exceeds by {-row['free'] / GiB:,.2f} GiB")
        lines.append(f"    stage {row['stage']}: {row['total'] / GiB:,.2f} GiB, {state}")
        for r in row.get("remedies", []):
            mark = "fits" if r["fits"] else "still exceeds"
            lines.append(f"      {r['change']}: saves {r['saves'] / GiB:,.2f} GiB -> "
                         f"{r['total'] / GiB:,.2f} GiB, {mark}")
        if "remedies" in row and not row["remedies"]:
            lines.append("      no remedy predicted here: add tensor parallelism or ranks")
    return lines
