"""The configuration classes: TrainConfig composes EngineConfig / ParallelConfig, flat
names (flags, config-file keys) map onto the nested fields, dp resolves from the world."""

import argparse
import dataclasses
import os
import re
import tempfile

import pytest
import torch

from fxmeg.config import INTERNAL, SECTIONS, EngineConfig, ParallelConfig, flat_names
from fxmeg.config_sections import DataParallelConfig, GuardsConfig, MoEConfig, RecomputeConfig
from fxmeg.errors import ConfigError
from fxmeg.train.cli import _train_parser, config_from, main
from fxmeg.train.train_config import MEGATRON_NAMES
from fxmeg.train.trainer import TrainConfig, batch_size_schedule, flat_fields


def test_from_flat_round_trips_through_flat():
    cfg = TrainConfig.from_flat(data="x", train_iters=3, micro_batch_size=2, global_batch_size=8,
                                tp=2, pp=2, vpp=2, sequence_parallel=True, precision="bf16",
                                recompute="full", recompute_num_layers=1, lr=0.1)
    assert (cfg.engine.micro_batch_size, cfg.engine.parallel.tp, cfg.engine.parallel.vpp) == (
        2,
        2,
        2,
    )
    assert cfg.engine.parallel.dp is None and cfg.lr == 0.1
    assert TrainConfig.from_flat(**cfg.flat()) == cfg
    assert set(cfg.flat()) == set(flat_fields())
    changed = cfg.replace(tp=1, sequence_parallel=False, lr=0.2)
    assert (changed.engine.parallel.tp, changed.lr, changed.engine.precision) == (1, 0.2, "bf16")


def test_unknown_flat_name_is_refused_naming_the_nearest():
    with pytest.raises(
        ConfigError, match="unknown config key 'micro_bach_size'.*did you mean 'micro_batch_size'"
    ):
        TrainConfig.from_flat(data="x", train_iters=1, micro_bach_size=4)
    with pytest.raises(ConfigError, match="unknown config key 'sequence_paralel' in run.toml"):
        TrainConfig.from_flat("run.toml", data="x", train_iters=1, sequence_paralel=True)
    cfg = TrainConfig.from_flat(data="x", train_iters=1)
    with pytest.raises(ConfigError, match="unknown config key 'tpp'"):
        cfg.replace(tpp=2)


def test_dp_none_resolves_from_the_world_and_a_mismatch_is_refused():
    par = ParallelConfig(tp=2, pp=2)
    assert par.dp is None and par.resolve(8).dp == 2
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp \* pp = 2 \* 2"):
        par.resolve(6)
    with pytest.raises(
        ConfigError, match=r"tp \* pp \* dp = 2 \* 2 \* 1 = 4 does not match the world size 8"
    ):
        dataclasses.replace(par, dp=1).resolve(8)
    with pytest.raises(
        ConfigError,
        match=r"dp=0: data-parallel size must be a positive integer \(got 0\); "
        r"pass dp=1 or more, or None \(world size // \(tp \* cp \* pp\)\)",
    ):
        ParallelConfig(dp=0)


def test_global_batch_rules_run_in_full_when_dp_resolves():
    engine = EngineConfig(micro_batch_size=2, global_batch_size=6, parallel=ParallelConfig())
    with pytest.raises(ConfigError, match="dp is not resolved yet"):
        engine.num_microbatches
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size=6 is not divisible by micro_batch_size \* dp = 2 \* 2 = 4",
    ):
        engine.resolve(2)
    with pytest.raises(
        ConfigError, match="global_batch_size=7 is not divisible by micro_batch_size = 2"
    ):
        EngineConfig(micro_batch_size=2, global_batch_size=7)
    interleaved = EngineConfig(
        micro_batch_size=2, global_batch_size=12, parallel=ParallelConfig(pp=2, vpp=2)
    )
    assert interleaved.resolve(2).num_microbatches == 6  # dp = 1
    with pytest.raises(
        ConfigError, match="needs the micro-batch count m to be a multiple of pp=2; got m=3"
    ):
        interleaved.resolve(4)  # dp = 2


def test_batch_size_schedule_entries_are_checked_with_the_resolved_dp():
    cfg = TrainConfig.from_flat(
        data="x",
        train_iters=1,
        micro_batch_size=2,
        global_batch_size=4,
        pp=2,
        vpp=2,
        step_batch_size_schedule="100:6",
    )
    # dp unknown: multiples of micro_batch_size
    assert batch_size_schedule(cfg) == [(0, 4), (100, 6)]
    with pytest.raises(
        ConfigError, match="step_batch_size_schedule, global batch 6 from 100 samples: .*got m=3"
    ):
        batch_size_schedule(cfg, cfg.engine.resolve(2))


def test_every_cli_flag_maps_to_a_field():
    parser = argparse.ArgumentParser()
    _train_parser(parser)
    # the launcher's own, and --layout auto / --cluster, which choose the layout fields
    launcher = {"help", "config", "nproc", "max_restarts", "layout", "cluster"}
    flags = {a.dest: a.option_strings for a in parser._actions if a.dest not in launcher}
    assert set(flags) == set(flat_fields()) | set(MEGATRON_NAMES)
    for alias, (name, _) in MEGATRON_NAMES.items():
        assert name in flat_fields(), alias
        assert flags[alias] == ["--" + alias.replace("_", "-")]
    for name, (cls, _) in flat_fields().items():
        assert name in {f.name for f in dataclasses.fields(cls)}
        assert "--" + name.replace("_", "-") in flags[name]
    assert {
        "tp",
        "pp",
        "dp",
        "micro_batch_size",
        "recompute_num_layers",
        "lr",
        "trace",
        "broadcast_params",
        "check_replicas_interval",
    } <= set(flags)


def test_train_config_redeclares_no_engine_or_layout_field():
    own = {f.name for f in dataclasses.fields(TrainConfig)}
    for cls in (EngineConfig, *SECTIONS.values()):
        assert not own & {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_the_sections_partition_the_flat_names():
    """Every flat name is one field of EngineConfig or of exactly one section, and every
    field (but the sections themselves and decided_sharding, not an option) is one flat
    name: the map goes both ways, and from_flat / flat round-trip through it."""
    names = flat_names()
    fields = [("", f.name) for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
    fields += [
        (section, f.name)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.name not in INTERNAL
    ]
    assert sorted(fields) == sorted((section, name) for name, section in names.items())
    assert len({name for _, name in fields}) == len(fields)  # no name in two places
    assert INTERNAL == {"decided_sharding"}
    config = EngineConfig.from_flat(
        micro_batch_size=2,
        global_batch_size=8,
        tp=2,
        zero=2,
        recompute="full",
        moe_router_bias_update_rate=0.1,
        p2p="paired",
        on_nonfinite="raise",
        precision="bf16",
    )
    assert (
        config.parallel.tp,
        config.data_parallel.zero,
        config.recomputation.recompute,
        config.pipeline.p2p,
        config.moe.moe_router_bias_update_rate,
        config.guards.on_nonfinite,
        config.precision,
    ) == (2, 2, "full", "paired", 0.1, "raise", "bf16")
    assert EngineConfig.from_flat(**config.flat()) == config and set(config.flat()) == set(names)
    changed = config.replace(zero=3, tp=1, clip_grad=0.5)
    assert (changed.data_parallel.zero, changed.parallel.tp, changed.clip_grad, changed.guards) == (
        3, 1, 0.5, config.guards)


def test_a_misspelt_flat_name_is_refused_with_the_nearest():
    from fxmeg.config import make_config

    example = (torch.zeros(2, 4, dtype=torch.long),)
    for build, message in [
        (
            lambda: EngineConfig.from_flat(
                micro_batch_size=2, global_batch_size=2, recompute_num_layer=1
            ),
            "unknown option 'recompute_num_layer' (did you mean 'recompute_num_layers'?)",
        ),
        (
            lambda: EngineConfig(2, 2).replace(overlap_grad_reduse=False),
            "unknown option 'overlap_grad_reduse' (did you mean 'overlap_grad_reduce'?)",
        ),
        (
            lambda: make_config(example, world=None, moe_capacity_factr=1.0),
            "unknown option 'moe_capacity_factr' (did you mean 'moe_capacity_factor'?)",
        ),
        (
            lambda: TrainConfig.from_flat("run.toml", data="x", train_iters=1, comm_timeout=5.0),
            "unknown config key 'comm_timeout' in run.toml (did you mean 'comm_timeout_s'?)",
        ),
        (  # Megatron's recompute_granularity spells 'none' None: refused by name, no TypeError
            lambda: make_config(example, world=None, recompute=None),
            "recompute=None must be 'none', 'selective' or 'full'",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            build()
        assert str(err.value) == message


def test_parallelize_takes_a_whole_config_and_resolves_dp():
    import fxmeg
    from tests.harness.helpers import make_batch
    from tests.harness.models import make_model

    config = EngineConfig(micro_batch_size=2, global_batch_size=4)
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), config=config)
    assert engine.config.parallel.dp == 1 and engine.config.num_microbatches == 2
    with pytest.raises(ConfigError, match="pass either config= or options, not both"):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), config=config, tp=2)
    with pytest.raises(ConfigError, match="batch dimension is 2, but micro_batch_size=4"):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), config=EngineConfig(4, 8))


def test_zero_bubble_schedules_check_vpp_and_micro_batches():
    assert ParallelConfig(pp=2, schedule="zbh1").placement == (0, 1)
    assert ParallelConfig(pp=3, vpp=2, schedule="zbv").placement == (0, 1, 2, 2, 1, 0)
    assert ParallelConfig(pp=2, vpp=2).placement == (0, 1, 0, 1)  # round robin
    with pytest.raises(
        ConfigError,
        match="schedule='zbv' runs two chunks per pipeline rank in a V: it needs "
        "vpp=2 and pp > 1; got vpp=1, pp=2. Set vpp=2",
    ):
        ParallelConfig(pp=2, schedule="zbv")
    with pytest.raises(ConfigError, match="got vpp=4, pp=2"):
        ParallelConfig(pp=2, vpp=4, schedule="dualpipev")
    with pytest.raises(
        ConfigError,
        match=r"vpp=2 runs only with schedule='interleaved', 'zbv' or 'dualpipev' "
        r"\(got 'zbh1'\); set vpp=1",
    ):
        ParallelConfig(pp=2, vpp=2, schedule="zbh1")
    with pytest.raises(ConfigError, match="schedule='zbh1' needs pp > 1"):
        ParallelConfig(schedule="zbh1")
    assert ParallelConfig(pp=2, schedule="zbh1", max_pending_w=0).max_pending_w == 0
    with pytest.raises(ConfigError, match="schedule='interleaved' defers none: use "
                       "schedule='zbh1', 'zbv' or 'dualpipev', or drop max_pending_w"):
        ParallelConfig(pp=2, vpp=2, max_pending_w=1)
    dual = EngineConfig(
        micro_batch_size=1,
        global_batch_size=8,
        parallel=ParallelConfig(pp=4, vpp=2, schedule="dualpipev"),
    )
    assert dual.resolve(4).num_microbatches == 8
    with pytest.raises(
        ConfigError, match=r"dualpipev schedule needs at least 2 \* pp = 8 micro-batches; got m=4"
    ):
        dual.resolve(8)  # dp = 2
    EngineConfig(
        micro_batch_size=1,
        global_batch_size=3,
        parallel=ParallelConfig(pp=4, vpp=2, schedule="zbv"),
    ).resolve(4)



def test_expert_parallel_folds_over_dp_cp_and_refuses_what_it_does_not_run_with():
    """ep divides dp * cp (checked once dp is known: at construction when given, at resolve
    when None); zero-bubble schedules and compile=True run with ep > 1, alone or together;
    layer-wise optimizer sharding is refused by the configuration, before any process group."""
    import torch

    from fxmeg.config import make_config
    from fxmeg.sharding_modes import OptimizerSharding

    assert (
        ParallelConfig(dp=4, ep=2).edp,
        ParallelConfig(dp=2, cp=2, ep=4).edp,
        ParallelConfig(dp=3).edp,
    ) == (2, 1, 3)
    assert ParallelConfig(ep=4).resolve(8).edp == 2
    with pytest.raises(
        ConfigError,
        match=r"^ep=2 does not divide dp = 3: experts are split over ep ranks carved out "
        r"of the data-parallel ranks; choose ep among \[1, 3\] or launch more ranks",
    ):
        ParallelConfig(dp=3, ep=2)
    with pytest.raises(
        ConfigError,
        match=r"^ep=4 does not divide dp \* cp = 3 \* 2 = 6: .* carved out of the "
        r"data-parallel x context-parallel ranks; choose ep among \[1, 2, 3, 6\]",
    ):
        ParallelConfig(dp=3, cp=2, ep=4)
    par = ParallelConfig(ep=4)  # dp=None: nothing to check until the world is known
    with pytest.raises(ConfigError, match=r"^ep=4 does not divide dp = 6"):
        par.resolve(6)
    example = (torch.zeros(2, 8, dtype=torch.long),)
    with pytest.raises(ConfigError, match=r"^ep=4 does not divide dp = 6"):
        make_config(example, world=6, ep=4)
    with pytest.raises(ConfigError, match=r"^ep=2 does not divide dp = 1"):
        make_config(example, world=None, ep=2)  # a transform without processes takes dp=1

    def engine(**options):
        return EngineConfig.from_flat(micro_batch_size=2, global_batch_size=8, ep=2, **options)

    for schedule, vpp in (("zbh1", 1), ("zbv", 2), ("dualpipev", 2)):
        assert engine(pp=2, vpp=vpp, schedule=schedule).parallel.splits_backward  # runs
        # compiled too: the split experts run eager in the compiled split graphs
        assert engine(pp=2, vpp=vpp, schedule=schedule, compile=True).compile
    assert engine(compile=True).compile  # dropless: the experts run outside compiled graphs
    layerwise = (
        r"^ep=2 does not run with optimizer_sharding='layerwise' yet: "
        r".* use optimizer_sharding='elementwise'"
    )
    with pytest.raises(ConfigError, match=layerwise):
        engine(distributed_optimizer=True, optimizer_sharding="layerwise")
    # 'auto' decided layer-wise (an optimizer such as Muon)
    with pytest.raises(ConfigError, match=layerwise):
        dataclasses.replace(engine(), data_parallel=DataParallelConfig(distributed_optimizer=True,
                                                                       decided_sharding=OptimizerSharding.LAYERWISE))
    with pytest.raises(ConfigError, match=layerwise):
        make_config(
            example, world=2, ep=2, distributed_optimizer=True, optimizer_sharding="layerwise"
        )
    overlap = dict(pp=2, vpp=2, schedule="dualpipev", overlap_moe_expert_parallel_comm=True)
    assert engine(**overlap).moe.overlap_moe_expert_parallel_comm  # runs
    assert engine(**overlap, tp=2, zero=2).moe.overlap_moe_expert_parallel_comm
    for wrong, message in (
        (dict(overlap, schedule="zbv"), r"it needs ep > 1 and schedule='dualpipev'; got ep=2, "
                                        r"schedule='zbv'$"),
        (dict(overlap, compile=True), r"does not run with compile=True: .* set compile=False$"),
    ):
        with pytest.raises(ConfigError, match="^overlap_moe_expert_parallel_comm=True .*"
                                              + message):
            engine(**wrong)
    with pytest.raises(ConfigError, match=r"needs ep > 1 .*; got ep=1, schedule='dualpipev'$"):
        EngineConfig.from_flat(micro_batch_size=2, global_batch_size=8, **overlap)
    for ok in (
        engine(pp=2, schedule="1f1b"),
        engine(pp=2, vpp=2),
        engine(distributed_optimizer=True),
        engine(distributed_optimizer=True, optimizer_sharding="elementwise"),
        engine(dp=2),
    ):
        assert ok.parallel.ep == 2
    assert make_config(example, world=8, cp=2, ep=4).parallel.edp == 2  # dp = 4, dp * cp = 8


# ---------------------------------------------------------------- sizes and numbers

CLASSES = (
    ParallelConfig,
    EngineConfig,
    DataParallelConfig,
    MoEConfig,
    RecomputeConfig,
    GuardsConfig,
    TrainConfig,
)
REQUIRED = {EngineConfig: {"micro_batch_size": 2, "global_batch_size": 4},
            TrainConfig: {"data": "x", "train_iters": 1}}
"""The fields each class cannot be built without."""
CONTEXT = {
    "train_iters": {"train_samples": 8},
    "recompute_num_layers": {"recompute": "full"},
    "global_batch_size": {"micro_batch_size": 1},
    "sft_pad_multiple": {"sft": True, "tokenizer_model": "t"},
    "cp_a2a_size": {"cp": 4, "cp_comm_type": "a2a+p2p"},
    "max_pending_w": {"pp": 2, "schedule": "zbh1"},
}
"""Other fields that a field's least value needs to pass the cross-field rules."""
NONE_CONTEXT = {"cp_a2a_size": {}}
"""Where None needs other fields than the least value (a2a+p2p needs its size given)."""
INTS = {
    f.name: cls
    for cls in CLASSES
    for f in dataclasses.fields(cls)
    if f.type in ("int", "int | None")
}
FLOATS = {
    f.name: cls
    for cls in CLASSES
    for f in dataclasses.fields(cls)
    if f.type in ("float", "float | None")
}


def _build(cls, **values):
    """``cls`` with ``values`` set directly, and a TrainConfig with them set through the
    flat names of `fxmeg train` (flags, config-file keys)."""
    direct = cls(**{**REQUIRED.get(cls, {}), **values})
    flat = TrainConfig.from_flat(**{**REQUIRED[TrainConfig], **values})
    return direct, flat


def _refused(cls, name, value, message):
    """Both ways of setting ``name`` (as ``_build``) fail with a message starting ``message``."""
    for way in (lambda: cls(**{**REQUIRED.get(cls, {}), name: value}),
                lambda: TrainConfig.from_flat(**{**REQUIRED[TrainConfig], name: value})):
        with pytest.raises(ConfigError) as err:
            way()
        assert str(err.value).startswith(message), str(err.value)


def test_every_integer_field_has_a_rule():
    for cls in CLASSES:
        assert set(cls.SIZES) == {n for n, c in INTS.items() if c is cls}, cls.__name__
    assert {"tp", "pp", "vpp", "dp", "micro_batch_size", "bucket_size", "log_interval"} <= set(INTS)


@pytest.mark.parametrize("name", sorted(INTS))
def test_an_integer_field_refuses_a_wrong_type_or_a_too_small_value(name):
    cls = INTS[name]
    size, optional = cls.SIZES[name], cls.__dataclass_fields__[name].type == "int | None"
    least, none = size.minimum, f", or None ({size.none})" if optional else ""
    rule = "a positive integer" if least == 1 else f"an integer >= {least}"
    _refused(
        cls,
        name,
        least - 1,
        f"{name}={least - 1}: {size.what} must be {rule} (got {least - 1}); "
        f"pass {name}={least} or more{none}",
    )
    good = least + 1
    _refused(
        cls,
        name,
        str(good),
        f"{name}='{good}': {size.what} must be an int, got str '{good}'; pass {name}={good}",
    )
    _refused(
        cls,
        name,
        float(good),
        f"{name}={float(good)}: {size.what} must be an int, got float {float(good)}; "
        f"pass {name}={good}",
    )
    _refused(
        cls, name, True, f"{name}=True: {size.what} must be an int, got bool True; pass {name}="
    )
    if not optional:
        _refused(cls, name, None, f"{name}=None: {size.what} must be an int, got NoneType None")
    for value in (least, None) if optional else (least,):
        context = NONE_CONTEXT[name] if value is None and name in NONE_CONTEXT else CONTEXT.get(
            name, {})
        values = {**context, name: value}
        direct, flat = _build(cls, **values)
        assert getattr(direct, name) == value and flat.flat()[name] == value


@pytest.mark.parametrize("name", sorted(FLOATS))
def test_a_float_field_refuses_a_string_or_a_bool(name):
    cls = FLOATS[name]
    _refused(cls, name, "0.5", f"{name}='0.5' must be a number, got str '0.5'; pass {name}=0.5")
    default = cls.__dataclass_fields__[name].default
    _refused(
        cls, name, False, f"{name}=False must be a number, got bool False; pass {name}={default}"
    )


def test_parallelize_refuses_sizes_before_capture():
    import fxmeg
    from tests.harness.helpers import make_batch
    from tests.harness.models import make_model

    model, example = make_model("gpt", n_layer=1), make_batch(2, seed=0)
    for options, message in [
        (
            {"pp": 0},
            "pp=0: pipeline-parallel size must be a positive integer (got 0); pass pp=1 or more",
        ),
        ({"tp": "2"}, "tp='2': tensor-parallel size must be an int, got str '2'; pass tp=2"),
        ({"dp": 0}, "dp=0: data-parallel size must be a positive integer (got 0)"),
        (
            {"micro_batch_size": -1},
            "micro_batch_size=-1: micro-batch size (samples on one rank) must be a positive "
            "integer (got -1)",
        ),
        ({"global_batch_size": 0}, "global_batch_size=0: global batch size"),
        (
            {"bucket_size": 2.5},
            "bucket_size=2.5: gradient bucket size (elements) must be an int, got float 2.5; pass "
            "bucket_size=1, or None",
        ),
    ]:
        for call in (fxmeg.parallelize, fxmeg.transform):
            with pytest.raises(ConfigError, match="^" + re.escape(message)):
                call(model, example, **options)


@pytest.mark.parametrize("source", ["flag", "file"])
def test_fxmeg_train_reports_the_same_size_error(source):
    args = ["train", "--data", "x", "--train-iters", "1"]
    if source == "flag":
        args += ["--pp", "0"]
        message = (
            "pp=0: pipeline-parallel size must be a positive integer (got 0); pass pp=1 or more"
        )
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write('tp = "2"\n')
        args += ["--config", f.name]
        message = "tp='2': tensor-parallel size must be an int, got str '2'; pass tp=2"
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        main(args)


def test_megatron_names_set_the_same_options_and_conflicts_are_refused():
    parser = argparse.ArgumentParser()
    _train_parser(parser)
    common = ["--data", "x", "--train-iters", "10", "--global-batch-size", "8"]
    megatron = config_from(parser.parse_args(common + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16",
        "--use-distributed-optimizer", "--recompute-granularity", "full", "--seq-length", "64",
        "--lr-warmup-iters", "3", "--lr-decay-iters", "9"]))
    ours = config_from(
        parser.parse_args(
            common
            + [
                "--tp",
                "2",
                "--pp",
                "2",
                "--precision",
                "bf16",
                "--distributed-optimizer",
                "--recompute",
                "full",
                "--seq-len",
                "64",
                "--lr-warmup-iters",
                "3",
                "--lr-decay-iters",
                "9",
            ]
        )
    )
    assert megatron == ours
    assert ours.lr_samples(8) == (24, 72, 0)  # Megatron: iterations x the global batch size
    with pytest.raises(
        ConfigError, match="tensor_model_parallel_size=2 .Megatron's name. and tp=4 disagree"
    ):
        config_from(parser.parse_args(common + ["--tensor-model-parallel-size", "2", "--tp", "4"]))
    with pytest.raises(
        ConfigError, match="lr_warmup_iters=3 counts steps, but the run is given in samples"
    ):
        TrainConfig.from_flat(data="x", train_samples=80, lr_warmup_iters=3)
    with pytest.raises(ConfigError, match="lr_decay_iters=3 and lr_decay_samples=8 both set"):
        TrainConfig.from_flat(data="x", train_iters=8, lr_decay_iters=3, lr_decay_samples=8)
    toml = TrainConfig.from_flat(data="x", train_iters=1, tensor_model_parallel_size=2, fp16=True)
    assert (toml.engine.parallel.tp, toml.engine.precision) == (2, "fp16")  # config-file keys too


def test_default_ranks_take_ep_into_account():
    from fxmeg.train.launch import default_ranks

    assert default_ranks(ParallelConfig(ep=2)) == 2  # dp 2, which ep=2 folds over
    assert default_ranks(ParallelConfig(tp=2, pp=2, ep=4)) == 16
    assert default_ranks(ParallelConfig(tp=2, cp=2, ep=4)) == 8  # ep folds over dp * cp = 2 * 2
    assert default_ranks(ParallelConfig(tp=2, dp=3)) == 6
    with pytest.raises(ConfigError, match=r"launch more ranks \(`fxmeg train --dp` / --nproc"):
        ParallelConfig(dp=3, ep=2)


def test_docs_list_every_megatron_name():
    """docs/cli.md's table of Megatron-LM's flags is MEGATRON_NAMES, row for row."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md")).read()
    rows = re.findall(r"^\| `--([a-z0-9-]+)[^`]*` \| `--([a-z-]+) ?([^`]*)` \|$", text, re.M)
    listed = {
        alias.replace("-", "_"): (name.replace("-", "_"), value) for alias, name, value in rows
    }
    want = {alias: (name, switch if isinstance(switch, str) else "") for alias, (name, switch) in
            MEGATRON_NAMES.items()}
    assert {a: n for a, (n, _) in listed.items()} == {a: n for a, (n, _) in want.items()}
    assert all(listed[a][1] == v for a, (_, v) in want.items() if v), listed


def test_engine_config_still_takes_flat_names():
    """The public constructor as before the sections: a flat name lands in its section, a
    section given too is the base it changes, a misspelt name is refused with the nearest."""
    c = EngineConfig(2, 8, zero=1, parallel=ParallelConfig(tp=2), pp=2, recompute="full")
    assert (c.data_parallel.zero, c.parallel.tp, c.parallel.pp) == (1, 2, 2)
    assert c.recomputation.recompute == "full"
    with pytest.raises(ConfigError, match=r"unknown option 'zeroo' \(did you mean 'zero'\?\)"):
        EngineConfig(2, 8, zeroo=1)
