"""Ranks for `fxmeg train` and `fxmeg verify`: how many to start, torch's elastic launcher
that starts them (errors of the user's shown once, by the launcher), and the rank's own
entry (process group, then the trainer or the layout check)."""

from __future__ import annotations

import os
import sys
import uuid


def default_ranks(par) -> int:
    """The ranks `fxmeg train` launches without --nproc: tp * cp * pp * dp, with dp (when
    not given) the least that ep divides: ep folds over dp * cp."""
    import math

    dp = par.dp or par.ep // math.gcd(par.ep, par.cp)
    return par.model_ranks * dp


def _launch(cfg, nproc: int, max_restarts: int = 0, *, verify: int = 0, debug: bool = False) -> int:
    """Start ``nproc`` local ranks with torch's elastic launcher (standalone rendezvous).
    On SIGTERM the launcher passes it to the ranks, which finish their step, save and
    exit 0; the command then exits 0 too. With ``verify`` (its number of batches) the ranks
    run `fxmeg verify`; 1 when rank 0 reports a mismatch.

    A rank that fails with an FxmegError (the same one on every rank, as a bad layout is)
    leaves it in a file and exits quietly; the launcher raises the lowest rank's, so it is
    shown once, without torch elastic's report (``debug``: every rank's traceback, and the
    report).

    Ranks fork from a multiprocessing fork server that imported torch and fxmeg once,
    instead of each spawned rank importing them again (seconds of CPU per rank). The server
    only imports (no process group, no device, no CUDA context), so a rank forked from it
    starts as clean as a spawned one, CUDA included."""
    import logging
    import multiprocessing
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.1, start_method="forkserver",
    )
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fxmeg.train.trainer"])
    loggers = [
        logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")
    ]
    levels = [log.level for log in loggers]
    with tempfile.TemporaryDirectory(prefix="fxmeg-errors-") as errors:
        for log in loggers if not debug else ():  # the agent's report of the ranks it stops
            log.setLevel(logging.CRITICAL)
        try:
            results = elastic_launch(config, _worker)(cfg, verify, None if debug else errors)
        except SignalException as exc:
            print(f"fxmeg: {exc.sigval.name} received; ranks saved and stopped", file=sys.stderr)
            return 0
        except ChildFailedError:
            _raise_rank_error(errors)
            raise
        finally:
            for log, level in zip(loggers, levels):
                log.setLevel(level)
    if verify:
        return 0 if results.get(0) else 1
    return 0


ERROR_EXIT = 3
"""A rank's exit status after an FxmegError it left for the launcher."""


def _raise_rank_error(directory: str) -> None:
    """Raise the FxmegError of the lowest rank that left one in ``directory`` (nothing
    when none did: the failure was not the user's, and torch's report says what it was)."""
    import pickle

    from fxmeg.errors import FxmegError

    names = sorted(
        (f for f in os.listdir(directory) if f.startswith("rank")), key=lambda f: int(f[4:])
    )
    if names:
        with open(os.path.join(directory, names[0]), "rb") as f:
            kind, text, data = pickle.load(f)
        try:
            error = pickle.loads(data)
        except Exception:  # an error class whose constructor pickle cannot call again
            error = FxmegError(f"{text} ({kind})")
        raise error from None


def _worker(cfg, verify: int = 0, errors: str | None = None) -> bool | None:
    """One rank of `fxmeg train` (or verify). With ``errors`` (a launcher's directory), an
    FxmegError is written there and the rank exits with ERROR_EXIT, printing nothing."""
    import pickle

    import torch
    import torch.distributed as dist

    from fxmeg.errors import FxmegError
    from fxmeg.train.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend, store=_attempt_store(rank, world), rank=rank, world_size=world
            )
        if verify:
            return _verify_worker(cfg, verify)
        Trainer(cfg).run()
    except FxmegError as exc:
        if errors is None:
            raise
        with open(os.path.join(errors, f"rank{os.environ.get('RANK', '0')}"), "wb") as f:
            pickle.dump((type(exc).__name__, str(exc), pickle.dumps(exc)), f)
        raise SystemExit(ERROR_EXIT) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _verify_worker(cfg, steps: int) -> bool:
    """Set up as `fxmeg train` does (model, data, engine; --load / --init-from honoured),
    with nothing written: run the next ``steps`` global batches through ``Engine.verify``,
    training one step on each after its check; rank 0 prints each report. Whether the
    layout matched on every one (it stops at the first mismatch)."""
    import shutil
    import tempfile

    from fxmeg.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="fxmeg-verify-")
    try:
        trainer = Trainer(cfg.replace(run_dir=run_dir, save="", tensorboard=False, progress=False))
        trainer._switch_batch_size()  # the batch size at the resumed position (nothing is saved)
        engine = trainer.engine
        if trainer.rank == 0:
            par = engine.config.parallel
            print(
                f"layout tp={par.tp}{f' cp={par.cp}' if par.cp > 1 else ''} pp={par.pp} "
                f"vpp={par.vpp} dp={par.dp}, precision {engine.config.precision}, global batch "
                f"{engine.config.global_batch_size} from {trainer.consumed} consumed samples, "
                f"{steps} step(s)"
            )
        gbs = engine.config.global_batch_size
        for step in range(steps):
            start = trainer.consumed + step * gbs
            batch = trainer.batch("train", range(start, start + gbs))
            result = engine.verify(batch)
            if trainer.rank == 0:
                print(f"step {step + 1} of {steps}:", result.report(), flush=True)
            if not result.ok:
                return False
            if step + 1 < steps:
                engine.train_step(batch)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return True


def _attempt_store(rank: int, world: int):
    """The rendezvous store, prefixed by the restart attempt. torch's elastic agent keeps
    one store across restarts (TORCHELASTIC_USE_AGENT_STORE), so a restarted rank would
    otherwise read the dead ranks' gloo addresses and fail with 'Connection refused'."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent and rank == 0)
    return dist.PrefixStore(
        f"fxmeg/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )
