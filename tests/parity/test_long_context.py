"""Context parallelism's exchanged attentions (``cp_comm_type`` p2p, a2a, a2a+p2p; issue 48)
on real gloo ranks vs plain single-device PyTorch: every step's loss and grad norm, every
parameter's gradient at every step (the float64 rule where it is off) and the final weights.

- Hugging Face's Llama (8 query heads, 4 key/value heads) and Qwen3 (per-head q/k norms), at
  cp2 (p2p, a2a) and cp4 (p2p, a2a, a2a+p2p with all-to-all inside pairs); grouped-query
  attention in every case;
- the composition: cp2 x dp2 with the distributed optimizer, cp2 x tp2 with sequence
  parallelism, cp2 x ep2 (a mixture of experts, experts folded over the cp ranks),
  cp2 x tp2 x pp2 under ZB-H1 (8 ranks), selective recompute (the ring in its region) and
  compiled chunks;
- masks: a sliding window and no mask (an encoder) through the ring and the all-to-all,
  left-padded dict batches (the padding mask whole on every rank) through the ring;
  Megatron's document masks (--reset-attention-mask) are in test_keyword_batches' spawn,
  bf16 in test_mixed_precision's;
- the ops themselves (``cp_ring_attention``, ``cp_to_heads`` / ``cp_from_heads``) against
  whole-sequence SDPA in float64, values and gradients, causal, documents, a window, a float
  mask and none, at cp2 and cp4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import fxmeg
from fxmeg.ir.ops import cp_positions
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    Run,
    assert_run_close,
    first_failure,
    optimizer,
    reference_run,
    trained,
)
from tests.parity.scenarios import Scenario, check_parity, train_each
from tests.parity.test_context_parallel import PADDED_MBS, Padded, window_batches
from tests.passes.test_context_parallel import _Encoder, _Window

H8 = (("heads", 8), ("kv_heads", 4))
M = 2  # micro-batches per step, for the suite's time (each step still accumulates two)


class _TwoHeads(_Window):
    """_Window's sliding window (or, ``window=False``, _Encoder's no mask) over 2 heads:
    the all-to-all splits them."""

    window = True

    def forward(self, ids, labels):
        b, s = ids.shape
        h = self.layers[0](ids).view(b, s, 2, 64).transpose(1, 2)
        ones = torch.ones(s, s, dtype=torch.bool, device=ids.device)
        mask = ones.tril() & ~ones.tril(-4) if self.window else None
        h = F.scaled_dot_product_attention(h, h, h, attn_mask=mask)
        return F.cross_entropy(h.transpose(1, 2).reshape(b, s, 128).flatten(0, 1), labels.flatten())


class _TwoHeadEncoder(_TwoHeads):
    window = False  # a2a at cp4 (and cp2 x tp2) splits 4 key/value heads


def mode(name: str, **more) -> tuple:
    extra = (("cp_a2a_size", 2),) if name == "a2a+p2p" else ()
    return (("cp_comm_type", name), *extra, *more.items())


def _models(cp: int, modes: tuple[str, ...]) -> list[Scenario]:
    return [Scenario(m, cp=cp, m=M, options=mode(c),
                     model_args=H8 if m == "hf-llama" or cp == 4 else ())
            for m in ("hf-llama", "hf-qwen3") for c in modes]


PARITY = (
    _models(2, ("p2p", "a2a"))
    + [
        Scenario("llama", cp=2, m=M, options=mode("p2p", recompute="selective")),
        Scenario("llama", cp=2, m=M, options=mode("p2p", compile=True)),
        Scenario("moe-qwen3_moe", cp=2, m=M, options=mode("p2p", ep=2)),  # experts over cp
    ]
    + _models(4, ("p2p", "a2a", "a2a+p2p"))
    + [
        Scenario("gpt", cp=2, dp=2, m=M, options=mode("p2p", distributed_optimizer=True)),
        Scenario("llama", cp=2, tp=2, m=M, options=mode("p2p", sequence_parallel=True)),
        # 8 ranks
        *(Scenario("hf-llama", cp=2, tp=2, pp=2, m=M, schedule="zbh1", options=mode(c),
                   model_args=H8) for c in ("p2p", "a2a")),
    ]
)
MASKED = [(_Window, "p2p"), (_Encoder, "p2p"), (_TwoHeads, "a2a"), (_TwoHeadEncoder, "a2a")]
PADDED = Padded("left", "sdpa")


def masked(rank: int, model, comm: str) -> dict:
    """A sliding-window SDPA, or one with no mask at all, at cp=2 under ``comm``: ``trained``'s
    report (every step's gradients, on rank 0)."""
    torch.manual_seed(0)
    batches = window_batches()
    engine = fxmeg.parallelize(model(), tuple(t[:2] for t in batches[0]), cp=2,
                               global_batch_size=8, optimizer=optimizer, cp_comm_type=comm)
    return trained(engine, batches, rank)


def padded_p2p(rank: int) -> dict:
    data = PADDED.batches()
    engine = fxmeg.parallelize(PADDED.model(), {k: t[:PADDED_MBS] for k, t in data[0].items()},
                               cp=2, global_batch_size=PADDED.gbs, optimizer=optimizer,
                               cp_comm_type="p2p")
    return trained(engine, data, rank)


class _Positional(transformers.LlamaForCausalLM):
    """PADDED's Llama called as ``reference_run`` calls a model, ``(inputs, labels)``, its
    parameters' names unchanged: a dict batch's input_ids, attention_mask and position_ids
    stacked in ``inputs`` (rows, 3, seq), rows first, so that the judge's row permutations
    move a row's mask and positions with it."""

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ids, mask, positions = inputs.unbind(1)
        return super().forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                               labels=labels, use_cache=False).loss


def padded_reference() -> Run:
    """Single-device training of PADDED's model on its dict batches: ``train_dicts``' loss,
    optimizer and clipping, as a ``Run`` with its judge of rounding."""
    model = PADDED.model()
    model.__class__ = _Positional  # the same module; only forward's signature differs
    keys = ("input_ids", "attention_mask", "position_ids")
    return reference_run(model, [(torch.stack([b[k] for k in keys], 1), b["labels"])
                                 for b in PADDED.batches()])


def _mask(kind: str, seq: int) -> tuple[torch.Tensor | None, bool]:
    """(a whole mask, causal) of each kind the ops take."""
    pos = torch.arange(seq)
    if kind == "documents":  # three documents packed in one window
        doc = (pos >= 5).long() + (pos >= 18).long()
        return (doc[:, None] == doc[None, :]).view(1, 1, seq, seq), True
    if kind == "window":
        return ((pos[:, None] - pos[None, :]) < 6).view(1, 1, seq, seq), True
    if kind == "float":
        return torch.randn(2, 1, seq, seq, dtype=torch.float64, generator=torch.Generator()
                           .manual_seed(3)), False
    return None, kind == "causal"


def ops_against_sdpa(rank: int) -> dict:
    """Every exchanged attention this world's cp size allows, of this rank's rows, against
    SDPA over the whole sequence (float64: the two may differ by rounding only). The ring's
    blocks are computed in pieces of 2 KiB of scores (a few rows each): the models' parity
    runs compute them whole."""
    from fxmeg.runtime import ring_attention

    ring_attention.PIECE_BYTES = 2048
    ops, group, cp = torch.ops.fxmeg, dist.group.WORLD.group_name, dist.get_world_size()
    seq, out = 32, {}
    mine = torch.tensor(cp_positions(seq, cp, rank))
    for kv_heads in (4, 2):
        for kind in ("causal", "documents", "window", "float", "none"):
            for inner in [i for i in (1, 2, 4) if i <= cp and kv_heads % i == 0 and cp % i == 0]:
                torch.manual_seed(0)
                q = torch.randn(2, 4, seq, 8, dtype=torch.float64, requires_grad=True)
                k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
                        for _ in range(2))
                mask, causal = _mask(kind, seq)
                whole = mask
                if causal:
                    tri = torch.ones(seq, seq, dtype=torch.bool).tril()
                    whole = tri if mask is None else tri & mask
                gqa = kv_heads < 4
                full = F.scaled_dot_product_attention(q, k, v, attn_mask=whole, enable_gqa=gqa)
                grad = torch.randn_like(full)
                full.backward(grad)
                ql, kl, vl = (t.detach()[:, :, mine].requires_grad_() for t in (q, k, v))
                qh, kh, vh = ((ops.cp_to_heads(t, 2, cp, inner, group) for t in (ql, kl, vl))
                              if inner > 1 else (ql, kl, vl))
                if inner == cp:  # a2a: SDPA over the whole sequence, 1/cp of the heads
                    y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=whole,
                                                       enable_gqa=gqa)
                else:
                    y, _ = ops.cp_ring_attention(qh, kh, vh, mask, causal, None, gqa, cp, inner,
                                                 group)
                y = ops.cp_from_heads(y, 2, cp, inner, group) if inner > 1 else y
                y.backward(grad[:, :, mine])
                out[(kv_heads, kind, inner)] = [
                    (name, a, b[:, :, mine]) for name, a, b in (
                        ("out", y, full), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                        ("dv", vl.grad, v.grad))]
    return out


def run(rank: int, scenarios: list[Scenario]) -> dict:
    out = train_each(rank, scenarios)
    world = dist.get_world_size()
    if world in (2, 4):
        out["ops"] = ops_against_sdpa(rank)
    if world == 2:
        out["masked"] = {(m.__name__, c): masked(rank, m, c) for m, c in MASKED}
        out["padded"] = padded_p2p(rank)
    return out


@pytest.fixture(scope="module")
def results():
    by_world = {w: [s for s in PARITY if s.world == w] for w in sorted({s.world for s in PARITY})}
    assert list(by_world) == [2, 4, 8]  # one spawn per world size
    return {w: run_world(w, run, scenarios) for w, scenarios in by_world.items()}


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_matches_single_device(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize("world", [2, 4])
def test_exchanged_attention_ops_match_whole_sequence_attention(results, world):
    cases = results[world][0]["ops"]
    assert {inner for _, _, inner in cases} == ({1, 2} if world == 2 else {1, 2, 4})
    for r in results[world]:
        for case, checks in r["ops"].items():
            for name, got, want in checks:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12,
                                           msg=lambda m, c=case, n=name: f"{c} {n}: {m}")


@pytest.mark.parametrize("model,comm", MASKED, ids=lambda x: getattr(x, "__name__", x))
def test_a_window_or_no_mask_matches_single_device(results, model, comm):
    """Every step's loss, grad norm and gradients, and the final weights (the ranks agree)."""
    torch.manual_seed(0)
    plain, batches = model(), window_batches()
    result = first_failure([r["masked"][(model.__name__, comm)] for r in results[2]])
    assert_run_close(result, reference_run(plain, batches))


def test_left_padded_batches_through_the_ring_match_single_device(results):
    """Every step's loss, grad norm and gradients, and the final weights (the ranks agree)."""
    result = first_failure([r["padded"] for r in results[2]])
    assert_run_close(result, padded_reference())
