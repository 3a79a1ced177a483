"""What the trainer reports: a JSON-lines metrics file, a live console line, TensorBoard
when it is installed, and PNG curves drawn from a run directory."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time


class Metrics:
    """Rank 0's sinks; every method is a no-op on other ranks."""

    def __init__(
        self, run_dir: str, *, enabled: bool, total: int | None, progress: bool, tensorboard: bool
    ):
        self.enabled, self.total = enabled, total
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.progress = progress and enabled
        self._tty = sys.stdout.isatty()
        self._writer = None
        self._lock = threading.Lock()  # a background checkpoint reports from its thread
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                self._writer = _tensorboard(run_dir)

    def record(self, kind: str, values: dict) -> None:
        """Append one record ("train", "eval", "memory", "event") to the metrics file."""
        if not self.enabled:
            return
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **values}) + "\n")
        if self._writer is not None and "iteration" in values:
            for key, value in values.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self._writer.add_scalar(f"{kind}/{key}", value, values["iteration"])
                elif isinstance(value, dict):  # per layer (load_imbalance): kind/key/layer
                    for part, number in value.items():
                        if isinstance(number, (int, float)):
                            self._writer.add_scalar(
                                f"{kind}/{key}/{part}", number, values["iteration"]
                            )
            self._writer.flush()

    def rewind(self, iteration: int) -> None:
        """After resuming at ``iteration``: drop the records of steps after it (a run that
        died after its last checkpoint logged them; the resumed run logs them again)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with self._lock:
            kept = [
                r
                for r in read(os.path.dirname(self.path))
                if r.get("iteration", 0) <= iteration or r["kind"] not in ("train", "eval")
            ]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
        self.record("event", {"iteration": iteration, "resumed": True})

    def show(self, text: str, *, iteration: int | None = None, final: bool = False) -> None:
        """A console line: redrawn in place on a terminal, one line per call otherwise."""
        if not self.progress:
            return
        bar = ""
        if iteration is not None and self.total:
            done = int(30 * min(iteration, self.total) / self.total)
            bar = (
                f"[{'=' * done}{'>' if done < 30 else ''}{' ' * (29 - done)}] "
                f"{iteration}/{self.total} "
            )
        if self._tty and not final:
            sys.stdout.write("\r" + bar + text + "\033[K")
        else:
            sys.stdout.write(bar + text + "\n")
        sys.stdout.flush()

    def say(self, text: str) -> None:
        """A plain line (events, reports), ending any progress line first."""
        if self.enabled:
            sys.stdout.write(("\n" if self._tty and self.progress else "") + text + "\n")
            sys.stdout.flush()


DEFAULT_RUN_DIR = "runs/run"
"""The first run's directory when --run-dir is not given; later ones take runs/run-2, -3, ..."""


def run_directory(given: str, *, resuming: bool, resumed: str | None = None) -> str:
    """The directory of a run's metrics: ``given`` (--run-dir), or when it is '' the one
    the resumed checkpoint recorded (``resumed``), else the first of runs/run, runs/run-2,
    ... that holds no run. A run never appends to another's metrics: a given directory
    holding one is refused unless this run resumes (a checkpoint, or a restart)."""
    from fxmeg.errors import ConfigError

    if not given:
        if resuming and resumed:
            return resumed
        path, n = DEFAULT_RUN_DIR, 1
        while os.path.exists(os.path.join(path, "metrics.jsonl")):
            n += 1
            path = f"{DEFAULT_RUN_DIR}-{n}"
        return path
    if not resuming and os.path.exists(os.path.join(given, "metrics.jsonl")):
        raise ConfigError(
            f"--run-dir {given} holds the metrics of an earlier run, and this run resumes none (no "
            "checkpoint loaded): give a new --run-dir (or leave it out: each run takes its own), "
            f"delete {given}, or --load that run's checkpoints to continue it"
        )
    return given


def _tensorboard(run_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(run_dir, "tensorboard"))


def read(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(run_dir: str, out: str | None = None) -> str:
    """Loss (train and validation), learning rate and throughput curves of a run, and the
    routed experts' load imbalance per layer when the run has one, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    experts = [r for r in train if r.get("load_imbalance")]
    fig, axes = plt.subplots(1, 4 if experts else 3, figsize=(20 if experts else 15, 4))
    axes[0].plot([r["iteration"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot(
            [r["iteration"] for r in evals], [r["valid_loss"] for r in evals], "o-", label="valid"
        )
    axes[0].set(title="loss", xlabel="iteration")
    axes[0].legend()
    axes[1].plot([r["consumed_samples"] for r in train], [r["lr"] for r in train])
    axes[1].set(title="learning rate", xlabel="consumed samples")
    axes[2].plot([r["iteration"] for r in train], [r["tokens_per_s"] for r in train])
    axes[2].set(title="tokens / s", xlabel="iteration")
    if experts:
        _plot_load(axes[3], experts)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _plot_load(ax, train: list[dict]) -> None:
    """Load imbalance (max / mean tokens per expert) over iterations: one line per layer,
    labelled when few, and the largest layer's in black."""
    steps = [r["iteration"] for r in train]
    layers = list(train[-1]["load_imbalance"])
    for layer in layers:
        ax.plot(steps, [r["load_imbalance"].get(layer, math.nan) for r in train], lw=0.8,
                label=layer if len(layers) <= 8 else None)
    ax.plot(steps, [max(r["load_imbalance"].values()) for r in train], "k-", lw=1.5, label="max")
    ax.set(title="expert load imbalance (max / mean)", xlabel="iteration")
    ax.legend(fontsize="x-small")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
