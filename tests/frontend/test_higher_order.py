"""Higher-order ops: autocast and ``torch.no_grad()`` regions inside forward, which export
keeps as ``wrap_with_autocast`` / ``wrap_with_set_grad_enabled`` nodes calling a body
GraphModule. Capture keeps the bodies (under ``_fxmeg_hop``) and every pass keeps them:
trained at world size 1 against plain PyTorch, pipelined into chunks that own the bodies
they call, recomputed, bucketed, and split by tensor parallelism inside a region that
reads a split value (refused, naming the body's node, where the body cannot be). Also
x-transformers' decoder, whose rotary embedding runs in autocast-disabled regions reading
the head-split q and k (issues 15 and 28)."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxmeg
from fxmeg.errors import PassError
from fxmeg.frontend.capture import capture
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.layouts import Replicate, Shard
from fxmeg.ir.program import chunk_spec
from fxmeg.passes.graph_utils import body_call, is_hop, is_subgraph, requires_grad_nodes
from fxmeg.passes.partition import node_cost, node_flops
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)

VOCAB, SEQ, GBS, MBS, STEPS = 64, 16, 4, 2, 3


class Block(nn.Module):
    """An MLP block with one region run with autocast disabled: "after" the MLP (its
    operands stay whole under tensor parallelism), around the "gelu" (it reads the
    column-parallel output), around the "up" projection (a matmul inside a body), around
    the "down" projection (a row-parallel linear inside a body: refused at tp), or None."""

    def __init__(self, d: int, region: str | None) -> None:
        super().__init__()
        self.region = region
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))  # "after": used only in a region

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.region == "up":
            with torch.autocast(device_type="cpu", enabled=False):
                h = self.up(h.float())
        else:
            h = self.up(h)
        if self.region == "gelu":
            with torch.autocast(device_type="cpu", enabled=False):
                h = F.gelu(h.float())
        else:
            h = F.gelu(h)
        if self.region == "down":
            with torch.autocast(device_type="cpu", enabled=False):
                h = self.down(h.float()) * table
        else:
            h = self.down(h) * table
        if self.region == "after":
            with torch.autocast(device_type="cpu", enabled=False):
                h = h.float() * self.scale
        else:
            h = h * self.scale
        return x + h


class Regions(nn.Module):
    """A rotary-like table computed under autocast-disabled and a gate computed under
    ``torch.no_grad()`` (it scales every block's output but passes no gradient), both read
    by every block."""

    def __init__(self, region: str | None = "after", n_layer: int = 4, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, region) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cpu", enabled=False):
            t = torch.arange(ids.shape[1], dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            table = 1.0 + 0.1 * torch.cat([freqs, freqs], dim=-1).cos()
        x = self.emb(ids)
        with torch.no_grad():
            gate = 0.5 + torch.sigmoid(x.mean(dim=-1, keepdim=True))
        for layer in self.layers:
            x = layer(x, table) * gate
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _model(region: str | None = "after", seed: int = 0) -> Regions:
    torch.manual_seed(seed)
    return Regions(region)


def _batches(vocab: int = VOCAB):
    return [make_batch(GBS, seed=s, vocab=vocab, seq=SEQ) for s in range(STEPS)]


def _hops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_hop(n)]


def _bodies_owned(gm: fx.GraphModule) -> set[str]:
    hop = getattr(gm, "_fxmeg_hop", None)
    return {f"_fxmeg_hop.{name}" for name, _ in hop.named_children()} if hop is not None else set()


def _bodies_called(gm: fx.GraphModule) -> set[str]:
    return {a.target for n in _hops(gm) for a in n.all_input_nodes if is_subgraph(a)}


def _train(model, batches, **options):
    ref_losses, ref_norms, ref_state = reference(model, batches)
    engine = fxmeg.parallelize(model, tuple(t[:MBS] for t in batches[0]), global_batch_size=GBS,
                               optimizer=optimizer, **options)
    results = [engine.train_step(b) for b in batches]
    assert_losses_close([r.loss for r in results], ref_losses)
    assert_losses_close([r.grad_norm for r in results], ref_norms, rtol=1e-4)
    assert_weights_close(engine.full_state_dict(), ref_state)
    return engine


def _chained(model, example, **options):
    """The pipelined parent graph run in one process computes the captured loss."""
    program = transform(model, example, **options)
    loss_sum, num_tokens = program.graph(*example)
    assert int(num_tokens) == int((example[1] != -100).sum())
    assert torch.equal(loss_sum / num_tokens, model(*example))
    return program


# ---------------------------------------------------------------- our own model


def test_capture_keeps_the_region_bodies():
    model = _model()
    ids, labels = make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ)
    gm = capture(model, (ids, labels)).gm
    hops = _hops(gm)
    kinds = [n.target.name() for n in hops]
    assert (
        kinds == ["wrap_with_autocast", "wrap_with_set_grad_enabled"] + ["wrap_with_autocast"] * 4
    )
    assert _bodies_called(gm) == _bodies_owned(gm) == {
        "_fxmeg_hop.autocast_0", "_fxmeg_hop.set_grad_enabled_1",
        *(f"_fxmeg_hop.autocast_{i}" for i in range(2, 6))}
    for body in gm._fxmeg_hop.children():  # no export asserts; metadata kept and tagged
        assert not list(body.parameters()) and not list(body.buffers())
        for n in body.graph.nodes:
            assert n.target != torch.ops.aten._assert_tensor_metadata.default
            if n.op != "output":
                assert "val" in n.meta and "module" in n.meta["fxmeg"]
    block = hops[2]  # the parameter used only inside the region is its operand
    assert block.meta["fxmeg"]["module"] == "layers.0"
    assert [a.target for a in block.all_input_nodes if a.op == "get_attr"][-1] == "layers.0.scale"
    out = gm(ids, labels)[0]
    want = model(ids, labels)
    assert torch.equal(out, want)
    got = torch.autograd.grad(out, list(model.parameters()))
    ref = torch.autograd.grad(want, list(model.parameters()))
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_no_grad_region_values_do_not_require_grad():
    model = _model()
    gm = capture(model, make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ)).gm
    grads = requires_grad_nodes(gm)
    table, gate, block = _hops(gm)[:3]
    assert table not in grads and gate not in grads  # a buffer's table; a no_grad region
    assert all(u not in grads for u in gate.users)
    assert block in grads and all(u in grads for u in block.users)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_trains_like_plain_pytorch(recompute):
    engine = _train(_model(), _batches(), recompute=recompute)
    slots = {s.name for layouts in engine.program.buffers for lay in layouts for s in lay.slots}
    assert {f"layers.{i}.scale" for i in range(4)} <= slots  # read only inside regions


def test_pipeline_chunks_own_the_bodies_they_call():
    model = _model()
    example = make_batch(MBS, seed=7, vocab=VOCAB, seq=SEQ)
    program = _chained(model, example, pp=2)
    graphs = program.chunks
    for gm in graphs:
        assert _bodies_owned(gm) == _bodies_called(gm) != set()
    assert _bodies_called(graphs[0]) & _bodies_called(graphs[1]) == set()
    table, gate = (next(iter(h.users)).name for h in _hops(capture(model, example).gm)[:2])
    sent = {b.name: b.grad for b in chunk_spec(graphs[0]).send}
    assert list(sent)[:2] == [table, gate] and not sent[table] and not sent[gate]
    assert list(sent.values())[2:] == [True]  # only the residual stream sends a gradient back


def test_pipeline_with_recompute_moves_bodies_into_regions():
    model = _model()
    example = make_batch(MBS, seed=3, vocab=VOCAB, seq=SEQ)
    program = _chained(model, example, pp=2, recompute="full")
    regions = [
        m
        for gm in program.chunks
        for name, m in gm.named_children()
        if name.startswith("recompute_")
    ]
    assert len(regions) == 4
    for r in regions:  # each block's region calls its own body, as a get_attr, not an input
        assert len(_hops(r.region)) == 1 and _bodies_owned(r.region) == _bodies_called(r.region)
        assert not any(
            p.name.startswith("_fxmeg_hop") for p in r.region.graph.nodes if p.op == "placeholder"
        )
    loss_sum, num_tokens = program.graph(*example)
    loss = loss_sum / num_tokens
    got = torch.autograd.grad(loss, list(model.parameters()))
    ref = torch.autograd.grad(model(*example), list(model.parameters()))
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(got, ref))


def test_flops_and_costs_count_the_bodies():
    example = make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ)
    inside = transform(_model("up"), example, stop_after="partition")
    plain = transform(_model(None), example, stop_after="partition")
    assert len(_hops(inside)) == 6  # the up projections run in regions
    flops = [gm.meta["fxmeg"]["facts"].flops_per_microbatch for gm in (inside, plain)]
    assert flops[0] == flops[1] > 0
    up = _hops(inside)[2]  # layers.0's up projection: (2 x 16 tokens) x 32 -> 64
    assert node_flops(up) == 2.0 * (MBS * SEQ * 64) * 32
    assert node_cost(up) > node_flops(up)  # plus the bytes its body moves


def test_tensor_parallel_keeps_regions_with_whole_operands():
    model = _model("after")
    gm = transform(
        model, make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ), tp=2, stop_after="tensor_parallel"
    )
    tags = {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}
    assert tags["layers.0.up.weight"] == Shard(0, (64,))
    assert tags["layers.0.down.weight"] == Shard(1, (64,))
    assert tags["layers.0.scale"] == Replicate(False)
    assert len(_hops(gm)) == 6 and _bodies_owned(gm) == _bodies_called(gm)


def test_tensor_parallel_splits_inside_a_region():
    """The gelu region reads the column-parallel output: its body is split like the
    outer graph (local shapes, re-evaluated), its result stays split for the row-parallel
    down projection, and its grad flows as before."""
    gm = transform(_model("gelu"), make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ), tp=2,
                   stop_after="tensor_parallel")
    tags = {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}
    assert tags["layers.0.up.weight"] == Shard(0, (64,))
    assert tags["layers.0.down.weight"] == Shard(1, (64,))
    region = _hops(gm)[2]
    assert (
        region.target.name() == "wrap_with_autocast"
        and region.meta["fxmeg"]["module"] == "layers.0"
    )
    body = body_call(region)[0]
    gelu = next(n for n in body.graph.nodes if n.target == torch.ops.aten.gelu.default)
    assert tuple(gelu.meta["val"].shape) == (MBS, SEQ, 32)  # 64 features over 2 ranks
    assert tuple(region.meta["val"][0].shape) == (MBS, SEQ, 32)
    assert "gelu" in body.code and _bodies_owned(gm) == _bodies_called(gm)
    assert region in requires_grad_nodes(gm)


def test_x_transformers_region_rewrites_its_shape_arguments():
    """The rotary region's reshape to (batch, heads, seq, head_dim / 2, 2) now names the
    local heads (4 over 2 ranks), and the region's output is q's local part."""
    gm = transform(
        _xt(), make_batch(MBS, seed=0, vocab=96, seq=SEQ), tp=2, stop_after="tensor_parallel"
    )
    region = next(n for n in _hops(gm) if n.meta["fxmeg"]["module"] == "net.attn_layers.layers.0.1")
    body = body_call(region)[0]
    shapes = [n.args[1] for n in body.graph.nodes if n.target == torch.ops.aten.reshape.default]
    assert [2, 2, 16, 16, 2] in shapes and [2, 2, 16, 32] in shapes
    assert tuple(region.meta["val"][0].shape) == (MBS, 2, SEQ, 64)


def test_tensor_parallel_keeps_a_block_whole_whose_row_linear_is_inside_a_region(caplog):
    """A row-parallel linear inside a region is no linear the pass can split (its weight is
    a body input): the block's "up" output would reach the residual stream split, so both
    projections stay whole, and tp says so by name (never silent)."""
    with caplog.at_level("WARNING", logger="fxmeg.passes.tensor_parallel"):
        program = transform(_model("down"), make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ), tp=2)
    assert program.tp_specs["layers.0.up.weight"] == Replicate(reduce_grad=False)
    assert program.tp_specs["layers.0.down.weight"] == Replicate(reduce_grad=False)
    assert dict(program.tp_whole).keys() == {"layers.*.up", "layers.*.down"}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        "'layers.*.down': no linear fxmeg splits reads it (read by wrap_with_autocast)" in warning
    ), warning
    assert "'layers.*.up'" in warning


class MixBlock(nn.Module):
    """A parameter ("mix") read twice: inside a ``torch.no_grad()`` region with the
    column-parallel output, where no gradient flows back, and outside by a replicated sum,
    whose gradient is the same on every tp rank: its gradient needs no sum over tp."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.mix = nn.Parameter(torch.linspace(0.5, 1.5, 2 * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.gelu(self.up(x))
        with torch.no_grad():
            gate = torch.sigmoid((u * self.mix).mean(dim=-1, keepdim=True))
        return x + self.down(u * gate) + self.mix.mean()


class NoGradMix(nn.Module):
    def __init__(self, n_layer: int = 2, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(MixBlock(d) for _ in range(n_layer))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _no_grad_mix(seed: int = 0) -> NoGradMix:
    torch.manual_seed(seed)
    return NoGradMix()


def test_a_parameter_read_with_split_values_only_under_no_grad_is_not_summed_over_tp():
    """No gradient flows back through a no-grad region: what the parameter meets there
    does not make its gradient this rank's part (tests/parity/test_higher_order.py trains it)."""
    program = transform(_no_grad_mix(), make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ), tp=2)
    assert program.tp_specs["layers.0.up.weight"] == Shard(0, (64,))
    assert program.tp_specs["layers.0.mix"] == Replicate(reduce_grad=False)


class TwoArrivals(nn.Module):
    """A statistic over the column-parallel output (all-reduced over tp) reaches one
    autocast region twice: directly, read with split values there, and through a product
    whose reader in the body stays replicated (it scales the next block's input)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([MixBlock(d), MixBlock(d)])
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        first, second = self.layers
        u = F.gelu(first.up(x))
        s = (u * u).mean(dim=-1, keepdim=True)
        a = s * 2
        with torch.autocast(device_type="cpu", enabled=False):
            y = u.float() * s
            z = a.float() + 1
        x = x + first.down(y)
        x = x + second.down(F.gelu(second.up(x * z)))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_a_statistic_reaching_a_region_twice_is_followed_on_both_arrivals():
    """Read with split values in the body (u * s: each rank holds its part of that
    gradient) and whole through a (z scales the next block's input): the statistic's
    all-reduce passes its gradient as it is, and a tp_copy on the body's edge into the
    split product sums that reader's parts (tests/parity/test_higher_order.py trains it).
    A traversal that marked the region seen on its first arrival missed the second
    reader, kept the statistic's all-reduce for a split reader only, and trained wrong
    silently."""
    torch.manual_seed(0)
    gm = transform(
        TwoArrivals(),
        make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ),
        stop_after="tensor_parallel",
        tp=2,
    )
    local = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList)
    assert [u.target for u in local.users] == [torch.ops.fxmeg.tp_reduce.default]
    bodies = [m for m in gm.modules() if m is not gm and isinstance(m, fx.GraphModule)]
    edges = [
        n for b in bodies for n in b.graph.nodes if n.target == torch.ops.fxmeg.tp_copy.default
    ]
    assert len(edges) == 1 and [u.target for u in edges[0].users] == [torch.ops.aten.mul.Tensor]


# ---------------------------------------------------------------- x-transformers


class XDecoder(nn.Module):
    """x-transformers' decoder with rotary embeddings (computed in autocast-disabled
    regions), returning the mean cross-entropy of its logits."""

    def __init__(self) -> None:
        super().__init__()
        xt = pytest.importorskip("x_transformers")
        self.net = xt.TransformerWrapper(
            num_tokens=96, max_seq_len=32,
            attn_layers=xt.Decoder(dim=32, depth=4, heads=4, rotary_pos_emb=True))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(ids).flatten(0, 1), labels.flatten())


def _xt(seed: int = 0) -> XDecoder:
    torch.manual_seed(seed)
    return XDecoder()


def test_x_transformers_trains_like_plain_pytorch():
    engine = _train(_xt(), _batches(vocab=96))
    assert _hops(engine.program.chunks[0])


def test_x_transformers_pipeline_chunks_compute_the_captured_loss():
    example = make_batch(MBS, seed=7, vocab=96, seq=SEQ)
    program = _chained(_xt(), example, pp=2)
    for gm in program.chunks:
        assert _bodies_owned(gm) == _bodies_called(gm) != set()
    rotary = [b for b in chunk_spec(program.chunks[0]).send if not b.grad]
    assert len(rotary) == 1 and rotary[0].shape == (1, 16, 32)  # the rotary table rides along


def test_x_transformers_tensor_parallel():
    """Rotary embeddings run in regions that read the column-parallel q and k: split
    inside them, so attention splits with no tp_plan (a plan keeping it whole still works)."""
    model, example = _xt(), make_batch(MBS, seed=0, vocab=96, seq=SEQ)
    gm = transform(model, example, tp=2, stop_after="tensor_parallel")
    tags = {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}
    for proj in ("to_q", "to_k", "to_v"):
        assert tags[f"net.attn_layers.layers.0.1.{proj}.weight"] == Shard(0, (256,))
    assert tags["net.attn_layers.layers.0.1.to_out.weight"] == Shard(1, (256,))
    assert tags["net.attn_layers.layers.1.1.ff.0.0.weight"] == Shard(0, (128,))
    assert tags["net.token_emb.emb.weight"] == Shard(0, (96,))
    plan = {"net.attn_layers.layers.*.1.to_*": "replicate"}
    gm = transform(model, example, tp=2, stop_after="tensor_parallel", tp_plan=plan)
    tags = {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}
    assert tags["net.attn_layers.layers.0.1.to_q.weight"] == Replicate(False)


# ---------------------------------------------------------------- the loss inside a region


class LossInRegion(Regions):
    """The loss computed in fp32 inside an autocast-disabled region, or inside a bf16
    autocast region (which fxmeg does not look into)."""

    def __init__(self, region: str) -> None:
        super().__init__("after")
        self.loss_region = region

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, torch.ones(x.shape[-1]))
        logits = self.head(self.norm(x))
        if self.loss_region == "autocast":
            with torch.autocast(device_type="cpu", enabled=False):
                return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _loss_in(region: str) -> LossInRegion:
    torch.manual_seed(0)
    return LossInRegion(region)


def test_loss_in_an_autocast_disabled_region_is_inlined_and_trains():
    example = make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ)
    gm = transform(_loss_in("autocast"), example, stop_after="loss")
    assert len(_hops(gm)) == 4 and _bodies_owned(gm) == _bodies_called(gm)  # the blocks' regions
    _train(_loss_in("autocast"), _batches())


def test_loss_in_another_region_is_refused_naming_it():
    with pytest.raises(PassError) as err:
        transform(
            _loss_in("bf16"), make_batch(MBS, seed=0, vocab=VOCAB, seq=SEQ), stop_after="loss"
        )
    msg = str(err.value)
    assert "computed inside a wrap_with_autocast region" in msg and "loss_fn=" in msg
