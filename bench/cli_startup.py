"""How long the `fxmeg` command takes to answer before any work: `fxmeg --help`, a
command's --help, and a refused flag value (a config error), each the median of
``--repeats`` fresh interpreters, beside ``python -c pass`` (the interpreter's own start)
and ``import torch`` (what the answers no longer wait for). One JSON line.

    python bench/cli_startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "python": ["-c", "pass"],
    "import_torch": ["-c", "import torch"],
    "fxmeg_help": ["-m", "fxmeg.train.cli", "--help"],
    "fxmeg_train_help": ["-m", "fxmeg.train.cli", "train", "--help"],
    "config_error": [
        "-m",
        "fxmeg.train.cli",
        "train",
        "--data",
        "x",
        "--train-iters",
        "1",
        "--schedule",
        "1f1d",
    ],
}


def seconds(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, *args], capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"}
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({name: round(seconds(argv, args.repeats), 3) for name, argv in CASES.items()}))


if __name__ == "__main__":
    main()
