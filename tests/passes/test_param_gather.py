from expecttest import TestCase

from fxmeg.program import chunks
from tests.helpers import graph_after, make_batch, make_model


def _waits(num_chunks: int) -> str:
    parent = graph_after(make_model("gpt", n_layer=2), make_batch(2, seed=0), "param_gather", num_chunks=num_chunks,
                         dp=2, bucket_size=4000, distributed_optimizer=True, overlap_param_gather=True)
    out = []
    for c, chunk in enumerate(chunks(parent)):
        lines = chunk.code.strip().splitlines()
        waits = [i for i, ln in enumerate(lines) if "wait_param_gather" in ln]
        for i in waits:  # the marker comes right before the first reader of its bucket
            assert "wait_param_gather" not in lines[i + 1]
        out.append(f"# chunk {c}\n" + "\n".join(lines[i].split(";")[0].strip() + "\n  before: " + lines[i + 1].split(" = ")[0].strip() for i in waits))
    return "\n".join(out)


class ParamGather(TestCase):
    def test_one_chunk(self):
        self.assertExpectedInline(_waits(1), """\
# chunk 0
wait_param_gather_0_6 = fxmeg_ops_wait_param_gather(wte_weight, bucket = (0, 6))
  before: embedding
wait_param_gather_0_5 = fxmeg_ops_wait_param_gather(layers_0_attn_qkv_weight, bucket = (0, 5))
  before: linear
wait_param_gather_0_4 = fxmeg_ops_wait_param_gather(layers_0_mlp_fc_weight, bucket = (0, 4))
  before: linear_2
wait_param_gather_0_3 = fxmeg_ops_wait_param_gather(layers_0_mlp_proj_weight, bucket = (0, 3))
  before: linear_3
wait_param_gather_0_2 = fxmeg_ops_wait_param_gather(layers_1_attn_qkv_weight, bucket = (0, 2))
  before: linear_4
wait_param_gather_0_1 = fxmeg_ops_wait_param_gather(layers_1_mlp_fc_weight, bucket = (0, 1))
  before: linear_6
wait_param_gather_0_0 = fxmeg_ops_wait_param_gather(layers_1_mlp_proj_weight, bucket = (0, 0))
  before: linear_7""")

    def test_two_chunks(self):
        self.assertExpectedInline(_waits(2), """\
# chunk 0
wait_param_gather_0_3 = fxmeg_ops_wait_param_gather(wte_weight, bucket = (0, 3))
  before: embedding
wait_param_gather_0_2 = fxmeg_ops_wait_param_gather(layers_0_attn_qkv_weight, bucket = (0, 2))
  before: linear
wait_param_gather_0_1 = fxmeg_ops_wait_param_gather(layers_0_mlp_fc_weight, bucket = (0, 1))
  before: linear_2
wait_param_gather_0_0 = fxmeg_ops_wait_param_gather(layers_0_mlp_proj_weight, bucket = (0, 0))
  before: linear_3
# chunk 1
wait_param_gather_1_4 = fxmeg_ops_wait_param_gather(layers_1_ln_1_weight, bucket = (1, 4))
  before: layer_norm_2
wait_param_gather_1_3 = fxmeg_ops_wait_param_gather(layers_1_attn_qkv_weight, bucket = (1, 3))
  before: linear_4
wait_param_gather_1_2 = fxmeg_ops_wait_param_gather(layers_1_mlp_fc_weight, bucket = (1, 2))
  before: linear_6
wait_param_gather_1_1 = fxmeg_ops_wait_param_gather(layers_1_mlp_proj_weight, bucket = (1, 1))
  before: linear_7
wait_param_gather_1_0 = fxmeg_ops_wait_param_gather(wte_weight, bucket = (1, 0))
  before: linear_8""")
