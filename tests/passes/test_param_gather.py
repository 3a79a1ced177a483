from expecttest import TestCase

from fxmeg.ir.program import chunks
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import make_model


def _waits(num_chunks: int) -> str:
    parent = graph_after(
        make_model("gpt", n_layer=2),
        make_batch(2, seed=0),
        "param_gather",
        num_chunks=num_chunks,
        dp=2,
        bucket_size=4000,
        distributed_optimizer=True,
        overlap_param_gather=True,
    )
    out = []
    for c, chunk in enumerate(chunks(parent)):
        lines = chunk.code.strip().splitlines()
        waits = [i for i, ln in enumerate(lines) if "wait_param_gather" in ln]
        for i in waits:  # the marker comes right before the first reader of its bucket
            assert "wait_param_gather" not in lines[i + 1]
        out.append(
            f"# chunk {c}\n"
            + "\n".join(
                lines[i].split(";")[0].strip()
                + "\n  before: "
                + lines[i + 1].split(" = ")[0].strip()
                for i in waits
            )
        )
    return "\n".join(out)


class ParamGather(TestCase):
    def test_one_chunk(self):
        self.assertExpectedInline(_waits(1), """\
# chunk 0
wait_param_gather_0_6 = fxmeg_ir_ops_wait_param_gather(wte_weight, bucket = (0, 6))
  before: embedding
wait_param_gather_0_5 = fxmeg_ir_ops_wait_param_gather(layers_0_attn_qkv_weight, bucket = (0, 5))
  before: linear
wait_param_gather_0_4 = fxmeg_ir_ops_wait_param_gather(layers_0_mlp_fc_weight, bucket = (0, 4))
  before: linear_2
wait_param_gather_0_3 = fxmeg_ir_ops_wait_param_gather(layers_0_mlp_proj_weight, bucket = (0, 3))
  before: linear_3
wait_param_gather_0_2 = fxmeg_ir_ops_wait_param_gather(layers_1_attn_qkv_weight, bucket = (0, 2))
  before: linear_4
wait_param_gather_0_1 = fxmeg_ir_ops_wait_param_gather(layers_1_mlp_fc_weight, bucket = (0, 1))
  before: linear_6
wait_param_gather_0_0 = fxmeg_ir_ops_wait_param_gather(layers_1_mlp_proj_weight, bucket = (0, 0))
  before: linear_7""")

    def test_two_chunks(self):
        self.assertExpectedInline(_waits(2), """\
# chunk 0
wait_param_gather_0_3 = fxmeg_ir_ops_wait_param_gather(wte_weight, bucket = (0, 3))
  before: embedding
wait_param_gather_0_2 = fxmeg_ir_ops_wait_param_gather(layers_0_attn_qkv_weight, bucket = (0, 2))
  before: linear
wait_param_gather_0_1 = fxmeg_ir_ops_wait_param_gather(layers_0_mlp_fc_weight, bucket = (0, 1))
  before: linear_2
wait_param_gather_0_0 = fxmeg_ir_ops_wait_param_gather(layers_0_mlp_proj_weight, bucket = (0, 0))
  before: linear_3
# chunk 1
wait_param_gather_1_4 = fxmeg_ir_ops_wait_param_gather(layers_1_ln_1_weight, bucket = (1, 4))
  before: layer_norm_2
wait_param_gather_1_3 = fxmeg_ir_ops_wait_param_gather(layers_1_attn_qkv_weight, bucket = (1, 3))
  before: linear_4
wait_param_gather_1_2 = fxmeg_ir_ops_wait_param_gather(layers_1_mlp_fc_weight, bucket = (1, 2))
  before: linear_6
wait_param_gather_1_1 = fxmeg_ir_ops_wait_param_gather(layers_1_mlp_proj_weight, bucket = (1, 1))
  before: linear_7
wait_param_gather_1_0 = fxmeg_ir_ops_wait_param_gather(wte_weight, bucket = (1, 0))
  before: linear_8""")


def _zero3(model) -> str:
    """zero=3's markers of a one-chunk graph: each gather with the node it precedes, each
    release with the node it follows."""
    parent = graph_after(model, make_batch(2, seed=0), "param_gather", dp=2, zero=3)
    (chunk,) = chunks(parent)
    lines = [ln.split(";")[0].strip() for ln in chunk.code.strip().splitlines()]
    out = []
    for i, ln in enumerate(lines):
        if "zero_gather" in ln:
            out.append(ln + "\n  before: " + lines[i + 1].split(" = ")[0])
        elif "zero_release" in ln:
            out.append(ln + "\n  after: " + lines[i - 1].split(" = ")[0])
    return "\n".join(out)


class Zero3(TestCase):
    def test_a_bucket_per_block_gathered_before_and_released_after_its_readers(self):
        """The tied embedding (wte, read again by the head, whose read becomes
        ``early_linear``) stays whole to the end of forward."""
        self.assertExpectedInline(_zero3(make_model("gpt", n_layer=2)), """\
zero_gather_0_3 = fxmeg_ir_ops_zero_gather(wte_weight, bucket = (0, 3), prefetch = (0, 2))
  before: embedding
zero_gather_0_2 = fxmeg_ir_ops_zero_gather(layers_0_ln_1_weight, bucket = (0, 2), prefetch = (0, 1))
  before: layer_norm
zero_release_0_2 = fxmeg_ir_ops_zero_release(layers_0_ln_1_weight, bucket = (0, 2))
  after: linear_3
zero_gather_0_1 = fxmeg_ir_ops_zero_gather(layers_1_ln_1_weight, bucket = (0, 1), prefetch = (0, 0))
  before: layer_norm_2
zero_release_0_1 = fxmeg_ir_ops_zero_release(layers_1_ln_1_weight, bucket = (0, 1))
  after: linear_7
zero_gather_0_0 = fxmeg_ir_ops_zero_gather(ln_f_weight, bucket = (0, 0), prefetch = None)
  before: layer_norm_4
zero_release_0_0 = fxmeg_ir_ops_zero_release(ln_f_weight, bucket = (0, 0))
  after: layer_norm_4
zero_release_0_3 = fxmeg_ir_ops_zero_release(wte_weight, bucket = (0, 3))
  after: early_linear""")

    def test_a_release_follows_the_last_reader_of_a_view(self):
        """Each block reads ``w.t()`` twice and ``scale.view(...)`` last (``mul``)."""
        from tests.parity.test_zero import _view_model

        self.assertExpectedInline(_zero3(_view_model()), """\
zero_gather_0_4 = fxmeg_ir_ops_zero_gather(emb_weight, bucket = (0, 4), prefetch = (0, 3))
  before: embedding
zero_release_0_4 = fxmeg_ir_ops_zero_release(emb_weight, bucket = (0, 4))
  after: embedding
zero_gather_0_3 = fxmeg_ir_ops_zero_gather(layers_0_w, bucket = (0, 3), prefetch = (0, 2))
  before: t
zero_release_0_3 = fxmeg_ir_ops_zero_release(layers_0_w, bucket = (0, 3))
  after: mul
zero_gather_0_2 = fxmeg_ir_ops_zero_gather(layers_1_w, bucket = (0, 2), prefetch = (0, 1))
  before: t_1
zero_release_0_2 = fxmeg_ir_ops_zero_release(layers_1_w, bucket = (0, 2))
  after: mul_1
zero_gather_0_1 = fxmeg_ir_ops_zero_gather(layers_2_w, bucket = (0, 1), prefetch = (0, 0))
  before: t_2
zero_release_0_1 = fxmeg_ir_ops_zero_release(layers_2_w, bucket = (0, 1))
  after: mul_2
zero_gather_0_0 = fxmeg_ir_ops_zero_gather(head_weight, bucket = (0, 0), prefetch = None)
  before: linear
zero_release_0_0 = fxmeg_ir_ops_zero_release(head_weight, bucket = (0, 0))
  after: linear""")
