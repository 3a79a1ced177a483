"""The executor: one interpreter that runs this rank's lowered schedule.

Every step is handled by one small method per action kind. Live state (received
activations, saved forward outputs, gradients to send) is keyed by (chunk, micro-batch)
and lives only for one ``run``. Its collaborators are two small objects: the
point-to-point messages to the other stages (``PointToPoint``, runtime/pipeline/p2p.py) and the
data-parallel / zero=3 entry points it calls around compute (``ComputeHooks``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from fxmeg.errors import ScheduleError
from fxmeg.ir.program import ChunkSpec, split_spec
from fxmeg.runtime.lanes import Lane
from fxmeg.runtime.pipeline.p2p import Key, Mailboxes, PointToPoint
from fxmeg.runtime.pipeline.schedules import COMPUTE, Action, Kind, Step, Unit, fmt, input_of
from fxmeg.runtime.timelines import CATEGORY, Tracer
from fxmeg.torch_private import run_backward, view_base


@dataclass
class Counters:
    """What the executor held and freed in the last run (read by tests and benchmarks)."""

    peak_in_flight: int = 0
    """Most micro-batches forwarded but not yet backwarded at once, over all chunks."""
    sent_for_dealloc: int = 0
    """Sent activations marked for deallocation."""
    deallocated: int = 0
    """Of those, the ones whose storage was freed."""
    paired: int = 0
    """Backwards run in the second lane beside a forward (``Executor.lane``)."""


@dataclass
class _State(Mailboxes):
    saved: dict[Key, tuple] = field(default_factory=dict)
    carry: dict[Key, tuple] = field(default_factory=dict)
    """Zero bubble: what a micro-batch's W needs, from its I."""
    losses: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(loss_sum, num_tokens) of each micro-batch the last chunk ran, summed once at the end."""


@dataclass(frozen=True)
class ComputeHooks:
    """What the executor calls around its compute: the data-parallel gradient buffers'
    and zero=3's entry points (runtime/context.py picks them by the config). Each left
    None does nothing."""

    accumulate: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None
    """Adds a weight gradient into its buffer (zero bubble's W)."""
    on_grad_sync: Callable[[int], None] | None = None
    """Called with the chunk index at GRAD_SYNC (DDP: start reducing buckets)."""
    on_backward: Callable[[int], None] | None = None
    """Called with the chunk index once a backward (or weight-gradient) action is done
    (zero >= 2: the gradient buckets are reduced then)."""
    wait_params: Callable[[], None] | None = None
    """Waits for the parameters' all-gather before a split chunk's forward (its graph has
    no param-gather markers; overlap_param_gather)."""
    running: Callable[[bool], contextlib.AbstractContextManager] | None = None
    """Entered around every chunk forward (called with False) and backward (True); zero=3:
    the parameters' gathers and releases."""


class Executor:
    """Runs this rank's lowered schedules over the chunks this rank holds."""

    def __init__(
        self,
        chunks: dict[int, fx.GraphModule],
        *,
        specs: dict[int, ChunkSpec],
        rank: int,
        device: torch.device,
        wire: PointToPoint,
        hooks: ComputeHooks = ComputeHooks(),
        compile: bool = False,
        tracer: Tracer | None = None,
        lane: Lane | None = None,
    ) -> None:
        self.chunks = chunks
        self.lane = lane
        """With one: each schedule unit of one chunk's forward and another chunk's split
        backward (DualPipeV's steady state) runs its backward here, beside the forward
        (``_pair``)."""
        self._run = {
            c: torch.compile(gm, dynamic=False) if compile else gm for c, gm in chunks.items()
        }
        self.split = {
            c: _SplitChunk(gm, compile) for c, gm in chunks.items() if split_spec(gm) is not None
        }
        """Chunks whose backward runs as input- and weight-gradient graphs (zero bubble)."""
        self.hooks = hooks
        self.running = hooks.running or contextlib.nullcontext
        self.wire = wire
        """The point-to-point messages to and from the other pipeline stages."""
        self.specs, self.rank, self.device = specs, rank, device
        self.counters = Counters()
        self.tracer = tracer if tracer is not None else Tracer()
        self._planned: tuple[list[Step], list, dict[int, int]] | None = None
        self._saves_result: dict[tuple[type, int], bool] = {}
        """Whether an autograd node type saves its output k (``_saves_its_result``)."""
        self._handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._input_grad,
            Kind.W: self._weight_grad,
            Kind.DEALLOC: self._deallocate,
            Kind.GRAD_SYNC: self._grad_sync,
        }

    def run(
        self,
        steps: list[Step],
        microbatches: Sequence[tuple[torch.Tensor, ...]],
        *,
        train: bool,
        loss_scale: float = 1.0,
        units: Sequence[Unit] = (),
    ) -> torch.Tensor:
        """Run lowered ``steps``; return float64 ``[sum of loss_sum, sum of num_tokens]``
        over the micro-batches this rank's last chunk saw (zeros elsewhere). ``units``: the
        compute units ``steps`` were lowered from; with a lane, each unit of one chunk's
        forward and another's backward runs in two lanes (``_pair``)."""
        self.steps = steps
        self._mbs, self._train, self._scale = microbatches, train, loss_scale
        self._state = _State()
        self.counters = Counters()
        tracer = self.tracer
        plan, pairs = self._plan(steps, units)
        with torch.set_grad_enabled(train):
            index = 0
            while index < len(plan):
                if train and index in pairs:
                    index = self._pair(plan, index, pairs[index])
                    continue
                _, _, compute, reads = plan[index]
                try:
                    if compute:
                        self.wire.wait(reads, self._state, tracer)
                    self._step(plan, index)
                except Exception as exc:
                    raise ScheduleError(self._failure(index, exc)) from exc
                index += 1
            try:
                for a in list(self._state.posted):  # sends nobody freed (gradients, eval)
                    self.wire.wait(a, self._state, tracer)
            except Exception as exc:
                raise ScheduleError(self._failure(len(self.steps) - 1, exc)) from exc
        state, self._state = self._state, None
        assert not state.saved and not state.inbox and not state.carry, (
            "schedule left work unfinished"
        )
        return self._stats(state.losses)

    def _trace(self, step: Step, start: int) -> None:
        if self.tracer.on:
            category = CATEGORY.get(step[0].kind.value, "p2p")
            self.tracer.add(fmt(step), category, start, time.perf_counter_ns())

    def _plan(
        self, steps: list[Step], units: Sequence[Unit]
    ) -> tuple[list[tuple[Step, Callable[[], None], bool, Action | None]], dict[int, int]]:
        """Each step, its handler bound to it, whether it computes and the receive it
        reads, and the pairs that run in two lanes (``_pairs``): worked out once per
        lowered schedule (the same list object every training step), not at every step."""
        if self._planned is None or self._planned[0] is not steps:
            plan = []
            for step in steps:
                a = step[0]
                handler = self._handlers.get(a.kind)
                act = (
                    functools.partial(self._post, step)
                    if handler is None
                    else functools.partial(handler, a)
                )
                plan.append((step, act, a.kind in COMPUTE, input_of(a)))
            pairs = _pairs(steps, units, set(self.split)) if self.lane is not None else {}
            self._planned = (steps, plan, pairs)
        return self._planned[1], self._planned[2]

    def _pair(self, plan: list, first: int, last: int) -> int:
        """Run steps ``first`` (a forward) to ``last`` (another chunk's backward) with the
        backward in the second lane, beside the forward; return the next step's index.

        A unit's computes read only what came before the unit (the schedule's units have no
        communication inside), so both receives are waited for first. The steps between
        run in their order around the forward: what reads the forward's outputs (its sends'
        posts, their DEALLOCs) after it, the rest (GRAD_SYNC, other DEALLOCs) before the
        lane starts, so that nothing but the backward touches its micro-batch meanwhile."""
        forward, backward = plan[first][0][0], plan[last][0][0]
        between = range(first + 1, last)
        after = [i for i in between if _reads_output(plan[i][0][0], forward)]
        index = first
        try:
            self.wire.wait(plan[first][3], self._state, self.tracer)
            index = last
            self.wire.wait(plan[last][3], self._state, self.tracer)
            for index in (i for i in between if i not in after):
                self._step(plan, index)
            key = (backward.chunk, backward.mb)
            self.lane.record([*self._state.saved[key][0], *self._state.grad_inbox.get(key, ())],
                             to_lane=True)
            index = last
            start = time.perf_counter_ns() if self.tracer.on else 0
            running = self.lane.start(plan[last][1])
        except Exception as exc:
            raise ScheduleError(self._failure(index, exc)) from exc
        failure = None
        try:
            for index in (first, *after):
                self._step(plan, index)
        except Exception as exc:  # the lane is joined first: it may still use the groups
            failure = (index, exc)
        try:
            self.lane.join(running)
            self.lane.record(self._state.grad_outbox.get(key, ()), to_lane=False)
            self._hand_off(backward)
        except Exception as exc:
            failure = failure or (last, exc)
        if failure is not None:
            raise ScheduleError(self._failure(*failure)) from failure[1]
        self._trace(plan[last][0], start)
        self.counters.paired += 1
        return last + 1

    def _step(self, plan: list, index: int) -> None:
        """Run step ``index`` of ``plan``, its receive already waited for; trace it."""
        step, act, compute, _ = plan[index]
        start = time.perf_counter_ns() if self.tracer.on else 0
        act()
        if compute:
            self._hand_off(step[0])
        self._trace(step, start)

    def _stats(self, losses: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """float64 ``[sum of loss_sum, sum of num_tokens]``: a few ops per step, not per
        micro-batch."""
        if not losses:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return torch.stack([torch.stack(column).double().sum() for column in zip(*losses)])

    # ------------------------------------------------------------ compute

    def _forward(self, a: Action) -> None:
        spec, key = self.specs[a.chunk], (a.chunk, a.mb)
        data = [self._mbs[a.mb][i] for i in spec.data_inputs]
        received = self._state.inbox.pop(key, [])
        if self._train and a.chunk in self.split:
            return self._forward_split(a, data, received)
        if self._train:
            for t, b in zip(received, spec.recv):
                t.requires_grad_(b.grad)
        with self.running(False):
            outs = self._run[a.chunk](*data, *received)
        sends = list(outs[: len(spec.send)])
        loss = None
        if spec.is_last:
            loss, num_tokens = outs[-2:]
            self._state.losses.append((loss.detach(), num_tokens))
        if spec.send:
            self._state.outbox[key] = sends
        if self._train:
            self._state.saved[key] = (received, sends, loss)
            self.counters.peak_in_flight = max(self.counters.peak_in_flight, len(self._state.saved))

    def _backward(self, a: Action) -> None:
        if a.chunk in self.split:
            self._input_grad(a)
            self._weight_grad(a)
            return
        spec, key = self.specs[a.chunk], (a.chunk, a.mb)
        received, sends, loss = self._state.saved.pop(key)
        if spec.is_last:
            roots, grads = [loss], [torch.full_like(loss, self._scale)]
        else:
            roots = [t for t, b in zip(sends, spec.send) if b.grad]
            grads = self._state.grad_inbox.pop(key)
        with self.running(True):
            run_backward(tuple(roots), tuple(grads), keep_graph=False, create_graph=False,
                         inputs=(), allow_unreachable=True, accumulate_grad=True)
        if self.hooks.on_backward is not None:
            self.hooks.on_backward(a.chunk)
        if a.chunk > 0 and any(b.grad for b in spec.recv):
            self._state.grad_outbox[key] = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t, b in zip(received, spec.recv)
                if b.grad
            ]

    # ------------------------------------------------------------ zero bubble

    def _forward_split(self, a: Action, data: list, received: list) -> None:
        """F of a split chunk: its forward graph, outside autograd; the tensors backward
        needs are kept with the micro-batch."""
        spec, key, chunk = self.specs[a.chunk], (a.chunk, a.mb), self.split[a.chunk]
        if self.hooks.wait_params is not None:  # the forward graph has no param-gather markers
            self.hooks.wait_params()
        with torch.no_grad():
            outs = chunk.forward(*chunk.state(), *data, *received)
        n = chunk.spec.outputs
        sends, saved = list(outs[: len(spec.send)]), outs[n:]
        loss = None
        if spec.is_last:
            loss, num_tokens = outs[n - 2 : n]
            self._state.losses.append((loss, num_tokens))
        if spec.send:
            self._state.outbox[key] = sends
        self._state.saved[key] = (saved, sends, loss)
        self.counters.peak_in_flight = max(self.counters.peak_in_flight, len(self._state.saved))

    def _input_grad(self, a: Action) -> None:
        """I: the gradients of the chunk's received inputs (sent upstream); keeps only
        what W needs."""
        spec, key, chunk = self.specs[a.chunk], (a.chunk, a.mb), self.split[a.chunk]
        saved, sends, loss = self._state.saved.pop(key)
        if spec.is_last:
            upstream = [torch.full_like(loss, self._scale)]
        else:
            upstream = self._state.grad_inbox.pop(key)
        with torch.no_grad():
            outs = chunk.input(*saved, *upstream)
        wanted = [b for b in spec.recv if b.grad]
        grads, self._state.carry[key] = outs[: len(wanted)], outs[len(wanted):]
        if a.chunk > 0 and wanted:
            self._state.grad_outbox[key] = [
                g if g is not None else torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                for g, b in zip(grads, wanted)
            ]

    def _weight_grad(self, a: Action) -> None:
        """W: the chunk's weight gradients, each added to its gradient buffer as it is made."""
        chunk = self.split[a.chunk]
        with torch.no_grad():
            chunk.weight_grads(self._state.carry.pop((a.chunk, a.mb)), self.hooks.accumulate)
        if self.hooks.on_backward is not None:
            self.hooks.on_backward(a.chunk)

    def _grad_sync(self, a: Action) -> None:
        if self.hooks.on_grad_sync is not None:
            self.hooks.on_grad_sync(a.chunk)

    def _deallocate(self, a: Action) -> None:
        """Free sent activations' storage, keep their autograd nodes (Megatron:
        deallocate_output_tensor); backward then runs through them anyway."""
        # the send must have read it
        self.wire.wait(Action(a.chunk, Kind.SEND_F, a.mb), self._state, self.tracer)
        if not self._train:
            return
        saved, sends, _ = self._state.saved[(a.chunk, a.mb)]
        split = a.chunk in self.split
        # a saved value that is no tensor: a split routed-experts block's state (moe_split)
        kept = ({t.untyped_storage().data_ptr() for t in saved if isinstance(t, torch.Tensor)}
                if split else set())
        for t, free in zip(sends, self.specs[a.chunk].deallocate):
            if not free:
                continue
            self.counters.sent_for_dealloc += 1
            if split:  # the forward graph's outputs: free unless backward reads the storage
                if view_base(t) is None and t.untyped_storage().data_ptr() not in kept:
                    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
                    self.counters.deallocated += 1
            elif (
                view_base(t) is None
                and t.grad_fn is not None
                and not _saves_its_result(t, self._saves_result)
            ):
                t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
                self.counters.deallocated += 1

    # ------------------------------------------------------------ communication

    def _post(self, step: Step) -> None:
        """Post a group of point-to-point actions into this run's mailboxes (the plan is
        kept over runs: the run's state is read here, not bound into it)."""
        self.wire.post(step, self._state)

    def _hand_off(self, a: Action) -> None:
        """Chunks next to each other on this rank (chunks pp-1 and pp of a V placement)
        exchange no message: what ``a`` made for the neighbour goes straight to its inbox,
        detached like a received tensor, so each chunk's backward stops at its inputs."""
        key, s = (a.chunk, a.mb), self._state
        if key in s.outbox and a.chunk + 1 in self.chunks:
            s.inbox[(a.chunk + 1, a.mb)] = [t.detach() for t in s.outbox.pop(key)]
        if key in s.grad_outbox and a.chunk - 1 in self.chunks:
            s.grad_inbox[(a.chunk - 1, a.mb)] = s.grad_outbox.pop(key)

    # ------------------------------------------------------------ errors

    def _failure(self, index: int, exc: BaseException) -> str:
        cells = [fmt(s) for s in self.steps]
        cells[index] = f">>{cells[index]}<<"
        return (
            f"rank {self.rank}: step {index} ({fmt(self.steps[index])}) failed: "
            f"{type(exc).__name__}: {exc}\nthis rank's schedule, failing step marked:\n"
            + " ".join(cells)
        )


class _SplitChunk:
    """A chunk's forward, input-gradient and weight-gradient graphs (split_backward pass)
    and the tensors they take, in their calling convention (program.SplitSpec)."""

    def __init__(self, gm: fx.GraphModule, compile: bool) -> None:
        self.spec = split_spec(gm)
        tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
        self._state = [tensors[n] for n in self.spec.state]
        self.weights = [tensors[n] for n in self.spec.weights]
        wrap = (lambda g: torch.compile(g, dynamic=False)) if compile else (lambda g: g)
        self.forward, self.input = wrap(gm.zb_forward), wrap(gm.zb_input)
        # compiled, the weight graph returns its gradients together (a callback inside
        # would break the graph); eager, it hands each on as it is made
        self._weight = wrap(gm.zb_weight) if compile else _streamed(gm.zb_weight)
        self._streams = not compile

    def weight_grads(self, carry: tuple, accumulate) -> None:
        """Run the weight-gradient graph on ``carry``, calling ``accumulate(parameter,
        gradient)`` for each gradient: eager, as soon as it is made, so that the chunk's
        gradients are never all alive at once (the W step held them together, a transient
        as large as the chunk's weights)."""
        if self._streams:
            self._weight(lambda i, g: accumulate(self.weights[i], g), *carry)
            return
        for p, g in zip(self.weights, self._weight(*carry)):
            if g is not None:
                accumulate(p, g)

    def state(self) -> list[torch.Tensor]:
        """Parameters then buffers, as their current values (a distributed optimizer moves
        parameters' storage; the objects stay)."""
        return [t.detach() for t in self._state]


def _streamed(weights: fx.GraphModule) -> fx.GraphModule:
    """A copy of weight-gradient graph ``weights`` that takes a callback first and calls
    it with (index, gradient) right after each gradient is made, returning nothing: the
    generated code then drops each gradient once handed on."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    sink = graph.placeholder("sink")
    out = weights.graph.output_node()
    made = {}
    for i, g in enumerate(out.args[0]):
        if isinstance(g, fx.Node):
            made.setdefault(g, []).append(i)
    for node in weights.graph.nodes:
        if node is out:
            break
        env[node] = graph.node_copy(node, lambda n: env[n])
        for i in made.get(node, ()):
            graph.call_function(_hand_on, (sink, i, env[node]))
    graph.output(())
    return fx.GraphModule(weights, graph)


def _hand_on(sink, index: int, grad: torch.Tensor) -> None:
    sink(index, grad)


def _pairs(steps: list[Step], units: Sequence[Unit], split: set[int]) -> dict[int, int]:
    """For each unit of ``units`` that is one chunk's forward then another chunk's split
    backward (DualPipeV's steady state; a split B runs as graphs outside autograd, which a
    second thread can run), the index of its forward in ``steps`` -> its backward's."""
    wanted = {
        f: b for f, b in (u for u in units if len(u) == 2)
        if f.kind is Kind.F and b.kind is Kind.B and b.chunk != f.chunk and b.chunk in split
    }
    at = {step[0]: i for i, step in enumerate(steps) if step[0].kind in COMPUTE}
    pairs = {at[f]: at[b] for f, b in wanted.items()}
    assert all(steps[k][0].kind not in COMPUTE for i, j in pairs.items() for k in range(i + 1, j))
    return pairs


def _reads_output(a: Action, forward: Action) -> bool:
    """Whether step action ``a`` reads what ``forward`` made (its send, their DEALLOC)."""
    return (a.chunk, a.mb) == (forward.chunk, forward.mb) and a.kind is not Kind.GRAD_SYNC


def _saves_its_result(t: torch.Tensor, memo: dict[tuple[type, int], bool]) -> bool:
    """True when t's autograd node saved t itself (e.g. relu, exp): freeing it would
    corrupt backward. Autograd names a saved output ``_saved_result`` (one output) or
    ``_saved_result<k>`` (output k of several: layer norm saves its mean and rstd, 1 and
    2, not its output 0, which crosses a cut before the head). ``memo``: the answers so
    far by (node type, output), the executor's."""
    key = (type(t.grad_fn), t.output_nr)
    if key not in memo:
        names = dir(t.grad_fn)
        memo[key] = "_saved_result" in names or f"_saved_result{t.output_nr}" in names
    return memo[key]
