"""The layout search: every layout fxmeg accepts for a model on a cluster, judged by the
same checks ``parallelize`` runs, those that fit ranked by predicted step time.

``search(model, example, cluster=..., global_batch_size=...)`` enumerates tp, sp, cp, ep,
pp, vpp, schedule, dp, ZeRO, recompute and micro-batch size (``candidates``). A layout is
legal when ``EngineConfig`` accepts it on the cluster's ranks, ``check_model`` accepts it
for the model, and the passes accept its intra-layer part on the model's twin (the
profile's transform: fxmeg/planner/profile.py); one copy of the rules, the ones that run
before training. Each legal layout is estimated (fxmeg/planner/estimate.py); those whose
per-rank peak exceeds the device's memory are dropped; the rest are ranked. A zero-bubble
layout over memory is tried again deferring fewer weight gradients (``Searcher.capped``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

from fxmeg.config import EngineConfig, Example
from fxmeg.errors import ConfigError, FxmegError
from fxmeg.frontend.model_checks import check_model
from fxmeg.planner.calibrate import time_keys
from fxmeg.planner.cluster import Cluster
from fxmeg.planner.estimate import Composer, Estimate, collective
from fxmeg.planner.profile import Key, Profile, Twin, check_split, deeper, profile, twin
from fxmeg.schedule_registry import SPECS, batch_refusal, layout_refusal, resolve

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8)
"""The micro-batch sizes searched (those dividing the global batch per replica)."""
VPP_MAX = 4
"""The most virtual chunks per pipeline rank searched (more only adds pipeline messages)."""


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the space, in ``parallelize``'s flat names (``options``)."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1
    schedule: str = "none"
    dp: int = 1
    zero: int = 0
    recompute: str = "none"
    micro_batch_size: int = 1
    overlap_ep: bool = False
    """``overlap_moe_expert_parallel_comm`` (ep > 1 under dualpipev)."""
    pending_w: int | None = None
    """``max_pending_w`` (zero-bubble schedules): never a candidate's; ``Searcher.capped``
    sets it on a layout over memory, ``Layout.of`` reads it from a config."""

    @property
    def key(self) -> Key:
        return Key(self.tp, self.sp, self.cp, self.ep, None, self.recompute)

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def options(self) -> dict:
        """The layout as ``parallelize`` keywords and `fxmeg train` config keys."""
        return {"tp": self.tp, "sequence_parallel": self.sp, "cp": self.cp, "ep": self.ep,
                "pp": self.pp, "vpp": self.vpp, "schedule": self.schedule, "dp": self.dp,
                "zero": self.zero, "recompute": self.recompute,
                "micro_batch_size": self.micro_batch_size,
                "overlap_moe_expert_parallel_comm": self.overlap_ep,
                "max_pending_w": self.pending_w}

    @classmethod
    def of(cls, config: EngineConfig) -> Layout:
        par, dpc = config.parallel, config.data_parallel
        return cls(par.tp, par.sequence_parallel, par.cp, par.ep, par.pp, par.vpp,
                   par.resolved_schedule, par.dp or 1, dpc.zero_stage,
                   config.recomputation.recompute, config.micro_batch_size,
                   config.moe.overlap_moe_expert_parallel_comm, par.max_pending_w)

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")]
        parts += [f"{n}{v}" for n, v in (("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "")
                         + f" {self.schedule}")
        parts += ["ep-overlap"] if self.overlap_ep else []
        parts += [f"pending-w{self.pending_w}"] if self.pending_w is not None else []
        parts += [f"dp{self.dp}", f"zero{self.zero}", f"rc:{self.recompute}",
                  f"mbs{self.micro_batch_size}"]
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CP_MIN_TOKENS = 128
"""The fewest tokens of a sequence a context-parallel rank is searched with (cp <= seq /
128): below, attention's all-gather costs more than the split saves."""


def candidates(world: int, blocks: int, global_batch_size: int, *, experts: bool,
               ranks_per_node: int, tokens: int | None = None) -> Iterator[Layout]:
    """Every combination of the searched values on ``world`` ranks, legal or not: tp up
    to a node (tensor parallelism across nodes is never faster), cp up to ``tokens`` /
    ``CP_MIN_TOKENS``, pp up to the blocks,
    vpp up to ``VPP_MAX``, each schedule, dp the rest, ep dividing dp x cp when the model
    has experts, each ZeRO stage where dp x cp > 1, each recompute mode, each micro-batch
    size in ``MICRO_BATCH_SIZES`` that divides the batch per replica, and under dualpipev
    at ep > 1 the expert all-to-alls overlapped or not."""
    for tp in _divisors(world):
        if tp > ranks_per_node:
            continue
        for sp in (False, True) if tp > 1 else (False,):
            for cp in _divisors(world // tp):
                if cp > 1 and tokens is not None and cp * CP_MIN_TOKENS > tokens:
                    continue
                for pp in _divisors(world // (tp * cp)):
                    if pp > max(blocks, 1):
                        continue
                    dp = world // (tp * cp * pp)
                    for vpp in range(1, VPP_MAX + 1) if pp > 1 else (1,):
                        if pp * vpp > max(blocks, 1):
                            continue
                        # at pp = 1 every schedule runs the same loop: 'none' stands for them
                        for schedule in SPECS if pp > 1 else ("none",):
                            for ep in _divisors(dp * cp) if experts else (1,):
                                for zero in range(4) if dp * cp > 1 else (0,):
                                    for rc in RECOMPUTE:
                                        for mbs in MICRO_BATCH_SIZES:
                                            if global_batch_size % (mbs * dp):
                                                continue
                                            for lanes in _lanes(schedule, ep):
                                                yield Layout(tp, sp, cp, ep, pp, vpp, schedule,
                                                             dp, zero, rc, mbs, lanes)


def _lanes(schedule: str, ep: int) -> tuple[bool, ...]:
    """The values of ``overlap_moe_expert_parallel_comm`` searched."""
    return (False, True) if schedule == "dualpipev" and ep > 1 else (False,)


@dataclass
class Ranked:
    layout: Layout
    estimate: Estimate

    def to_dict(self) -> dict:
        e = self.estimate
        return {"layout": self.layout.options(), "name": str(self.layout), "step_s": e.step,
                "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "peak_bytes": e.peak,
                "breakdown_s": e.breakdown, "split_points": e.split_points,
                "stages": [dataclasses.asdict(s) for s in e.stages]}


@dataclass
class Result:
    """What a search found: the fitting layouts fastest first, and what it dropped."""

    cluster: Cluster
    cap: int
    """Bytes per rank the search held the layouts to (``memory``, else the device's)."""
    ranked: list[Ranked]
    too_big: list[Ranked]
    """Legal layouts over ``cap`` even if the memory model over-counts (``memory_verdict``),
    smallest peak first."""
    tight: list[Ranked]
    """Legal layouts the memory model cannot call either way (``memory_verdict``: within
    the device's ``memory_error`` of the cap), fastest first: they may not fit."""
    refused: Counter
    """Why illegal layouts were refused: the first words of each reason, counted."""
    legal: int
    seconds: float
    mine: Ranked | None = None
    """The user's own layout, estimated (``search(layout=...)``)."""

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    def rank_of(self, layout: Layout) -> int | None:
        """1-based rank of ``layout`` among the fitting ones, or None."""
        return next((i + 1 for i, r in enumerate(self.ranked) if r.layout == layout), None)


def memory_verdict(peak: int, cap: int, error: float) -> str:
    """'fits' when a predicted ``peak`` is under ``cap`` even if the model under-counts by
    ``error`` (a share of the prediction), 'over' when it is over even if the model
    over-counts by as much, else 'tight': the model cannot tell, so a search neither ranks
    the layout nor drops it silently (docs/planner.md, "Fits, tight, over")."""
    if peak * (1 + error) <= cap:
        return "fits"
    return "over" if peak * (1 - error) > cap else "tight"


def schedule_refusal(layout: Layout, global_batch_size: int) -> str | None:
    """The schedule registry's refusal of ``layout`` (``layout_refusal``, ``batch_refusal``:
    the functions ``ParallelConfig`` and ``EngineConfig`` call), asked first because it
    is cheap and refuses most combinations."""
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    return layout_refusal(layout.schedule, pp=layout.pp, vpp=layout.vpp) or batch_refusal(
        resolve(layout.schedule, pp=layout.pp, vpp=layout.vpp), pp=layout.pp, m=m)


def refusal_reason(error: Exception) -> str:
    """A short reason for counting: the message up to its first colon or 60 characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head = text.split(":")[0]
    return head[:60]


class Searcher:
    """The model's twin, its profiles and the composer, shared by every layout."""

    def __init__(self, model: nn.Module, example: Example, *, cluster: Cluster,
                 global_batch_size: int, precision: str = "bf16", loss_fn=None,
                 tokens_per_sample: int | None = None, options: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.example, self.cluster = model, example, cluster
        self.global_batch_size, self.precision = global_batch_size, precision
        self.loss_fn, self.progress = loss_fn, progress or (lambda line: None)
        self.options = dict(options or {})
        self.progress("building the model's twin (one block of each kind)")
        self.twin: Twin = twin(model)
        self.base = EngineConfig.from_flat(micro_batch_size=1, global_batch_size=1,
                                           precision=precision, **self.options)
        tokens = tokens_per_sample or _tokens(example)
        self.failed: dict[Key, Exception] = {}
        self.checked: dict[tuple, ConfigError | None] = {}
        base = self.profile(Key())
        if base is None:
            raise self.failed[Key()]
        self.composer = Composer(cluster, precision, self.twin.kinds, self.twin.blocks, base,
                                 tokens, self.twin.own)
        self.tokens = tokens
        self.experts = any(p.expert_elements for p in base.blocks)

    def profile(self, key: Key) -> Profile | None:
        if key in self.failed:
            return None
        if key not in self.twin.profiles:
            self.progress(f"profiling the twin at {key} ({len(self.twin.profiles) + 1} so far)")
        try:
            return profile(self.twin, self.example, key, self.base, self.loss_fn)
        except FxmegError as e:
            self.failed[key] = e
            return None

    def calibrate(self, keys: list[Key]) -> None:
        """On a CPU: fit the time model to the twin's steps measured on the cluster's ranks
        under each of ``keys`` (fxmeg/planner/calibrate.py): the roofline's slowdown and
        per-op cost from the first key's (no tp, cp, ep), each key's factors and step
        overhead from its own (``Composer.fit_key``), and the rank's memory reserve."""
        base = Key()
        keys = [base, *(k for k in dict.fromkeys(keys) if k != base)]
        timings = time_keys(self.twin.model, deeper(self.twin), self.example, keys,
                            self.cluster.ranks,
                            options={"precision": self.precision, **self.options},
                            progress=self.progress)
        if timings is None:
            return
        twin = Composer(self.cluster, self.precision, self.twin.own, (), self.profile(base),
                        self.tokens)
        first = timings[base]
        (r1, n), (r2, _) = (twin.roofline(self.profile(base), s) for s in (1, 2))
        one, two = first.microbatch
        slow = max((two - one) / max(r2 - r1, 1e-12), 1.0)
        per_op = max(one - slow * r1, 0.0) / max(n, 1)
        twin.calibrate(slow, per_op, 0)
        run = twin.estimate(self.profile(base), self._twin_config(base))
        self.composer.calibrate(slow, per_op, max(first.peak - run.peak, 0))
        if first.sharded is not None:  # zero=2's reduction, measured against the model's
            dp = self.cluster.ranks
            modelled = collective("reduce_scatter", run.stages[0].gradients, dp,
                                  self.cluster.link(1, dp))
            self.composer.sharded = max(first.sharded, 0.0) / modelled if modelled else 1.0
        for key in keys:
            prof = self.profile(key)
            est = twin.estimate(prof, self._twin_config(key))
            besides = est.breakdown["comm_dp"] + est.breakdown["optimizer"]
            self.composer.fit_key(prof, timings[key], timings[key].fixed - besides)

    def _twin_config(self, key: Key) -> EngineConfig:
        """The twin's timed run under ``key`` (calibrate.py): one micro-batch of one sample
        per replica, the cluster's ranks filled with data parallelism."""
        world = self.cluster.ranks
        dp = world // (key.tp * key.cp)
        return EngineConfig.from_flat(
            micro_batch_size=1, global_batch_size=dp, precision=self.precision, dp=dp,
            **self.options, **key.options()).resolve(world)

    def config(self, layout: Layout) -> EngineConfig:
        """The layout as ``parallelize`` would hold it (every config rule checked), and
        the model's own check of it (``check_model``)."""
        options = layout.options()
        mbs = options.pop("micro_batch_size")
        config = EngineConfig.from_flat(
            micro_batch_size=mbs, global_batch_size=self.global_batch_size,
            precision=self.precision, **self.options, **options)
        config = config.resolve(layout.ranks)
        # check_model reads tp (and tp_plan, shared), ep and the chunk count: once each
        seen = (layout.tp, layout.ep, layout.pp * layout.vpp)
        if seen not in self.checked:
            try:
                check_model(self.model, config)
                self.checked[seen] = None
            except ConfigError as e:
                self.checked[seen] = e
        if self.checked[seen] is not None:
            raise self.checked[seen]
        return config

    def estimate(self, layout: Layout, memory: int | None = None) -> Estimate:
        """The prediction of one legal layout (over ``memory``: its memory only); raises
        ConfigError (and the passes' errors) for an illegal one."""
        config = self.config(layout)
        prof = self.profile(layout.key)
        if prof is None:
            raise self.failed[layout.key]
        split = None
        if config.parallel.splits_backward:
            split = check_split(self.twin, self.example, layout.key, self.base, self.loss_fn)
        return self.composer.estimate(prof, config, memory, split)

    def capped(self, layout: Layout, memory: int) -> tuple[Layout, Estimate] | None:
        """A zero-bubble ``layout`` that does not fit ``memory``, with the most pending Ws
        (``max_pending_w``, bisected in [0, 2 pp): fewer hold no more) at which it fits
        (``memory_verdict``), and its estimate; None when none fits, or the schedule defers
        no W."""
        name = resolve(layout.schedule, pp=layout.pp, vpp=layout.vpp)
        if layout.pending_w is not None or not SPECS[name].splits_backward:
            return None

        def fits(k: int) -> bool:  # memory only (a cap of 0 bytes): no time simulated
            peak = self.estimate(dataclasses.replace(layout, pending_w=k), 0).peak
            return memory_verdict(peak, memory, self.cluster.device.memory_error) == "fits"

        if not fits(0):
            return None
        best, high = 0, 2 * layout.pp
        while best + 1 < high:  # fits at best; not at high
            mid = (best + high) // 2
            best, high = (mid, high) if fits(mid) else (best, mid)
        found = dataclasses.replace(layout, pending_w=best)
        return found, self.estimate(found, memory)


def search(model: nn.Module, example: Example, *, cluster: Cluster, global_batch_size: int,
           precision: str = "bf16", loss_fn=None, layout: Layout | None = None,
           memory: int | None = None, keep: int | None = None, options: dict | None = None,
           progress: Callable[[str], None] | None = None,
           space: Callable[[Layout], bool] | None = None, timed: bool = True) -> Result:
    """Every layout of ``model`` on ``cluster`` at ``global_batch_size`` samples per step
    (``example``: one micro-batch, its sequence length the one planned), ranked: those
    that fit with the memory model's error to spare (``memory_verdict``; the tight ones
    apart). ``memory`` (default the device's) is the per-rank cap; ``layout`` is the
    user's own, estimated beside; ``space`` keeps only the candidates it accepts;
    ``options`` are further flat names every layout shares (``bucket_size``,
    ``overlap_param_gather``, ...). On a CPU cluster the twin is timed first
    (``Searcher.calibrate``); ``timed=False`` keeps the cluster's own rates and reserve
    instead (memory alone is then meaningful)."""
    start = time.perf_counter()
    say = progress or (lambda line: None)
    s = Searcher(model, example, cluster=cluster, global_batch_size=global_batch_size,
                 precision=precision, loss_fn=loss_fn, options=options, progress=progress)
    cap = cluster.device.memory if memory is None else memory
    ranked, too_big, tight, refused, legal = [], [], [], Counter(), 0
    sorted_into = {"fits": ranked, "over": too_big, "tight": tight}
    pool = [c for c in candidates(cluster.ranks, len(s.twin.kinds), global_batch_size,
                                  experts=s.experts, ranks_per_node=cluster.ranks_per_node,
                                  tokens=s.composer.tokens)
            if space is None or space(c)]
    say(f"{len(pool)} candidate layouts on {cluster.ranks} ranks")
    if timed and not cluster.overlap:  # a CPU: the twin timed under each intra-layer layout
        s.calibrate(_keys(s, pool + ([layout] if layout else []), global_batch_size))
    last = time.perf_counter()
    for i, cand in enumerate(pool):
        try:
            quick = schedule_refusal(cand, global_batch_size)
            if quick:
                raise ConfigError(quick)
            est = s.estimate(cand, cap)
        except (ConfigError, FxmegError) as e:
            reason = refusal_reason(e)
            refused[reason] += 1
            continue
        legal += 1
        verdict = memory_verdict(est.peak, cap, cluster.device.memory_error)
        fitting = s.capped(cand, cap) if verdict != "fits" else None
        if fitting is not None:  # fewer Ws deferred: a longer bubble, but it fits
            cand, est, verdict = *fitting, "fits"
        sorted_into[verdict].append(Ranked(cand, est))
        if time.perf_counter() - last > 2.0:
            last = time.perf_counter()
            say(f"{i + 1}/{len(pool)} layouts: {legal} legal, {len(ranked)} fit")
    ranked.sort(key=lambda r: r.estimate.step)
    tight.sort(key=lambda r: r.estimate.step)
    too_big.sort(key=lambda r: r.estimate.peak)
    mine = None
    if layout is not None:
        mine = Ranked(layout, s.estimate(layout))
    result = Result(cluster, cap, ranked[:keep] if keep else ranked, too_big, tight, refused,
                    legal, time.perf_counter() - start, mine)
    say(f"{legal} legal layouts, {len(ranked)} fit, {len(tight)} tight, in "
        f"{result.seconds:.1f} s")
    return result


def _keys(s: Searcher, pool: list[Layout], global_batch_size: int) -> list[Key]:
    """The intra-layer layouts of the candidates that pass the schedule registry, the
    config's checks and the twin's passes, in order."""
    keys = []
    for cand in pool:
        if cand.key in keys or schedule_refusal(cand, global_batch_size):
            continue
        try:
            s.config(cand)
        except ConfigError:
            continue
        if s.profile(cand.key) is not None:
            keys.append(cand.key)
    return keys


def _tokens(example: Example) -> int:
    """Tokens in one sample: the example's second dimension (its sequence)."""
    from fxmeg.config import example_tensors

    first = example_tensors(example)[0]
    return int(first.shape[1]) if first.dim() > 1 else 1
