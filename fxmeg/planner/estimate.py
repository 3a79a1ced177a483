"""One layout's predicted step time and per-rank peak memory, composed from a profile's
parts (fxmeg/planner/profile.py) on a cluster (fxmeg/planner/cluster.py).

The time model, written out in docs/planner.md:
  compute   per op, max(FLOPs / the device's matmul rate, bytes / its memory bandwidth)
            plus one launch; backward twice forward's, plus forward again of the ops in
            recompute regions
  tp, cp, ep  each collective the passes inserted, by its bytes, on the link its group
            crosses (ring formulas); exposed, but ep's under DualPipeV's second lane
            (overlap_moe_expert_parallel_comm, fxmeg/planner/lanes.py)
  pp        each boundary's activation over the pipeline link, as the simulator's message
            latency; the bubble is the simulator's (the schedule's own lowering)
  dp        the stage's gradients reduced (all-reduce at zero 0, reduce-scatter and the
            parameters' all-gather at 1-2, and at 3 the parameters gathered per micro-batch),
            overlapped with the last micro-batch's backward where the cluster overlaps
  optimizer one pass of Adam over the rank's shard of masters, moments and gradients
The memory model is ``fxmeg plan``'s (docs/architecture.md §8.3) summed over the parts
each stage holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fxmeg.config import EngineConfig
from fxmeg.diagnostics.layout_plan import ADAM_STATES, B_COST, F_COST
from fxmeg.diagnostics.split_activations import RECEIVED, SENT_GRADIENT
from fxmeg.passes.partition import _balanced_starts, _rank_balanced
from fxmeg.planner import lanes
from fxmeg.planner.calibrate import Timing
from fxmeg.planner.cluster import Cluster, Link
from fxmeg.planner.profile import Comm, Key, Part, Profile
from fxmeg.runtime.data_parallel.zero import IN_FLIGHT
from fxmeg.runtime.pipeline import schedules, simulator
from fxmeg.runtime.pipeline.schedules import Kind
from fxmeg.schedule_registry import SPECS, placement


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline rank: its peak memory by what holds it (bytes)."""

    stage: int
    blocks: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buckets: int
    transient: int
    """Backward's working set beyond the saved tensors: the largest value's gradient and
    the one made from it (not in ``fxmeg plan``)."""
    reserved: int
    """What the runtime holds besides the model's tensors (``Composer.reserved``)."""
    total: int


@dataclass(frozen=True)
class Estimate:
    """A layout's prediction; seconds per step and where they go."""

    step: float
    breakdown: dict[str, float]
    """'compute', 'bubble', 'optimizer', 'comm_<axis>' (exposed) and 'overhead' (a measured
    step's cost besides them, on a CPU: ``Composer.fit_key``), seconds per step."""
    stages: tuple[StageEstimate, ...]
    split_points: tuple[str, ...] | None
    tokens_per_s: float
    mfu: float
    model_flops: float
    """Model FLOPs of one step (3 x forward, no recompute), all ranks."""

    @property
    def peak(self) -> int:
        return max(s.total for s in self.stages)


def simulated_microbatches(m: int, pp: int, name: str, *, held: bool = False) -> int:
    """The micro-batches the simulator runs for a step of ``m``: at most pp (for the
    micro-batches in flight, ``held``: 2 pp), or the least the schedule takes (DualPipeV: 2
    pp). Past them the steady state repeats one micro-batch's work per micro-batch (1F1B:
    (m + pp - 1) (F + B) exactly), and the in-flight peak is reached."""
    least = pp * max(1, SPECS[name].m_min_per_pp, 2 if held else 1)
    return min(m, least)


def collective(kind: str, nbytes: float, size: int, link: Link) -> float:
    """Seconds of one ring collective of ``nbytes`` (the whole tensor; all_to_all: what
    one rank sends) over ``size`` ranks on ``link``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    share = (size - 1) / size
    steps = {"all_reduce": 2 * (size - 1), "all_to_all": size - 1}.get(kind, size - 1)
    volume = {"all_reduce": 2 * share * nbytes, "all_to_all": share * nbytes}.get(
        kind, share * nbytes)
    return volume / link.bandwidth + steps * link.latency


def op_seconds(ops, rate: float, bandwidth: float, overhead: float, scale: float) -> float:
    """Roofline seconds of ops (FLOPs, bytes) at ``scale`` samples, plus one launch each."""
    return sum(max(f * scale / rate, b * scale / bandwidth) for f, b in ops) + len(ops) * overhead


class Composer:
    """Estimates layouts from profiles on one cluster; caches the per-part seconds and the
    cuts, which many layouts share."""

    def __init__(self, cluster: Cluster, precision: str, kinds: tuple[int, ...],
                 blocks: tuple[str, ...], base: Profile, tokens_per_sample: int,
                 own: tuple[int, ...] | None = None) -> None:
        self.cluster, self.precision, self.tokens = cluster, precision, tokens_per_sample
        self.kinds, self.blocks = kinds, blocks
        self.own = kinds if own is None else own  # the twin's blocks (``fit_key``)
        dev = cluster.device
        self.rate, self.bandwidth, self.overhead = dev.rate(precision), dev.memory_bandwidth, \
            dev.op_overhead
        # whole-model forward FLOPs of one sample (tp = cp = 1)
        self.sample_flops = base.pre.flops + base.post.flops + sum(
            base.blocks[k].flops for k in kinds)
        self.calibration: tuple[float, float] | None = None
        self.reserved = dev.reserved
        self.measured: dict[Key, tuple[Timing, tuple[float, float], float]] = {}
        """Per key: its twin's timing, (factor on a block's seconds, on the rest's), and the
        seconds a step costs besides (``fit_key``)."""
        self.sharded = 1.0
        """The measured over the modelled reduction of sharded gradients (zero >= 2, every
        micro-batch's: ``Searcher.calibrate``)."""
        self._cuts: dict = {}
        self._seconds: dict = {}
        self._lowered: dict = {}
        self._sims: dict = {}

    def calibrate(self, slow: float, per_op: float, reserved: int) -> None:
        """Ops run ``slow`` times their roofline and cost ``per_op`` seconds more each, and
        a rank holds ``reserved`` bytes besides the model's tensors
        (fxmeg/planner/calibrate.py: measured on the twin, on a CPU)."""
        self.calibration, self.reserved = (slow, per_op), reserved
        self.rate, self.bandwidth, self.overhead = (self.rate / slow, self.bandwidth / slow,
                                                    per_op)
        self._seconds.clear()

    def fit_key(self, profile: Profile, timing: Timing, extra: float) -> None:
        """Layouts of ``profile``'s key take the twin's measured ``timing``: a block's
        seconds and the rest's (embedding, head, loss) each scaled to what the twin and
        the twin with each block twice took, a micro-batch of any size to the twin's (linear
        in its samples), and ``extra`` seconds a step (what the twin's step took besides
        its micro-batches, the modelled optimizer and data-parallel reduction)."""
        blocks, rest = self._twin_seconds(profile, 1)
        split = timing.split
        if split is None or blocks <= 0 or rest <= 0:
            ratio = timing.microbatch[0] / (blocks + rest)
            factors = (ratio, ratio)
        else:
            factors = (split[0] / blocks, split[1] / rest)
        self.measured[profile.key] = (timing, factors, extra)

    def _scale(self, profile: Profile, mbs: int) -> tuple[float, float, float]:
        """(factor on a block's seconds, on the rest's, seconds added to a step) for
        ``profile``'s key at micro-batches of ``mbs`` (``fit_key``; unmeasured: 1, 1, 0)."""
        if profile.key not in self.measured:
            return 1.0, 1.0, 0.0
        timing, (on_blocks, on_rest), extra = self.measured[profile.key]
        blocks, rest = self._twin_seconds(profile, mbs)
        size = timing.per_microbatch(mbs) / (on_blocks * blocks + on_rest * rest)
        return on_blocks * size, on_rest * size, extra

    def _twin_seconds(self, profile: Profile, mbs: int) -> tuple[float, float]:
        """The time model's (blocks, rest) of one micro-batch's forward and backward of the
        twin (``own``) under ``profile``'s key, communication included."""
        k = profile.key
        links = self._links(k.tp, k.cp, k.ep)

        def total(part: Part) -> float:
            f, b, comm = self._part_seconds(part, mbs, k.tp, k.cp, k.ep, links)
            return f + b + sum(x + y for x, y in comm.values())
        return (sum(total(profile.blocks[kind]) for kind in self.own),
                total(profile.pre) + total(profile.post))

    def microbatch_seconds(self, profile: Profile, mbs: int) -> float:
        """One micro-batch's forward and backward of the whole model at pp = 1 under
        ``profile``'s key, communication included, as ``fit_key`` scales it."""
        k = profile.key
        f, b, _, _ = self._chunk_seconds([self.parts(profile)], mbs, k.tp, k.cp, k.ep,
                                         self._scale(profile, mbs))
        return f[0] + b[0]

    def roofline(self, profile: Profile, mbs: int) -> tuple[float, int]:
        """(seconds of a micro-batch's forward and backward ops at the roofline, ops run)
        at pp = 1: what ``calibrate`` fits the slowdown and the per-op cost to."""
        parts = self.parts(profile)
        fwd = [op for p in parts for op in p.ops]
        again = [op for p in parts for op in p.recomputed]
        seconds = 3 * op_seconds(fwd, self.rate, self.bandwidth, 0.0, mbs) + op_seconds(
            again, self.rate, self.bandwidth, 0.0, mbs)
        return seconds, 3 * len(fwd) + len(again)

    # ---- parts

    def parts(self, profile: Profile) -> list[Part]:
        """The real model's parts in order: before, each block (its kind's), after."""
        return [profile.pre, *(profile.blocks[k] for k in self.kinds), profile.post]

    def cut(self, profile: Profile, par) -> tuple[int, ...]:
        """Chunk starts over the real blocks (indices into ``blocks``): the partition's
        balanced cut at block boundaries (``fxmeg.passes.partition``), by the same costs."""
        k = par.num_chunks
        key = (profile.key, k, par.placement if par.spec.placement == "v" else None)
        if key not in self._cuts:
            costs = [profile.blocks[kind].cost for kind in self.kinds]
            costs[0] += profile.pre.cost
            costs[-1] += profile.post.cost
            starts = _balanced_starts(costs, k)
            if key[2] is not None and len(set(par.placement)) < k:
                starts = _rank_balanced(starts, costs, par.placement)
            self._cuts[key] = starts
        return self._cuts[key]

    def chunks(self, profile: Profile, par) -> list[list[Part]]:
        """``profile``'s parts in each chunk."""
        parts = self.parts(profile)
        if par.num_chunks == 1:
            return [parts]
        starts = self.cut(profile, par)
        ends = (*starts[1:], len(self.kinds))
        out = []
        for c, (a, b) in enumerate(zip(starts, ends)):
            mine = parts[1 + a: 1 + b]
            if c == 0:
                mine = [profile.pre, *mine]
            if c == len(starts) - 1:
                mine = [*mine, profile.post]
            out.append(mine)
        return out

    # ---- time

    def _part_seconds(self, part: Part, mbs: int, tp: int, cp: int, ep: int, links) -> tuple:
        """(forward, backward, {group: (forward, backward) comm seconds}) of one micro-batch
        (cached: the parts live as long as their profile, held by the search)."""
        key = (id(part), mbs, tp, cp, ep, links)
        if key not in self._seconds:
            self._seconds[key] = self._part_seconds_of(part, mbs, tp, cp, ep, links)
        return self._seconds[key]

    def _part_seconds_of(self, part: Part, mbs: int, tp: int, cp: int, ep: int,
                         links) -> tuple:
        links = dict(links)
        fwd = op_seconds(part.ops, self.rate, self.bandwidth, self.overhead, mbs)
        again = op_seconds(part.recomputed, self.rate, self.bandwidth, self.overhead, mbs)
        sizes = {"tp": tp, "cp": cp, "ep": ep}
        comm = {"tp": [0.0, 0.0], "cp": [0.0, 0.0], "ep": [0.0, 0.0]}
        for c in part.comms:
            comm[c.group][c.backward] += self._comm(c, mbs, sizes[c.group], links[c.group])
        return fwd, 2 * fwd + again, {g: tuple(v) for g, v in comm.items()}

    def _comm(self, c: Comm, mbs: int, size: int, link: Link) -> float:
        """Seconds of ``c`` the step waits for: the whole collective, or past the compute
        it runs beside (``Comm.hidden_by``: the ring)."""
        took = collective(c.kind, c.nbytes * mbs, size, link)
        return max(took - c.hidden_by * mbs / self.rate, 0.0) if c.hidden_by else took

    def _simulate(self, shape: tuple, costs: tuple | None, latency: float):
        """The simulator's run of schedule ``shape`` (name, pp, vpp, m, max_pending_w) at
        ``costs`` (None: unit costs, for the micro-batches in flight), lowered once per
        shape."""
        name, pp, vpp, m, pending = shape
        if shape not in self._lowered:
            sched = schedules.build(name, pp=pp, vpp=vpp, m=m, max_pending_w=pending)
            place = placement(name, pp=pp, vpp=vpp)
            self._lowered[shape] = (schedules.lower(sched, num_chunks=pp * vpp, p2p="eager",
                                                    placement=place), place)
        key = (shape, costs, latency)
        if key not in self._sims:
            lowered, place = self._lowered[shape]
            self._sims[key] = simulator.simulate(
                lowered, pp=pp, placement=place, costs=dict(costs) if costs else None,
                f_cost=F_COST, b_cost=B_COST, latency=latency)
        return self._sims[key]

    def held(self, name: str, pp: int, vpp: int, m: int, weights: dict[int, float],
             carry: dict[int, float] | None = None, pending: int | None = None
             ) -> dict[int, float]:
        """Per pipeline rank, the most activation bytes held at once, each micro-batch
        weighing its chunk's ``weights``, and ``carry`` from its I until its W
        (``Simulation.peak_held_by``). They follow each rank's own compute order, not the
        costs: unit costs, 2 pp micro-batches, unless a rank then holds every one of them
        (GPipe holds all m). ``pending``: the schedule's ``max_pending_w``."""
        sim_m = simulated_microbatches(m, pp, name, held=True)
        sim = self._simulate((name, pp, vpp, sim_m, pending), None, 0.0)
        if sim_m < m and max(sim.peak_held.values()) >= sim_m:
            sim = self._simulate((name, pp, vpp, m, pending), None, 0.0)
        return sim.peak_held_by(placement(name, pp=pp, vpp=vpp), weights, carry)

    def _held(self, chunks: list[list[Part]], name: str, vpp: int, m: int, mbs: int,
              split: Mapping[str, tuple[int, int, int]] | None,
              pending: int | None = None) -> tuple[dict[int, float], int]:
        """(``held`` per pipeline rank, the host bytes of the split graphs every rank holds:
        0 without a split)."""
        pp = len(chunks) // vpp
        if split is None:
            return self.held(name, pp, vpp, m, {
                c: sum(p.activations for p in parts) * mbs for c, parts in enumerate(chunks)}), 0
        held = self.held(name, pp, vpp, m, *split_weights(chunks, split, mbs), pending)
        return held, self.cluster.device.split_node_bytes * sum(
            split.get(p.name, (0, 0, 0))[2] for parts in chunks for p in parts)

    def _links(self, tp: int, cp: int, ep: int) -> tuple:
        cl = self.cluster
        return (("tp", cl.link(1, tp)), ("cp", cl.link(tp, cp)), ("ep", cl.link(tp, ep)))

    def _chunk_seconds(self, chunks: list[list[Part]], mbs: int, tp: int, cp: int, ep: int,
                       scale: tuple = (1.0, 1.0, 0.0)) -> tuple[dict, dict, dict, dict]:
        """Per chunk, one micro-batch's forward and backward seconds (communication
        included), and the tp / cp / ep communication of each; ``scale``: ``_scale``'s
        factors on a block's seconds and on the rest's."""
        links = self._links(tp, cp, ep)
        f_cost, b_cost, comm_f, comm_b = {}, {}, {}, {}
        for c, parts in enumerate(chunks):
            secs = [self._part_seconds(p, mbs, tp, cp, ep, links) for p in parts]
            x = [scale[1] if p.name in ("pre", "post") else scale[0] for p in parts]
            cf = {g: sum(s[2][g][0] * k for s, k in zip(secs, x)) for g in ("tp", "cp", "ep")}
            cb = {g: sum(s[2][g][1] * k for s, k in zip(secs, x)) for g in ("tp", "cp", "ep")}
            f_cost[c] = sum(s[0] * k for s, k in zip(secs, x)) + sum(cf.values())
            b_cost[c] = sum(s[1] * k for s, k in zip(secs, x)) + sum(cb.values())
            comm_f[c], comm_b[c] = cf, cb
        return f_cost, b_cost, comm_f, comm_b

    def pipeline(self, name: str, pp: int, vpp: int, m: int, f_cost: dict, b_cost: dict,
                 latency: float, pending: int | None = None) -> tuple[float, float, int]:
        """(makespan, the busiest rank's busy seconds, that rank) of ``m`` micro-batches
        under schedule ``name``, each chunk's forward and backward costing ``f_cost[c]``,
        ``b_cost[c]`` (I and W half a backward each), each message ``latency``. The
        simulator runs ``simulated_microbatches``; the steady state then repeats: each
        micro-batch beyond them adds the busiest rank's work for one. ``pending``: the
        schedule's ``max_pending_w``."""
        sim_m = simulated_microbatches(m, pp, name)
        costs = []
        for c in range(pp * vpp):
            costs += [((c, Kind.F), f_cost[c]), ((c, Kind.B), b_cost[c]),
                      ((c, Kind.I), b_cost[c] / 2), ((c, Kind.W), b_cost[c] / 2)]
        sim = self._simulate((name, pp, vpp, sim_m, pending), tuple(costs), latency)
        busiest = max(range(pp), key=lambda r: sim.busy[r])
        extra = (m - sim_m) * sim.busy[busiest] / sim_m
        return sim.makespan + extra, sim.busy[busiest] + extra, busiest

    def estimate(self, profile: Profile, config: EngineConfig, memory: int | None = None,
                 split: Mapping[str, tuple[int, int, int]] | None = None) -> Estimate:
        """``config``'s prediction; with ``memory`` (bytes per rank), a layout over it gets
        its memory only (step = inf: its time is not modelled). ``split``: under a
        zero-bubble schedule, what one sample of each part holds from F until I and from I
        until W (``profile.check_split``), in place of its saved activations, and the nodes
        of its split graphs, which every rank holds (host memory: ``split_node_bytes``)."""
        cl, par = self.cluster, config.parallel
        mbs, m = config.micro_batch_size, config.num_microbatches
        tp, cp, ep, pp, dp = par.tp, par.cp, par.ep, par.pp, par.dp
        chunks = self.chunks(profile, par)
        name, where = par.resolved_schedule, par.placement
        held, host = self._held(chunks, name, par.vpp, m, mbs, split, par.max_pending_w)
        lane = _lane_pool(chunks, config, split)
        stages = []
        for s in range(pp):
            mine = [c for c in range(par.num_chunks) if where[c] == s]
            stages.append(self._memory(s, [chunks[c] for c in mine], config,
                                       profile.grad_itemsize, int(held.get(s, 0)), host,
                                       max((lane.get(c, 0) for c in mine), default=0)))
        split = None
        if par.num_chunks > 1:
            split = tuple(self.blocks[i] for i in self.cut(profile, par)[1:])
        if memory is not None and max(st.total for st in stages) > memory:
            return Estimate(math.inf, {}, tuple(stages), split, 0.0, 0.0, 0.0)
        scale = self._scale(profile, mbs)
        extra = scale[2]
        f_cost, b_cost, comm_f, comm_b = self._chunk_seconds(chunks, mbs, tp, cp, ep, scale)
        if config.moe.overlap_moe_expert_parallel_comm and cl.overlap:
            lanes.hide(f_cost, b_cost, comm_f, comm_b, pp, m)  # DualPipe's second lane
        pp_link = cl.link(tp * cp * dp, pp)
        boundary = max((ch[-1].boundary for ch in chunks[:-1]), default=0) * mbs
        latency = (boundary / pp_link.bandwidth + pp_link.latency) if pp > 1 else 0.0
        makespan, busy, busiest = self.pipeline(name, pp, par.vpp, m, f_cost, b_cost, latency,
                                                par.max_pending_w)
        dp_time, opt_time = 0.0, 0.0
        for s, stage in enumerate(stages):
            mine = [c for c in range(par.num_chunks) if where[c] == s]
            window = sum(b_cost[c] for c in mine)
            dp_time = max(dp_time, self._dp_seconds(stage, config, window, m))
            opt_time = max(opt_time, self._optimizer_seconds(stage, config))
        mine = [c for c in range(par.num_chunks) if where[c] == busiest]
        exposed = {g: m * sum(comm_f[c][g] + comm_b[c][g] for c in mine) for g in ("tp", "cp",
                                                                                   "ep")}
        step = makespan + dp_time + opt_time + extra
        breakdown = {
            "compute": busy - sum(exposed.values()),
            **{f"comm_{g}": v for g, v in exposed.items()},
            "comm_pp": 0.0,
            "bubble": makespan - busy,
            "comm_dp": dp_time,
            "optimizer": opt_time,
            "overhead": extra,
        }
        if pp > 1:  # the messages' share of the wait: latency per received message
            breakdown["comm_pp"] = min(breakdown["bubble"], 2 * m * latency)
            breakdown["bubble"] -= breakdown["comm_pp"]
        samples = config.global_batch_size
        model_flops = 3 * self.sample_flops * samples
        world = par.model_ranks * dp
        return Estimate(
            step=step, breakdown=breakdown, stages=tuple(stages), split_points=split,
            tokens_per_s=samples * self.tokens / step,
            mfu=model_flops / (step * world * cl.device.peak(self.precision)),
            model_flops=model_flops)

    def _dp_seconds(self, stage: StageEstimate, config: EngineConfig, window: float,
                    m: int) -> float:
        """Exposed data-parallel communication of one step on one stage."""
        par, zero = config.parallel, config.data_parallel.zero_stage
        n = par.dp_cp
        if n <= 1:
            return 0.0
        link = self.cluster.link(par.tp, n)  # dp x cp ranks, tp apart
        grads = stage.gradients * (n if zero >= 2 else 1)  # whole buffer bytes
        params = stage.parameters * (n if zero == 3 else 1)
        if zero == 0:
            reduce = collective("all_reduce", grads, n, link)
            gather = 0.0
        else:
            reduce = collective("reduce_scatter", grads, n, link)
            gather = collective("all_gather", params, n, link)
        if zero == 3:  # gathered for every micro-batch's forward and backward
            per_mb = 2 * gather
            hidden = window if self.cluster.overlap else 0.0
            gather = m * max(per_mb - hidden, 0.0) + (0.0 if self.cluster.overlap else 0.0)
        overlap = self.cluster.overlap and config.data_parallel.overlap_grad_reduce
        exposed = max(reduce - window, reduce * 0.1) if overlap else reduce
        if zero >= 2:  # sharded gradients: every micro-batch's are reduced
            exposed *= m * self.sharded
        return exposed + gather

    def _optimizer_seconds(self, stage: StageEstimate, config: EngineConfig) -> float:
        """One Adam step over this rank's shard: masters, two moments and the gradient read,
        the three written, the parameters written; the gradient norm reads the gradients."""
        states = stage.optimizer  # masters (not fp32) + moments
        return (2 * states + 2 * stage.gradients + stage.parameters) / self.bandwidth

    def _memory(self, stage: int, chunks: list[list[Part]], config: EngineConfig,
                grad_itemsize: int, held: int, host: int = 0, lane: int = 0) -> StageEstimate:
        """Stage ``stage``'s memory; ``held``: the most activation bytes it holds at once;
        ``host``: what the rank holds besides its reserve (zero-bubble split graphs);
        ``lane``: what a second lane's pool holds besides (a transient)."""
        par, dpc = config.parallel, config.data_parallel
        mbs = config.micro_batch_size
        outside: dict[str, tuple[int, int, bool]] = {}
        params = elements = experts = blocks = 0
        for parts in chunks:
            for p in parts:
                if p.name in ("pre", "post"):
                    outside.update(p.params)
                    continue
                blocks += 1
                for b, e, x in p.params.values():
                    params, elements, experts = params + b, elements + e, experts + e * x
        for b, e, x in outside.values():
            params, elements, experts = params + b, elements + e, experts + e * x
        grads = elements * grad_itemsize
        distributed = dpc.distributed_optimizer or dpc.zero_stage >= 1
        dense_ranks, expert_ranks = (par.dp_cp, par.edp) if distributed else (1, 1)
        states = ADAM_STATES + (1 if config.precision != "fp32" else 0)
        optimizer = int(states * 4 * (elements - experts) / dense_ranks) + int(
            states * 4 * experts / expert_ranks)
        buckets = 0
        if dpc.zero_stage >= 2:
            size = params // max(elements, 1)
            grads = (elements - experts) * grad_itemsize // par.dp_cp + (
                experts * grad_itemsize // par.edp)
            largest, tied = _buckets(chunks, config.resolved_bucket_size)
            if dpc.zero_stage == 3:
                params = (elements - experts) * size // par.dp_cp + experts * size // par.edp
            buckets = _zero_working(largest, tied, size, dpc)
        working = max((p.recompute_working for parts in chunks for p in parts), default=0) * mbs
        # backward's transient: the largest value's gradient and the one made from it, or an
        # exchanged attention's own working set
        parts = [p for c in chunks for p in c]
        transient = max(2 * max((p.largest for p in parts), default=0),
                        max((p.working for p in parts), default=0)) * mbs
        if par.splits_backward:  # W makes a weight's whole gradient while the carry is held
            transient = max(transient, max((b for p in parts for b, _, _ in p.params.values()),
                                           default=0))
        transient += lane
        activations = held + working
        reserved = self.reserved + host
        return StageEstimate(stage, blocks, params, grads, optimizer, activations, buckets,
                             transient, reserved, params + grads + optimizer + activations
                             + buckets + transient + reserved)


def _buckets(chunks: list[list[Part]], bucket_size: int | None) -> tuple[int, int]:
    """(elements of the stage's largest gradient bucket, of a tied one): the buckets pass
    cuts at zero >= 2 at every block (and at ``bucket_size``), the parameters outside the
    blocks in one; that one is tied when the stage holds both ends of a shared weight (a
    tied embedding, read early by the head: ``_zero_memory``)."""
    groups, pre, post = [], {}, {}
    for parts in chunks:
        for p in parts:
            if p.name == "pre":
                pre.update(p.params)
            elif p.name == "post":
                post.update(p.params)
            else:
                groups += [p.param_elements - p.expert_elements, p.expert_elements]
    shared = pre.keys() & post.keys()
    outside = sum(e for _, e, _ in (pre | post).values())
    cap = bucket_size or max(groups + [outside], default=0)
    largest = max((min(g, cap) for g in groups), default=0)
    if shared:
        return largest, min(outside, cap)
    return max(largest, min(outside, cap)), 0


def _lane_pool(chunks: list[list[Part]], config: EngineConfig,
               split: Mapping[str, tuple[int, int, int]] | None) -> dict[int, int]:
    """Per chunk, what DualPipe's second lane holds in a pool of its own (a thread's malloc
    arena, a stream's cached blocks), which the forward lane does not reuse: one
    micro-batch's carry (``split_weights``); empty without the lane."""
    if not config.moe.overlap_moe_expert_parallel_comm or split is None:
        return {}
    return split_weights(chunks, split, config.micro_batch_size)[1]


def split_weights(chunks: list[list[Part]], split: Mapping[str, tuple[int, int, int]],
                  mbs: int) -> tuple[dict[int, int], dict[int, int]]:
    """``Composer.held``'s (weights, carry) under a zero-bubble schedule: per chunk, a
    micro-batch's bytes from F until I and from I until W (``profile.check_split``'s
    ``split``). The first chunk receives nothing: its I is nearly empty, and its parts hold
    their saved activations until W; each chunk that sends keeps the gradient it got back."""
    weights, carry = {}, {}
    last, none = len(chunks) - 1, (0, 0)
    for c, parts in enumerate(chunks):
        if c == 0:
            kept = [sum(p.activations for p in parts)] * 2
        else:
            kept = [sum(split.get(p.name, none)[i] for p in parts) + split.get(RECEIVED, none)[i]
                    for i in (0, 1)]
        sent = split.get(SENT_GRADIENT, none)[1] if c < last else 0
        weights[c], carry[c] = kept[0] * mbs, (kept[1] + sent) * mbs
    return weights, carry


def _zero_working(largest: int, tied: int, size: int, dpc) -> int:
    """Bytes of the buckets whole at once at zero >= 2 (``layout_plan._zero_memory``)."""
    if dpc.zero_stage < 3:
        return (1 + IN_FLIGHT) * largest * 4
    if dpc.backward_prefetch == "post":
        whole = 2 * largest * 4 + largest * size
    else:
        whole = (1 + IN_FLIGHT) * largest * 4 + 2 * largest * size
    return max(whole, tied * size)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    a, b = ranks(xs), ranks(ys)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else 0.0

