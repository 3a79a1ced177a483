"""`fxmeg plan`: one layout's per-stage memory, FLOPs and bubble (fxmeg/diagnostics/layout_plan.py)
or, with --search, every layout fxmeg accepts on a cluster, ranked (fxmeg/planner/), and the
model built on the meta device for both, which `fxmeg train --layout auto` uses too."""

from __future__ import annotations

import argparse

from fxmeg.train.flags import flags, read_config

PLAN_MODEL = ("model", "model_args", "seq_len")
"""The trainer's own flat names `fxmeg plan` reads (the rest: engine and layout names)."""
PLAN_MICRO_BATCH = 1
"""`fxmeg plan`'s micro-batch size when neither the flag nor --config gives one: Megatron's
default, and what long sequences train with (train's default of 4 at seq 8192 planned 4x
the activations anyone runs)."""


def arguments(p: argparse.ArgumentParser) -> None:
    """`fxmeg plan`'s flags: the model and layout flags of `fxmeg train`, and the search's."""
    from fxmeg.train.train_config import TrainConfig, flat_fields

    p.add_argument(
        "--config",
        help="a `fxmeg train` TOML or YAML file: its model and layout keys are "
        "read, the trainer's other keys ignored (flags override it)",
    )
    p.add_argument(
        "--hf-config",
        nargs="+",
        metavar="NAME_OR_JSON",
        help="a Hugging Face causal LM instead of --model: a config.json file, a transformers "
        "config class (LlamaConfig) or model type (llama), then KEY=VALUE overrides "
        "(values read as JSON), e.g. LlamaConfig num_hidden_layers=80 hidden_size=8192",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--device-memory",
        metavar="SIZE_OR_DEVICE",
        help="one rank's device memory: a size (80GB = 80e9 bytes, 80GiB, 79.6GiB) or a device "
        "(h100: 79.6 GiB, h200: 140.4 GiB, a100-40gb: 40 GiB, a100-80gb: 80 GiB, as "
        "nvidia-smi reports them); says per stage 'fits' or 'exceeds by', and what would "
        "make a stage that exceeds fit",
    )
    p.add_argument(
        "--split-points",
        nargs="+",
        metavar="UNIT",
        help="pin the pipeline cuts: the first unit of every chunk but the first, pp * vpp - 1 "
        "of them, e.g. model.layers.20 model.layers.40 model.layers.60 (default: balanced "
        "at block boundaries)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--search",
        action="store_true",
        help="search every layout fxmeg accepts on --cluster and print the fastest that fit, "
        "with predicted step time, tokens/s, MFU, peak memory per rank and where the time goes "
        "(docs/planner.md); layout flags given too are your layout, ranked beside them",
    )
    p.add_argument(
        "--cluster",
        default="local",
        metavar="PRESET[:KEY=VALUE,...]|FILE.json",
        help="with --search: h100, h200, a100 (8-GPU nodes) or local (this machine, measured once "
        "and cached), e.g. h100:nodes=128 or h200:nodes=4,memory=120GiB (docs/planner.md lists "
        "the keys)",
    )
    p.add_argument("--top", type=int, default=10, help="with --search: layouts to print")
    flags(
        p,
        [n for n, (cls, _) in flat_fields().items() if cls is not TrainConfig or n in PLAN_MODEL],
        defaults={
            "micro_batch_size": f"{PLAN_MICRO_BATCH}, Megatron's --micro-batch-size default; "
            "`fxmeg train`'s is 4"
        },
    )


def run(args) -> int:
    """`fxmeg plan`: build the model on the meta device, print its Plan (with --search,
    the fastest layouts: ``_search``)."""
    from fxmeg.diagnostics.devices import device_bytes
    from fxmeg.diagnostics.layout_plan import plan, stderr_progress
    from fxmeg.train.train_config import engine_from_flat, flat_defaults

    device = device_bytes(args.device_memory) if args.device_memory else None
    values = _plan_values(args)
    model = {k: values.pop(k, flat_defaults()[k]) for k in PLAN_MODEL}
    if args.search:
        return _search(args, model, values, device)
    engine = engine_from_flat(**values)
    if args.split_points:
        import dataclasses

        engine = dataclasses.replace(engine, parallel=dataclasses.replace(
            engine.parallel, split_points=tuple(args.split_points)))
    net, example = _meta_model(args, model, engine.micro_batch_size)
    result = plan(net, example, config=engine, device_memory=device,
                  progress=None if args.quiet else stderr_progress())
    print(result.to_json() if args.json else result)
    return 0


def _meta_model(args, model: dict, micro_batch_size: int):
    """(the model built on meta from --model / --hf-config, one example micro-batch)."""
    import json

    import torch

    from fxmeg.interop.hugging_face import config_from_spec, is_hugging_face, keyword_batch
    from fxmeg.train.build import build_model

    with torch.device("meta"):
        if getattr(args, "hf_config", None):
            import transformers

            net = transformers.AutoModelForCausalLM.from_config(config_from_spec(args.hf_config))
        else:
            extra = model["model_args"]
            extra = extra if isinstance(extra, dict) else json.loads(extra)
            net = build_model(model["model"], {"seq_len": model["seq_len"]} | extra)
    shape = (micro_batch_size, model["seq_len"])
    ids, labels = (torch.zeros(shape, dtype=torch.long, device="meta") for _ in range(2))
    # a Hugging Face model takes the trainer's keyword batch (positionally, labels would
    # land on its second parameter, attention_mask)
    return net, keyword_batch(ids, labels) if is_hugging_face(net) else (ids, labels)


LAYOUT_NAMES = ("tp", "sequence_parallel", "cp", "ep", "pp", "vpp", "schedule", "dp", "zero",
                "distributed_optimizer", "recompute", "micro_batch_size")
"""The flat names a search varies: given with --search, they are the user's own layout."""


def _search(args, model: dict, values: dict, device: int | None) -> int:
    """`fxmeg plan --search`: every layout on --cluster, the fastest that fit."""
    import json

    from fxmeg.diagnostics.layout_plan import stderr_progress
    from fxmeg.errors import ConfigError
    from fxmeg.planner import report
    from fxmeg.planner.cluster import cluster
    from fxmeg.planner.search import Layout, search
    from fxmeg.train.train_config import engine_from_flat, flat_defaults

    given = args.micro_batch_size is not None or any(
        getattr(args, n, None) is not None for n in LAYOUT_NAMES)
    gbs = values.get("global_batch_size")
    if gbs is None:
        raise ConfigError("fxmeg plan --search needs --global-batch-size (samples per step): the "
                          "layouts it compares must train the same batch")
    found = cluster(args.cluster)
    precision = values.get("precision", flat_defaults()["precision"])
    shared = {k: v for k, v in values.items() if k not in LAYOUT_NAMES and k not in (
        "global_batch_size", "precision")}
    mine = None
    if given:
        mine = Layout.of(engine_from_flat(**values).resolve(found.ranks))
    net, example = _meta_model(args, model, 1)
    progress = None if args.quiet else stderr_progress()
    result = search(net, example, cluster=found, global_batch_size=gbs, precision=precision,
                    layout=mine, memory=device, options=shared, progress=progress)
    print(json.dumps(report.to_dict(result, args.top), indent=1) if args.json
          else report.text(result, args.top))
    return 0 if result.ranked else 2


def _plan_values(args) -> dict:
    """Flat names from --config (the trainer's own keys but the model's dropped), then
    the flags given."""
    from fxmeg.errors import ConfigError, closest
    from fxmeg.train.train_config import MEGATRON_NAMES, TrainConfig, flat_fields, from_megatron

    names, values = flat_fields(), {}
    read = from_megatron({key.replace("-", "_"): value for key, value in
                          (read_config(args.config) if args.config else {}).items()})
    for key, value in read.items():
        if key not in names:
            raise ConfigError(f"unknown config key {key!r} in {args.config}" + closest(key, names))
        if names[key][0] is not TrainConfig or key in PLAN_MODEL:
            values[key] = value
    given = {
        k: v for k, v in vars(args).items() if (k in names or k in MEGATRON_NAMES) and v is not None
    }
    values |= from_megatron(given)  # a flag overrides the file
    values.setdefault("micro_batch_size", PLAN_MICRO_BATCH)
    return values


def auto_layout(args, cfg):
    """`fxmeg train --layout auto`: search the layouts of ``cfg``'s model on --cluster for
    the ranks the run launches (--nproc, default the cluster's), the layout names given
    (flags or --config) kept fixed, and return ``cfg`` with the fastest that fits and its
    predicted step time (``predicted_step_s``: the first logs show it beside the measured).
    Says on stdout which layout it chose and what it predicted."""
    import os

    from fxmeg.diagnostics.layout_plan import human_bytes, stderr_progress
    from fxmeg.errors import ConfigError
    from fxmeg.planner import report
    from fxmeg.planner.cluster import cluster
    from fxmeg.planner.search import search
    from fxmeg.train.train_config import MEGATRON_NAMES, from_megatron

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError("--layout auto searches before it starts the ranks: run fxmeg train "
                          "--layout auto without torchrun (add --nproc N for N ranks)")
    if cfg.engine.parallel.max_pending_w is not None:
        raise ConfigError("--layout auto sets max_pending_w itself (where a zero-bubble layout "
                          "fits only deferring fewer Ws): drop --max-pending-w, or give the "
                          "whole layout without --layout auto")
    found = _ranks(cluster(args.cluster), args.nproc)
    written = from_megatron({key.replace("-", "_"): value for key, value in
                             (read_config(args.config) if args.config else {}).items()})
    given = from_megatron({n: getattr(args, n) for n in [*LAYOUT_NAMES, *MEGATRON_NAMES]
                           if getattr(args, n, None) is not None})  # --tp or Megatron's name
    fixed = {n: v for n, v in (written | given).items()
             if n in LAYOUT_NAMES and n != "distributed_optimizer"
             and not (n == "schedule" and v == "auto")}
    model = {"model": cfg.model, "model_args": cfg.model_args, "seq_len": cfg.seq_len}
    net, example = _meta_model(args, model, 1)
    progress = None if not cfg.progress else stderr_progress()
    result = search(net, example, cluster=found, global_batch_size=cfg.engine.global_batch_size,
                    precision=cfg.engine.precision, progress=progress,
                    space=lambda c: all(c.options()[n] == v for n, v in fixed.items()))
    best = result.best
    if best is None:
        constraint = f" with {fixed}" if fixed else ""
        raise ConfigError(f"--layout auto: no layout{constraint} fits {found.ranks} ranks of "
                          f"{found.name}\n" + report.text(result, 3))
    e = best.estimate
    print(f"fxmeg: --layout auto chose {best.layout} ({result.legal} legal layouts on "
          f"{found.ranks} ranks of {found.name}, {len(result.ranked)} fit): predicted "
          f"{e.step:.3f} s per step, {e.tokens_per_s:,.0f} tokens/s, peak "
          f"{human_bytes(e.peak)} per rank", flush=True)
    return cfg.replace(**best.layout.options(), predicted_step_s=e.step)


def _ranks(found, nproc: int | None):
    """``found`` cut to ``nproc`` ranks: one node of them, or whole nodes."""
    import dataclasses

    from fxmeg.errors import ConfigError

    if nproc is None or nproc == found.ranks:
        return found
    if nproc <= found.ranks_per_node:
        return dataclasses.replace(found, ranks_per_node=nproc, nodes=1)
    if nproc % found.ranks_per_node:
        raise ConfigError(f"--nproc {nproc} with --layout auto: {found.name} has "
                          f"{found.ranks_per_node} ranks per node; give a multiple of it, or "
                          "at most one node")
    return dataclasses.replace(found, nodes=nproc // found.ranks_per_node)
