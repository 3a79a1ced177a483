"""`fxmeg plan` on the command line: fxmeg and Hugging Face models, experts, --device-memory
and its verdict, the header and progress (the planner itself: tests/diagnostics/test_plan.py)."""

import json
import re

import pytest
import torch
import torch.distributed as dist

import fxmeg
from fxmeg.errors import ConfigError
from fxmeg.train.cli import main
from models.llama import Llama, LlamaConfig
from tests.diagnostics.test_plan import moe_example
from tests.harness.models import MOE


def _mixtral_args(layers: int = 4) -> list[str]:
    """Mixtral-8x7B's shape, narrowed (docs/cli.md plans the real one): 8 experts, top 2,
    GQA 4:1, SwiGLU experts 3.5x wide."""
    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=224,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    return [
        "--hf-config",
        "MixtralConfig",
        *(f"{k}={v}" for k, v in small.items()),
        "--seq-len",
        "128",
        "--pp",
        "2",
        "--dp",
        "2",
        "--global-batch-size",
        "8",
        "--precision",
        "bf16",
    ]


def test_cli_plans_an_fxmeg_model_as_the_python_api_does(capsys):
    args = {
        "vocab_size": 256,
        "n_layer": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_kv_head": 2,
        "ffn_hidden": 128,
    }
    assert (
        main(
            [
                "plan",
                "--model",
                "models.llama:Llama",
                "--model-args",
                json.dumps(args),
                "--seq-len",
                "32",
                "--tp",
                "2",
                "--pp",
                "2",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "8",
                "--precision",
                "bf16",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    ids = torch.zeros((2, 32), dtype=torch.long)
    want = fxmeg.plan(Llama(LlamaConfig(seq_len=32, **args)), (ids, ids.clone()), tp=2, pp=2,
                      global_batch_size=8, precision="bf16")
    assert got == json.loads(want.to_json())
    assert not dist.is_initialized()


def test_cli_builds_hugging_face_models_from_a_json_file_or_a_config_class(tmp_path, capsys):
    import transformers as T

    small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, **small}))
    layout = [
        "--seq-len",
        "32",
        "--pp",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--json",
    ]
    assert main(["plan", "--hf-config", str(path), "num_hidden_layers=4", *layout]) == 0
    from_file = json.loads(capsys.readouterr().out)
    pairs = [f"{k}={v}" for k, v in small.items()]
    assert main(["plan", "--hf-config", "LlamaConfig", "num_hidden_layers=4", *pairs, *layout]) == 0
    assert json.loads(capsys.readouterr().out) == from_file
    real = T.AutoModelForCausalLM.from_config(T.LlamaConfig(num_hidden_layers=4, **small))
    assert from_file["total_parameters"] == sum(p.numel() for p in real.parameters())
    with pytest.raises(ConfigError, match="neither a JSON file"):
        main(["plan", "--hf-config", "NoSuchConfig", *layout])


def test_cli_plans_a_mixture_of_experts_at_ep_with_an_experts_column(capsys):
    import transformers as T

    small = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        **MOE["mixtral"],
    )
    pairs = [f"{k}={v}" for k, v in small.items()]
    assert (
        main(
            [
                "plan",
                "--hf-config",
                "MixtralConfig",
                *pairs,
                "--seq-len",
                "16",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "4",
                "--dp",
                "2",
                "--ep",
                "2",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(T.MixtralConfig(**small))
    want = fxmeg.plan(model, moe_example(), dp=2, ep=2, global_batch_size=4)
    assert got == json.loads(want.to_json())
    assert got["layout"]["ep"] == 2 and got["stages"][0]["expert_parameter_elements"] > 0
    table = str(want).splitlines()
    head, columns, row = table[0], table[3], table[4]
    assert "dp=2 = 2 ranks; vpp=1 ep=2," in head
    assert columns.split()[:4] == ["stage", "units", "params", "experts"]
    assert row.split()[3] == "18.4K"  # 2 layers x 2 of 4 experts x (96 x 32 + 32 x 48)


def test_device_memory_says_which_stages_exceed_and_what_would_make_them_fit(capsys):
    assert main(["plan", *_mixtral_args(), "--json", "--quiet"]) == 0
    totals = [s["total"] for s in json.loads(capsys.readouterr().out)["stages"]]
    device = (totals[0] + totals[1]) // 2  # one stage above, one below
    assert (
        main(["plan", *_mixtral_args(), "--json", "--quiet", "--device-memory", f"{device}B"]) == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert got["device_memory"] == device and got["ranks"] == 4
    for row, total in zip(got["verdict"], totals):
        assert row["fits"] == (total <= device) and row["free"] == device - total
    worse = max(range(2), key=lambda i: totals[i])
    remedies = {r["change"].split(" (")[0]: r for r in got["verdict"][worse]["remedies"]}
    saves = [r["saves"] for r in got["verdict"][worse]["remedies"]]
    assert saves == sorted(saves, reverse=True) and all(
        r["fits"] == (r["total"] <= device) for r in remedies.values()
    )
    # each prediction against planning the changed layout (the plan's own numbers: exact
    # for the optimizer; recompute and micro-batch size within what they neglect)
    replanned = {
        "--distributed-optimizer": ["--distributed-optimizer"],
        "--recompute full": ["--recompute", "full"],
    }
    for change, flags in replanned.items():
        assert main(["plan", *_mixtral_args(), "--json", "--quiet", *flags]) == 0
        actual = json.loads(capsys.readouterr().out)["stages"][worse]["total"]
        assert abs(remedies[change]["total"] - actual) <= 0.02 * actual, (
            change,
            remedies[change],
            actual,
        )
    # the text: a line per stage, the excess in GiB
    assert main(["plan", *_mixtral_args(), "--quiet", "--device-memory", f"{device}B"]) == 0
    text = capsys.readouterr().out
    assert f"stage {worse}: " in text and "exceeds by" in text and "fits (" in text
    assert "--distributed-optimizer (optimizer state / 2): saves" in text


@pytest.mark.parametrize(
    "text,want",
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("79.6GiB", int(79.6 * 2**30)),
        ("h100", 81559 * 2**20),
        ("H200", 143771 * 2**20),
    ],
)
def test_device_memory_sizes_and_presets(text, want):
    from fxmeg.diagnostics.devices import device_bytes

    assert device_bytes(text) == want
    with pytest.raises(ConfigError, match="h100, h200, a100-40gb, a100-80gb"):
        device_bytes("80 furlongs")


def test_header_names_the_ranks_and_the_bubble_in_words_and_progress_goes_to_stderr(capsys):
    args = {
        "vocab_size": 256,
        "n_layer": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_kv_head": 2,
        "ffn_hidden": 128,
    }
    assert (
        main(
            [
                "plan",
                "--model",
                "models.llama:Llama",
                "--model-args",
                json.dumps(args),
                "--seq-len",
                "32",
                "--tp",
                "2",
                "--pp",
                "2",
                "--dp",
                "2",
                "--global-batch-size",
                "8",
                "--split-points",
                "layers.1",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "tp=2 x cp=1 x pp=2 x dp=2 = 8 ranks" in out
    assert re.search(
        r"pipeline bubble: \d+\.\d% of the step \(schedule 1f1b, 4 micro-batches; a backward "
        r"costs 2 forwards\)",
        out,
    )  # 8 / (dp=2 x micro-batches of 1, plan's default)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s+layers", line)]
    assert [r[1] for r in rows] == ["layers.0", "layers.1..lm_head"]  # pinned
    assert "capture" in err and "accounting stage 1 of 2" in err
    assert all(len(line) < 80 for line in err.splitlines())
