"""The `fxmeg` command: train, verify, plan, prepare-data, export, plot, plot-schedule.

    fxmeg prepare-data --input pydoc:topics --input /path/to/texts --output runs/corpus
    fxmeg train --data runs/corpus --model models.gpt:GPT --model-args '{"n_layer": 4}' \\
                --tp 2 --pp 2 --train-iters 100          # or --config run.toml
    fxmeg train --data runs/corpus --model transformers:LlamaForCausalLM \\
                --model-args '{"hidden_size": 256, "num_hidden_layers": 4, ...}' --tp 2 --pp 2 ...
                                                           # a Hugging Face class: keyword batches
    fxmeg verify --data runs/corpus --model-args '{"n_layer": 4}' --tp 2 --pp 2
                                                           # one global batch: parallel vs 1 device
    fxmeg export runs/ckpt --to model.pt                   # plain state_dict
    fxmeg export runs/ckpt --to runs/hf --format hf        # from_pretrained("runs/hf")
    fxmeg plot runs/run
    fxmeg train ... --trace runs/trace --trace-interval 50
    fxmeg plot-schedule runs/trace/step_50.json           # rank x time PNG, bubble, waits
    fxmeg plan --model models.llama:Llama --model-args '{"n_layer": 80, ...}' --tp 8 --pp 8 \\
               --vpp 2 --seq-len 4096 --precision bf16     # per-stage memory, FLOPs, bubble
    fxmeg plan --hf-config LlamaConfig num_hidden_layers=80 hidden_size=8192 ... --tp 8 --json

`fxmeg train` and `fxmeg verify` start their own ranks with torch's elastic launcher
(--nproc, default tp * cp * pp * dp, dp at least what --ep needs) unless they already run
under torchrun. An error of the user's is one line (`fxmeg: error: ...`); --debug shows its
traceback.
`fxmeg verify` takes the flags (or --config) of `fxmeg train`, runs the first global batch
of the training data (or the one at the --load checkpoint) through the parallel program and
the single-device graph, prints the comparison on rank 0 and exits 1 on a mismatch; with
--verify-steps N it checks N batches, training a step on each after its check.
`fxmeg plan` takes the model and layout flags of `fxmeg train` (or its --config file) and
prints each pipeline stage's memory, forward FLOPs and bubble (fxmeg/diagnostics/layout_plan.py);
the model is built on the meta device, so no memory is allocated and no process is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from fxmeg.train.flags import WORDS, flags, read_config

DEBUG = "show the whole traceback of an error (also FXMEG_DEBUG=1)"


class Command(NamedTuple):
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _commands() -> dict[str, Command]:
    from fxmeg.train import plan_command

    return {
        "train": Command("train a model", _train_parser, _train),
        "verify": Command(
            "check a layout against single-device execution, batch by batch (the flags of train)",
            _verify_parser,
            _verify,
        ),
        "plan": Command(
            "per-stage memory, FLOPs and bubble of a layout, with no process and no real tensor",
            plan_command.arguments,
            plan_command.run,
        ),
        "prepare-data": Command("tokenise text into a corpus", _prepare_parser, _prepare),
        "export": Command(
            "write a checkpoint's model for one device: a plain state_dict, or a Hugging "
            "Face directory",
            _export_parser,
            _export,
        ),
        "plot": Command(
            "draw loss / lr / throughput (and expert load) curves of a run to PNG",
            _plot_parser,
            _plot,
        ),
        "plot-schedule": Command(
            "draw a traced step (--trace) as a rank x time chart",
            _plot_schedule_parser,
            _plot_schedule,
        ),
    }


def console(argv: list[str] | None = None) -> int:
    """The `fxmeg` command line: ``main``, with an error of the user's (``FxmegError``)
    shown as one line, ``fxmeg: error: ...``, and exit status 1; with --debug (or
    FXMEG_DEBUG=1) the traceback too."""
    from fxmeg.errors import FxmegError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return main(argv)
    except FxmegError as exc:
        if _debug(argv):
            raise
        print(f"fxmeg: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Run one `fxmeg` command; errors propagate (``console`` is the command line's entry).
    Only the named command's flags are built, so `fxmeg --help` imports no torch."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name, parser, rest = _command_parser(argv)
    return _commands()[name].run(parser.parse_args(rest))


def _command_parser(argv: list[str]) -> tuple[str, argparse.ArgumentParser, list[str]]:
    """(the command, its own parser, the words it parses): a bad flag is answered with the
    command's usage line, not the top level's."""
    commands = _commands()
    top = argparse.ArgumentParser(prog="fxmeg", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--debug", action="store_true", help=DEBUG)
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in commands.items():
        sub.add_parser(name, help=command.help, add_help=False)
    at = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if at is None or argv[at] not in commands:
        top.parse_args(argv)  # the help, or the error naming the commands: exits
        raise AssertionError(f"argparse accepted {argv}")
    name = argv[at]
    usage = (
        f"fxmeg {name} [--FLAG VALUE ...]  (fxmeg {name} --help lists them)"
        if name in FLAGGED
        else None
    )
    parser = _Parser(prog=f"fxmeg {name}", description=commands[name].help, usage=usage)
    parser.add_argument("--debug", action="store_true", help=DEBUG)
    commands[name].arguments(parser)
    return name, parser, argv[:at] + argv[at + 1:]


FLAGGED = ("train", "verify", "plan")
"""Commands with a flag per option: their usage line is short, their --help lists them."""


class _Parser(argparse.ArgumentParser):
    """An unrecognised flag is answered with the nearest one."""

    def error(self, message: str):
        from fxmeg.errors import closest

        if message.startswith("unrecognized arguments:"):
            known = [f for action in self._actions for f in action.option_strings]
            words = message.split(":", 1)[1].split()
            message += "".join(closest(w.split("=")[0], known) for w in words if w.startswith("--"))
        super().error(message)


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("FXMEG_DEBUG") == "1"


def _verify_parser(p: argparse.ArgumentParser) -> None:
    _train_parser(p)
    p.add_argument(
        "--verify-steps",
        type=int,
        default=1,
        metavar="N",
        help="check N global batches, training one step on each after its check (a gradient "
        "path dead at initialisation comes alive once the weights move); stops at the "
        "first mismatch",
    )


def _prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        action="append",
        required=True,
        help="a text file, a directory (.txt/.md/.rst/.py files), pydoc:topics or stdlib:PKG",
    )
    p.add_argument("--output", required=True, help="corpus prefix: writes PREFIX.bin/.idx/.json")
    # Megatron's tools/preprocess_data.py and `fxmeg train` both say --tokenizer-model;
    # --tokenizer, this command's first name for it, stays an alias.
    p.add_argument(
        "--tokenizer-model",
        "--tokenizer",
        dest="tokenizer",
        default="bytes",
        metavar="PATH",
        help="'bytes' (the default), or a tokenizers JSON file (a tokenizer.json, or the "
        "directory holding it), as fxmeg train --tokenizer-model; --tokenizer is an alias",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=None,
        metavar="KEY",
        help="read the inputs as JSON lines (Megatron's preprocess_data.py): each line's KEY "
        "field is a document; writes PREFIX_KEY_document.bin/.idx/.json per key, as Megatron",
    )


def _export_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (its latest) or one iteration's")
    p.add_argument(
        "--to", required=True, help="output .pt file (--format pt), or directory (hf, safetensors)"
    )
    p.add_argument(
        "--format",
        default="pt",
        choices=["pt", "hf", "safetensors"],
        help="pt: a torch.save state_dict, for model.load_state_dict; hf: safetensors and "
        "config.json, for from_pretrained (a transformers model); safetensors: the "
        "weight files alone (any model)",
    )
    p.add_argument("--max-shard-size", default="50GB",
                   help="hf / safetensors: above this, files model-0000i-of-0000N.safetensors with "
                        "model.safetensors.index.json (default 50GB, as save_pretrained)")
    p.add_argument(
        "--names",
        default="saved",
        choices=["saved", "model"],
        help="hf / safetensors of a transformers model: saved, the tensors save_pretrained "
        "writes (a mixture of experts' banks one tensor per expert); model, the model's own "
        "state_dict (fused banks, which from_pretrained also loads)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="hf: load the export with from_pretrained and compare its tensors and logits with "
        "the checkpoint's model; exit 1 naming the first difference",
    )


def _export(args) -> int:
    from fxmeg.errors import ConfigError
    from fxmeg.weights.checkpoint import export

    if args.check and args.format != "hf":
        raise ConfigError(
            f"export --check loads the export with from_pretrained: it needs --format hf, "
            f"not {args.format}"
        )
    done = export(args.checkpoint, args.to, format=args.format, max_shard_size=args.max_shard_size,
                  names=args.names)
    print(f"wrote {args.to}: {len(done.names)} tensors of {done.checkpoint}")
    for note in done.notes:
        print(f"  {note}")
    if not args.check:
        return 0
    from fxmeg.interop.export_check import ExportMismatch, check

    try:
        lines = check(done.checkpoint, args.to)
    except ExportMismatch as exc:
        print(f"fxmeg export --check: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(f"check: {line}")
    return 0


def _plot_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)


def _plot(args) -> int:
    from fxmeg.train.metrics import plot as draw

    print(draw(args.run_dir, args.out))
    return 0


def _plot_schedule_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a step_N.json written with --trace DIR")
    p.add_argument("--out", default=None, help="PNG path (default: the trace's, .png)")


# ---------------------------------------------------------------- prepare-data / plot


def _plot_schedule(args) -> int:
    from fxmeg.runtime import timelines

    per_rank = timelines.load(args.trace)
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    timelines.plot(per_rank, out, title=os.path.basename(args.trace))
    summary = timelines.analyze(per_rank)
    for r in summary["ranks"]:
        hidden = "-" if r["dp_hidden"] is None else f"{r['dp_hidden']:.0%}"
        a2a = f", expert all-to-all {r['a2a_s'] * 1e3:.1f} ms" if r["a2a_s"] else ""
        print(
            f"rank {r['rank']}: bubble {r['bubble']:.1%}, send/recv {r['p2p_s'] * 1e3:.1f} "
            f"ms{a2a}, DP reduction hidden {hidden}"
        )
    print(out)
    return 0


def _prepare(args) -> int:
    from fxmeg.data.corpus import prepare, read_documents, read_json_lines
    from fxmeg.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    jobs = [(read_documents(args.input), args.output)]
    if args.json_keys:  # one dataset per key, named as Megatron's preprocess_data.py names them
        jobs = [
            (read_json_lines(args.input, key), f"{args.output}_{key}_document")
            for key in args.json_keys
        ]
    for documents, prefix in jobs:
        meta = prepare(documents, prefix, tokenizer)
        print(
            f"wrote {prefix}.bin: {meta['num_tokens']:,} tokens in {meta['num_documents']} "
            f"documents, vocabulary {meta['vocab_size']} ({meta['tokenizer']})"
        )
    return 0


# ---------------------------------------------------------------- train


def _train_parser(p: argparse.ArgumentParser) -> None:
    """One flag per flat name of TrainConfig (its own fields, then the scalar fields of
    EngineConfig and its sections), its help the field's docstring."""
    from fxmeg.train.train_config import flat_fields

    p.add_argument("--config", help="TOML or YAML file of options (flags override it)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to launch (default tp * cp * pp * dp; without --dp, the least dp --ep needs)",
    )
    p.add_argument(
        "--layout",
        choices=["auto"],
        help="auto: search every layout fxmeg accepts for the ranks it launches (--nproc, "
        "default the --cluster's) and train the fastest that fits; layout flags given too "
        "(--tp 2, --zero 1, ...) constrain the search (docs/planner.md)",
    )
    p.add_argument(
        "--cluster",
        default="local",
        metavar="PRESET[:KEY=VALUE,...]|FILE.json",
        help="with --layout auto: what the search predicts for, as `fxmeg plan --search` "
        "takes it (default local: this machine, measured once and cached)",
    )
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every rank this often after one fails; with --load set to the "
                        "--save directory the run resumes from its latest complete checkpoint")
    flags(p, flat_fields())


def config_from(args: argparse.Namespace):
    """TrainConfig from a config file, then the flags given on the command line (flat
    names both, Megatron's too: TrainConfig.from_flat)."""
    from fxmeg.train.train_config import MEGATRON_NAMES, TrainConfig, flat_fields, from_megatron

    values = from_megatron({key.replace("-", "_"): value for key, value in
                            (read_config(args.config) if args.config else {}).items()})
    given = {name: getattr(args, name) for name in [*flat_fields(), *MEGATRON_NAMES]
             if getattr(args, name, None) is not None}
    values |= from_megatron(given)  # a flag overrides the file
    for name in WORDS:  # words of the command line, or a list in the config file
        if isinstance(values.get(name), list):
            values[name] = " ".join(str(w) for w in values[name])
    if isinstance(values.get("model_args"), dict):
        import json

        values["model_args"] = json.dumps(values["model_args"])
    return TrainConfig.from_flat(args.config or "", **values)


def _train(args) -> int:
    from fxmeg.train.launch import _launch, _worker, default_ranks

    cfg = _chosen(args, config_from(args))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun already
        _worker(cfg)
        return 0
    nproc = args.nproc or default_ranks(cfg.engine.parallel)
    if nproc == 1:
        _worker(cfg)
        return 0
    return _launch(cfg, nproc, args.max_restarts, debug=_debug(sys.argv) or args.debug)


def _chosen(args, cfg):
    """``cfg`` with the layout --layout auto chose (fxmeg/train/plan_command.py), or as is."""
    if args.layout != "auto":
        return cfg
    from fxmeg.train import plan_command

    return plan_command.auto_layout(args, cfg)


def _verify(args) -> int:
    """`fxmeg verify`: the train command's configuration (train_iters / train_samples may
    be left out), its launcher; exit 0 when the layout matches single-device execution on
    each of ``--verify-steps`` batches."""
    from fxmeg.errors import ConfigError
    from fxmeg.train.launch import _launch, _worker, default_ranks

    if args.verify_steps < 1:
        raise ConfigError(
            f"--verify-steps {args.verify_steps}: check at least one batch (1 or more)"
        )
    if args.train_iters is None and args.train_samples is None:
        values = read_config(args.config) if args.config else {}
        if not {"train_iters", "train-iters", "train_samples", "train-samples"} & set(values):
            args.train_iters = 1  # required by TrainConfig, unused here
    cfg = _chosen(args, config_from(args))
    steps = args.verify_steps
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return 0 if _worker(cfg, verify=steps) else 1
    nproc = args.nproc or default_ranks(cfg.engine.parallel)
    if nproc == 1:
        return 0 if _worker(cfg, verify=steps) else 1
    return _launch(cfg, nproc, verify=steps, debug=_debug(sys.argv) or args.debug)


if __name__ == "__main__":
    sys.exit(console())
