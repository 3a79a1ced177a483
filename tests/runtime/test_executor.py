"""The executor in one process (pp=1, no process group): a lowered single-stage schedule
run over several micro-batches returns the summed (loss_sum, num_tokens), accumulates
the gradients of the summed per-token losses, calls its GRAD_SYNC callback once, right
before the last backward, records every step in the tracer it was given, and leaves no
gradients in evaluation. Failures name the schedule step."""

import copy

import pytest
import torch

from fxmeg.errors import ScheduleError
from fxmeg.ir.program import chunk_spec, chunks
from fxmeg.runtime.pipeline import schedules
from fxmeg.runtime.pipeline.executor import ComputeHooks, Executor
from fxmeg.runtime.pipeline.p2p import PointToPoint
from fxmeg.runtime.pipeline.schedules import Action, Kind, fmt
from fxmeg.runtime.timelines import Tracer
from fxmeg.torch_private import run_backward
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import make_model

M, ROWS = 4, 2  # micro-batches, rows per micro-batch
CPU = torch.device("cpu")


def build_chunks(model: torch.nn.Module, example) -> dict[int, torch.fx.GraphModule]:
    """The single chunk of ``model`` (pp=1), as fxmeg.parallelize builds it: capture, loss
    pass, partition and pipeline pass into one chunk graph sharing the model's parameters."""
    return dict(enumerate(chunks(graph_after(model, example, "pipeline"))))


def lowered_steps(m: int, *, train: bool = True, name: str = "none") -> list:
    """Rank 0's lowered steps of a one-stage schedule (forward-only unless ``train``)."""
    compute = schedules.build(name, pp=1, vpp=1, m=m)
    if not train:
        compute = schedules.forward_only(compute)
    return schedules.lower(compute, num_chunks=1)[0]


def _executor(chunk_graphs, *, placement=None, on_grad_sync=None, tracer=None) -> Executor:
    specs = {c: chunk_spec(gm) for c, gm in chunk_graphs.items()}
    wire = PointToPoint(specs, pp=1, peer=lambda r: r, group=None, device=CPU, placement=placement)
    return Executor(
        chunk_graphs,
        specs=specs,
        rank=0,
        device=CPU,
        wire=wire,
        hooks=ComputeHooks(on_grad_sync=on_grad_sync),
        tracer=tracer,
    )


def _setup(seed: int = 3):
    """(model whose parameters the chunk shares, an untouched copy, micro-batches)."""
    model = make_model("gpt", n_layer=2)
    plain = copy.deepcopy(model)
    ids, labels = make_batch(M * ROWS, seed=seed)
    mbs = [(ids[i : i + ROWS], labels[i : i + ROWS]) for i in range(0, M * ROWS, ROWS)]
    return model, plain, mbs


def _plain_sums(model, mbs):
    """Plain PyTorch: sum over micro-batches of (mean loss * tokens), and its gradients."""
    model.zero_grad(set_to_none=True)
    loss_sum, tokens = 0.0, 0
    for ids, labels in mbs:
        n = int((labels != -100).sum())
        per_token_sum = model(ids, labels) * n
        per_token_sum.backward()
        loss_sum += per_token_sum.item()
        tokens += n
    return loss_sum, tokens, {k: p.grad.clone() for k, p in model.named_parameters()}


def _grads(model) -> dict:
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["none", "gpipe"])
def test_stats_and_gradients_are_sums_over_micro_batches(name):
    model, plain, mbs = _setup()
    want_loss, want_tokens, want_grads = _plain_sums(plain, mbs)
    ex = _executor(build_chunks(model, mbs[0]))
    stats = ex.run(lowered_steps(M, name=name), mbs, train=True)
    assert stats.dtype == torch.float64 and stats.shape == (2,)
    assert stats[1].item() == want_tokens
    assert abs(stats[0].item() - want_loss) <= 1e-5 * want_loss
    got = _grads(model)
    assert got.keys() == want_grads.keys()
    for k, g in want_grads.items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-6, msg=k)
    # nothing left in flight; the 'none' schedule holds one micro-batch at a time,
    # GPipe's forwards all of them before any backward
    assert ex.counters.peak_in_flight == (1 if name == "none" else M)


def test_loss_scale_multiplies_gradients_only():
    model, plain, mbs = _setup(seed=5)
    want_loss, want_tokens, want_grads = _plain_sums(plain, mbs)
    ex = _executor(build_chunks(model, mbs[0]))
    stats = ex.run(lowered_steps(M), mbs, train=True, loss_scale=8.0)
    assert abs(stats[0].item() - want_loss) <= 1e-5 * want_loss and stats[1].item() == want_tokens
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 8.0 * want_grads[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["none", "gpipe"])
def test_grad_sync_fires_once_before_the_last_backward(name):
    model, plain, mbs = _setup()
    _, _, want_grads = _plain_sums(plain, mbs[:-1])  # every micro-batch but the last
    param = model.ln_f.weight
    backwards = []
    param.register_post_accumulate_grad_hook(lambda p: backwards.append(1))
    calls = []

    def on_grad_sync(chunk):
        # gradients of the first M - 1 micro-batches are in, the last one's are not
        calls.append((chunk, len(backwards), param.grad.clone()))

    ex = _executor(build_chunks(model, mbs[0]), on_grad_sync=on_grad_sync)
    assert ex.hooks.on_grad_sync is on_grad_sync
    ex.run(lowered_steps(M, name=name), mbs, train=True)
    assert [(c, n) for c, n, _ in calls] == [(0, M - 1)]
    assert len(backwards) == M
    torch.testing.assert_close(calls[0][2], want_grads["ln_f.weight"], rtol=1e-4, atol=1e-6)


def test_tracer_given_to_the_constructor_records_every_step():
    model, _, mbs = _setup()
    tracer = Tracer()
    tracer.begin_step(True)
    ex = _executor(build_chunks(model, mbs[0]), tracer=tracer)
    assert ex.tracer is tracer
    steps = lowered_steps(M)
    ex.run(steps, mbs, train=True)
    assert [name for name, *_ in tracer.events] == [fmt(s) for s in steps]
    categories = {name: cat for name, cat, *_ in tracer.events}
    assert categories["0F0"] == "forward" and categories["0B3"] == "backward"
    assert categories["0GS3"] == "grad_sync"
    assert all(start <= end for *_, start, end in tracer.events)
    assert _executor(build_chunks(model, mbs[0])).tracer is not tracer  # a fresh one by default


def test_evaluation_leaves_no_gradients():
    model, plain, mbs = _setup(seed=7)
    with torch.no_grad():
        want_loss = sum(plain(ids, lab).item() * int((lab != -100).sum()) for ids, lab in mbs)
    calls = []
    ex = _executor(build_chunks(model, mbs[0]), on_grad_sync=calls.append)
    steps = lowered_steps(M, train=False)
    assert [a.kind for s in steps for a in s] == [Kind.F] * M
    stats = ex.run(steps, mbs, train=False)
    assert abs(stats[0].item() - want_loss) <= 1e-5 * want_loss
    assert stats[1].item() == sum(int((lab != -100).sum()) for _, lab in mbs)
    assert all(p.grad is None for p in model.parameters())
    assert calls == [] and ex.counters.peak_in_flight == 0
    assert torch.is_grad_enabled()  # restored after the run


def test_each_run_accumulates_into_the_gradients():
    model, plain, mbs = _setup()
    _, _, want_grads = _plain_sums(plain, mbs[:1])
    ex = _executor(build_chunks(model, mbs[0]))
    steps = lowered_steps(1)
    ex.run(steps, mbs[:1], train=True)
    ex.run(steps, mbs[:1], train=True)  # the caller zeroes gradients, not the executor
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * want_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_failing_step_is_named_in_the_schedule():
    model, _, mbs = _setup()
    ex = _executor(build_chunks(model, mbs[0]))
    steps = [(Action(0, Kind.F, 0),), (Action(0, Kind.B, 1),), (Action(0, Kind.B, 0),)]
    with pytest.raises(ScheduleError, match=r"rank 0: step 1 \(0B1\) failed: KeyError") as info:
        ex.run(steps, mbs[:2], train=True)
    assert "0F0 >>0B1<< 0B0" in str(info.value)


def test_a_schedule_that_leaves_forwards_unbackwarded_is_refused():
    model, _, mbs = _setup()
    ex = _executor(build_chunks(model, mbs[0]))
    with pytest.raises(AssertionError, match="schedule left work unfinished"):
        ex.run(lowered_steps(M, train=False), mbs, train=True)


def test_neighbour_chunks_on_one_rank_hand_off_without_messages():
    # two chunks on one rank, as chunks pp-1 and pp of a V placement: chunk 0's outputs go
    # straight to chunk 1's inbox and chunk 1's input gradients back, with no SEND / RECV
    model, plain, mbs = _setup(seed=11)
    want_loss, want_tokens, want_grads = _plain_sums(plain, mbs)
    two = dict(enumerate(chunks(graph_after(model, mbs[0], "pipeline", num_chunks=2))))
    order = [Action(c, Kind.F, i) for i in range(M) for c in (0, 1)]  # all forwards, then backwards
    order += [Action(c, Kind.B, i) for i in range(M) for c in (1, 0)]
    steps = schedules.lower({0: [(a,) for a in order]}, num_chunks=2, placement=(0, 0))[0]
    assert {a.kind for s in steps for a in s} == {Kind.F, Kind.B, Kind.GRAD_SYNC}
    ex = _executor(two, placement=(0, 0))
    stats = ex.run(steps, mbs, train=True)
    assert stats[1].item() == want_tokens and abs(stats[0].item() - want_loss) <= 1e-5 * want_loss
    for k, g in want_grads.items():
        torch.testing.assert_close(model.get_parameter(k).grad, g, rtol=1e-4, atol=1e-6, msg=k)
    assert ex.counters.peak_in_flight == 2 * M
    evaluation = schedules.lower(
        schedules.forward_only({0: [(a,) for a in order]}), num_chunks=2, placement=(0, 0)
    )
    stats = ex.run(evaluation[0], mbs, train=False)
    assert abs(stats[0].item() - want_loss) <= 1e-5 * want_loss


def test_a_sent_output_is_kept_only_when_its_node_saved_it():
    """DEALLOC frees a sent activation unless backward reads it: exp and relu save their
    result; layer norm saves its mean and rstd (outputs 1 and 2), not the normed output
    that crosses a cut before the head, which is freed; its backward still agrees."""
    from fxmeg.runtime.pipeline.executor import _saves_its_result

    x = torch.randn(4, 8, requires_grad=True)
    assert _saves_its_result(x.exp(), {}) and _saves_its_result(torch.relu(x), {})
    assert not _saves_its_result(x * 2, {})
    normed = torch.nn.functional.layer_norm(x, (8,))
    assert not _saves_its_result(normed, {})
    want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (8,)), x, torch.ones(4, 8))[0]
    # what DEALLOC does; the executor runs backward from it as Megatron does
    normed.data = torch.empty(1)
    run_backward(
        (normed,),
        (torch.ones(4, 8),),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
    assert torch.equal(x.grad, want)


def test_the_executor_takes_its_collaborators_as_objects_not_callbacks():
    """Its messages (``PointToPoint``) and the data-parallel / zero=3 entry points
    (``ComputeHooks``) come as two objects: no constructor argument is a bare callback."""
    import inspect

    params = inspect.signature(Executor.__init__).parameters
    callbacks = [n for n, p in params.items() if "Callable" in str(p.annotation)]
    assert not callbacks and len(params) <= 10, (callbacks, list(params))
