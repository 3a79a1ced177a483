"""A search's result as text and JSON (`fxmeg plan --search`), and what to change when
nothing fits."""

from __future__ import annotations

import dataclasses

from fxmeg.diagnostics.devices import GiB
from fxmeg.diagnostics.layout_plan import human_bytes as size
from fxmeg.errors import FxmegError
from fxmeg.planner.search import Layout, Ranked, Result, Searcher, memory_verdict

PARTS = ("compute", "comm_tp", "comm_cp", "comm_ep", "comm_pp", "comm_dp", "bubble", "optimizer",
         "overhead")


def _row(i: object, r: Ranked) -> list[str]:
    e = r.estimate
    where = " ".join(f"{k.removeprefix('comm_')} {v / e.step:.0%}" for k in PARTS
                     if (v := e.breakdown.get(k, 0.0)) / e.step >= 0.005)
    return [str(i), str(r.layout), f"{e.step:.3f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
            f"{e.peak / GiB:.2f}", where]


def _table(rows: list[list[str]]) -> list[str]:
    head = ["#", "layout", "step s", "tokens/s", "MFU", "peak GiB", "where the time goes"]
    rows = [head] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i in (1, 6) else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def text(result: Result, top: int = 10, searcher: Searcher | None = None) -> str:
    c = result.cluster
    lines = [
        f"Layouts on {c.ranks} ranks ({c.nodes} x {c.ranks_per_node} {c.device.name}, "
        f"{size(result.cap)} each): {result.legal} legal, "
        f"{len(result.ranked)} fit, searched in {result.seconds:.1f} s",
    ]
    if result.tight:
        fastest = result.tight[0]
        lines.append(
            f"  {len(result.tight)} more are tight: predicted within the memory model's "
            f"{c.device.memory_error:.0%} of the cap, so they may not fit (the fastest: "
            f"{fastest.layout}, {fastest.estimate.step:.3f} s, {size(fastest.estimate.peak)} "
            "per rank)")
    if result.refused:
        common = ", ".join(f"{n} x {why!r}" for why, n in result.refused.most_common(3))
        lines.append(f"  refused by fxmeg's checks: {sum(result.refused.values())} "
                     f"(most: {common})")
    if result.ranked:
        lines += _table([_row(i + 1, r) for i, r in enumerate(result.ranked[:top])])
        best = result.ranked[0]
        if best.estimate.split_points:
            lines.append(f"  #1 cuts the pipeline at {', '.join(best.estimate.split_points)}")
    else:
        lines += nothing_fits(result, searcher)
    if result.mine is not None:
        lines += yours(result)
    lines.append("  predicted, not measured: GPU step times are unvalidated until run on a GPU "
                 "(docs/planner.md)")
    return "\n".join(lines)


def yours(result: Result) -> list[str]:
    """Where the user's layout ranks, and why (its time against the best's, part by part)."""
    mine, best = result.mine, result.best
    e = mine.estimate
    rank = result.rank_of(mine.layout)
    cap = result.cap
    verdict = memory_verdict(e.peak, cap, result.cluster.device.memory_error)
    if verdict == "over":
        head = (f"  your layout {mine.layout}: does not fit ({size(e.peak)} per rank, "
                f"{size(e.peak - cap)} over)")
    elif verdict == "tight":
        head = (f"  your layout {mine.layout}: tight ({size(e.peak)} per rank against "
                f"{size(cap)}: within the memory model's error, it may not fit)")
    else:
        head = (f"  your layout {mine.layout}: #{rank} of {len(result.ranked)}, "
                f"{e.step:.3f} s per step")
    lines = [head]
    if best is not None and best.layout != mine.layout:
        diffs = sorted(((e.breakdown.get(k, 0) - best.estimate.breakdown.get(k, 0), k)
                        for k in PARTS), reverse=True)
        why = ", ".join(f"{k.removeprefix('comm_')} +{d:.3f} s" for d, k in diffs[:3] if d > 0)
        lines.append(f"    against #1 ({best.layout}, {best.estimate.step:.3f} s): {why or '-'}")
    return lines


def nothing_fits(result: Result, searcher: Searcher | None) -> list[str]:
    """How far the smallest legal layout overshoots, and the changes predicted to fit."""
    cap = result.cap
    if not result.too_big and result.tight:
        return ["  none fits with the memory model's error to spare: the tight ones may "
                "(run the fastest to see, or add ranks)"]
    if not result.too_big:
        why = "; ".join(f"{why} ({n})" for why, n in result.refused.most_common(3))
        return [f"  no legal layout on {result.cluster.ranks} ranks: {why}"]
    small = result.too_big[0]
    e = small.estimate
    worst = max(e.stages, key=lambda s: s.total)
    lines = [f"  nothing fits: the smallest, {small.layout}, needs {size(e.peak)} per rank, "
             f"{size(e.peak - cap)} over {size(cap)} (stage {worst.stage}: weights "
             f"{size(worst.parameters)}, gradients {size(worst.gradients)}, optimizer "
             f"{size(worst.optimizer)}, activations {size(worst.activations)})"]
    error = result.cluster.device.memory_error
    for change, peak in remedies(small, searcher, result.cluster.ranks):
        mark = {"fits": "fits", "tight": "tight", "over": "still over"}[
            memory_verdict(peak, cap, error)]
        lines.append(f"    {change}: {size(peak)} per rank, {mark}")
    share = worst.activations / max(worst.total, 1)
    lines.append(f"    a shorter sequence: activations are {share:.0%} of stage {worst.stage}'s "
                 "peak and scale with it")
    return lines


def remedies(small: Ranked, searcher: Searcher | None, ranks: int) -> list[tuple[str, int]]:
    """(change, predicted peak) for the smallest layout: zero=3, full recompute, and twice
    and four times the ranks (as data parallelism at zero=3, or pipeline stages)."""
    if searcher is None:
        return []
    lay, out = small.layout, []

    def attempt(change: str, layout: Layout) -> None:
        try:
            out.append((change, searcher.estimate(layout).peak))
        except FxmegError:  # a variant fxmeg refuses is simply not offered
            pass

    if lay.zero < 3 and lay.dp * lay.cp > 1:
        attempt("--zero 3", dataclasses.replace(lay, zero=3))
    if lay.recompute != "full":
        attempt("--recompute full", dataclasses.replace(lay, recompute="full"))
    for k in (2, 4):
        attempt(f"{k * ranks} ranks (dp x {k}, zero=3)",
                dataclasses.replace(lay, dp=lay.dp * k, zero=3))
        attempt(f"{k * ranks} ranks (pp x {k})", dataclasses.replace(lay, pp=lay.pp * k))
    return out


def to_dict(result: Result, top: int = 10) -> dict:
    return {
        "cluster": result.cluster.to_dict(),
        "legal": result.legal,
        "fit": len(result.ranked),
        "tight": len(result.tight),
        "seconds": result.seconds,
        "refused": dict(result.refused),
        "top": [r.to_dict() for r in result.ranked[:top]],
        "smallest_over": result.too_big[0].to_dict() if result.too_big and not result.ranked
        else None,
        "yours": None if result.mine is None else result.mine.to_dict()
        | {"rank": result.rank_of(result.mine.layout)},
    }
