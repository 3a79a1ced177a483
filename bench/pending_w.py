"""Peak memory under ``max_pending_w`` (fewer weight gradients deferred by a zero-bubble
schedule), predicted by the layout search and measured: the bench GPT of
bench/search_check.py on 2 gloo ranks at a longer sequence (default 1024: the head's
logits gradient, carried from each micro-batch's I to its W, is 32 MiB), global batch 8,
under ZB-H1 and DualPipeV at pp = 2 with each cap. The planner's reserve comes from timing
the twin on this machine first (``Searcher.calibrate``, about a minute). One JSON line per
layout: its name, the predicted and measured peak of each rank (MiB) and their ratio at the
most loaded rank.

    OMP_NUM_THREADS=1 python bench/pending_w.py            # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.search_check import GBS, batch, build, run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # as search_check
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fxmeg.planner.cluster import cluster
    from fxmeg.planner.profile import Key
    from fxmeg.planner.search import Layout, Ranked, Searcher

    s = Searcher(build("gpt", "meta", args.seq), batch("gpt", 1, "meta", args.seq),
                 cluster=cluster("local:ranks_per_node=2,memory=1TB"), global_batch_size=GBS,
                 precision="fp32")
    s.calibrate([Key()])
    layouts = [Layout(pp=2, schedule="zbh1", pending_w=k) for k in (None, 1, 0)] + [
        Layout(pp=2, vpp=2, schedule="dualpipev", pending_w=k) for k in (None, 2, 1, 0)]
    pool = [Ranked(lay, s.estimate(lay)) for lay in layouts]
    rows = run("gpt", 2, pool, argparse.Namespace(warmup=1, steps=1, seq=args.seq), "pending")
    for r, row in zip(pool, rows):
        if "failed" in row:
            print(json.dumps(row), flush=True)
            continue
        print(json.dumps({"bench": "pending_w", "layout": row["layout"], "seq": args.seq,
                          "predicted_mib": [round(st.total / 2**20) for st in r.estimate.stages],
                          "measured_peak_mib": round(row["measured_peak"] / 2**20),
                          "peak_ratio": row["peak_ratio"]}), flush=True)


if __name__ == "__main__":
    main()
