"""fxmeg.runtime.timelines: the Chrome trace round-trips and the numbers read from it are right on
a timeline whose answers are known."""

import json

from fxmeg.runtime import timelines

MS = 1_000_000


def test_round_trip_and_numbers(tmp_path):
    # rank 0: F 0-2, idle, B 6-8      -> compute 4 of a 10 ms schedule: bubble 0.6
    # rank 1: recv 0-2, F 2-4, B 4-6, send 6-10 -> compute 4: bubble 0.6, p2p 6 ms
    # rank 1 reduces: issued at 5, waited 7-8 -> 1 ms of a 3 ms window exposed
    spans = [
        [("0F0", "forward", 0, 2 * MS), ("0B0", "backward", 6 * MS, 8 * MS)],
        [
            ("recv", "p2p", 0, 2 * MS),
            ("1F0", "forward", 2 * MS, 4 * MS),
            ("1B0", "backward", 4 * MS, 6 * MS),
            ("send", "p2p", 6 * MS, 10 * MS),
            ("reduce", "dp_issue", 5 * MS, 5 * MS),
            ("wait", "dp_wait", 7 * MS, 8 * MS),
            ("adam", "optimizer", 10 * MS, 11 * MS),
        ],
    ]
    path = str(tmp_path / "t.json")
    timelines.write(path, spans, ["first", "second"])
    with open(path) as f:
        meta = [
            e for e in json.load(f)["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"
        ]
    assert [(e["pid"], e["args"]["name"]) for e in meta] == [(0, "first"), (1, "second")]
    assert timelines.load(path) == spans
    got = timelines.analyze(spans)
    assert abs(got["schedule_s"] - 0.010) < 1e-12  # the optimizer is not part of the schedule
    r0, r1 = got["ranks"]
    assert abs(r0["bubble"] - 0.6) < 1e-9 and abs(r1["bubble"] - 0.6) < 1e-9
    assert abs(r1["p2p_s"] - 0.006) < 1e-12 and r0["p2p_s"] == 0
    assert r0["dp_hidden"] is None and abs(r1["dp_hidden"] - 2 / 3) < 1e-9
    png = timelines.plot(spans, str(tmp_path / "t.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tracer_off_records_nothing():
    t = timelines.Tracer()
    t.begin_step(False)
    with t.span("x", "optimizer"):
        pass
    t.add("y", "p2p", 0, 1)
    assert t.events is None
    t.begin_step(True)
    with t.span("x", "optimizer"):
        pass
    assert [e[:2] for e in t.events] == [("x", "optimizer")]


def test_split_backward_counts_as_compute_and_has_its_colours(tmp_path):
    # ZB: F 0-2, I 2-3, idle, W 4-5 of a 5 ms schedule -> bubble 0.2
    spans = [[("0F0", "forward", 0, 2 * MS), ("0I0", "input_grad", 2 * MS, 3 * MS),
              ("0W0", "weight_grad", 4 * MS, 5 * MS)]]
    assert (timelines.CATEGORY["I"], timelines.CATEGORY["W"]) == ("input_grad", "weight_grad")
    assert abs(timelines.analyze(spans)["ranks"][0]["bubble"] - 0.2) < 1e-9
    with open(timelines.plot(spans, str(tmp_path / "zb.png")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_expert_all_to_alls_are_counted_inside_compute_and_drawn(tmp_path):
    # F 0-4 holding an all-to-all 1-2, B 4-10 holding two, 5-6 and 8-9: 3 ms of all-to-all;
    # the compute spans still cover the whole 10 ms schedule (bubble 0)
    spans = [
        [
            ("ep dispatch", "ep_a2a", 1 * MS, 2 * MS),
            ("0F0", "forward", 0, 4 * MS),
            ("ep combine grad", "ep_a2a", 5 * MS, 6 * MS),
            ("ep dispatch grad", "ep_a2a", 8 * MS, 9 * MS),
            ("0B0", "backward", 4 * MS, 10 * MS),
        ]
    ]
    (r,) = timelines.analyze(spans)["ranks"]
    assert (
        abs(r["a2a_s"] - 0.003) < 1e-12
        and abs(r["bubble"]) < 1e-9
        and abs(r["compute_s"] - 0.010) < 1e-12
    )
    with open(timelines.plot(spans, str(tmp_path / "ep.png")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
