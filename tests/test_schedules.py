"""Pipeline schedules as data: generators, simulator (the judge) and drawer.

The property tests compare simulated numbers with closed forms derived
independently of the simulator (bubble fractions from the papers, in-flight
counts from Megatron's warmup formula), so a wrong generator or simulator
makes them fail.
"""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxmegatron.errors import FxMegatronError
from fxmegatron.schedules import (Action, Schedule, ScheduleError, gpipe, interleaved_1f1b,
                                  make_schedule, one_f_one_b, simulate)
from fxmegatron.schedules.generate import interleaved_warmup

PS = st.integers(1, 8)
VS = st.integers(1, 4)
MS = st.integers(1, 32)
TIMES = st.sampled_from([(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (0.5, 1.5)])
PROPS = settings(max_examples=100, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def interleaved_sizes(draw):
    """(p, v, m) valid for the interleaved schedule: m a multiple of p."""
    p, v = draw(PS), draw(VS)
    m = p * draw(st.integers(1, max(1, 32 // p)))
    return p, v, m


def _all_ranks_equal(values, expected):
    assert values == [pytest.approx(expected, rel=1e-9, abs=1e-12)] * len(values)


# ---------------------------------------------------------------- bubbles

@PROPS
@given(p=PS, m=MS, times=TIMES)
def test_gpipe_bubble_is_p_minus_1_over_m(p, m, times):
    res = simulate(gpipe(p, m), *times)
    _all_ranks_equal(res.bubble_fraction, (p - 1) / m)
    _all_ranks_equal(res.busy, m * sum(times))


@PROPS
@given(p=PS, v=st.integers(2, 4), m=MS, times=TIMES)
def test_gpipe_with_chunks_bubble(p, v, m, times):
    """Chunk-major GPipe: the forward sweep takes max(m + (p-1)/v, p + (m-1)/v)
    stage-forwards (the ring is starved when m < p)."""
    res = simulate(make_schedule("gpipe", p, v, m), *times)
    sweep = max(m + (p - 1) / v, p + (m - 1) / v)
    _all_ranks_equal(res.bubble_fraction, (sweep - m) / m)
    if m >= p:
        _all_ranks_equal(res.bubble_fraction, (p - 1) / (v * m))


@PROPS
@given(p=PS, m=MS, times=TIMES)
def test_1f1b_bubble_is_p_minus_1_over_m(p, m, times):
    res = simulate(one_f_one_b(p, m), *times)
    _all_ranks_equal(res.bubble_fraction, (p - 1) / m)
    assert res.makespan == pytest.approx((m + p - 1) * sum(times))


@PROPS
@given(sizes=interleaved_sizes(), times=TIMES)
def test_interleaved_bubble_is_p_minus_1_over_vm(sizes, times):
    p, v, m = sizes
    res = simulate(interleaved_1f1b(p, v, m), *times)
    _all_ranks_equal(res.bubble_fraction, (p - 1) / (v * m))
    _all_ranks_equal(res.busy, m * sum(times))
    assert res.overall_bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_bubble_hand_computed_1f1b():
    """p=2, m=2, f=1, b=2: rank 1 idles 1 unit at the start, rank 0 two units
    waiting for the first gradient; makespan (m+p-1)(f+b) = 9."""
    res = simulate(one_f_one_b(2, 2), 1.0, 2.0)
    assert res.makespan == 9.0
    starts = [[(a.kind, a.microbatch, t0) for t0, _, a in tl] for tl in res.timeline]
    assert starts[0] == [("F", 0, 0.0), ("F", 1, 1.0), ("B", 0, 4.0), ("B", 1, 7.0)]
    assert starts[1] == [("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 4.0), ("B", 1, 5.0)]
    assert res.bubble_fraction == [0.5, 0.5]


def test_chunk_cost_is_stage_cost_over_v():
    res = simulate(interleaved_1f1b(2, 4, 2), 1.0, 3.0)
    durations = {a.kind: round(t1 - t0, 9) for tl in res.timeline for t0, t1, a in tl}
    assert durations == {"F": 0.25, "B": 0.75}


# ---------------------------------------------------------- in-flight

@PROPS
@given(p=PS, m=MS)
def test_1f1b_peak_in_flight(p, m):
    res = simulate(one_f_one_b(p, m))
    assert res.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert max(res.peak_in_flight) <= p


@PROPS
@given(p=PS, m=MS)
def test_gpipe_holds_every_microbatch(p, m):
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p


def _interleaved_expected_peaks(p, v, m, r):
    """Peaks implied by Megatron's warmup w: in steady state each F is followed
    by a B, so w + 1 chunk activations are live at most.  Microbatch i enters
    at forward index start(i) = (i // p)*p*v + i % p and leaves at backward
    index start(i) + (v-1)*p (its local chunk 0), which runs after forward
    index start(i) + (v-1)*p + w; so the live microbatches are those whose
    start lies in a window of L = w + 1 + (v-1)*p forward indices.  Starts come
    in bursts of p every p*v indices, so a window holds at most
    (L // pv)*p + min(L % pv, p) of them."""
    w = interleaved_warmup(p, v, m, r) if v > 1 else min(p - r - 1, m)
    if w == m * v:
        return m, m * v
    window, period = w + 1 + (v - 1) * p, p * v
    return min(m, (window // period) * p + min(window % period, p)), w + 1


@PROPS
@given(sizes=interleaved_sizes())
def test_interleaved_peak_in_flight(sizes):
    p, v, m = sizes
    res = simulate(interleaved_1f1b(p, v, m))
    expected = [_interleaved_expected_peaks(p, v, m, r) for r in range(p)]
    assert res.peak_in_flight == [mb for mb, _ in expected]
    assert res.peak_in_flight_chunks == [ch for _, ch in expected]
    # The bound the warmup alone implies: a live microbatch keeps its first
    # local chunk's activation live, so live microbatches <= live chunks <= w + 1.
    for r in range(p):
        w = interleaved_warmup(p, v, m, r) if v > 1 else min(p - r - 1, m)
        assert res.peak_in_flight[r] <= min(m, w + 1)
        assert res.peak_in_flight_chunks[r] <= w + 1


def test_interleaved_peak_in_flight_example():
    """p=4, v=2, m=8: rank 0 warms up with 10 forwards; it holds 11 chunk
    activations and at some point 8 distinct microbatches (1F1B: 4)."""
    res = simulate(interleaved_1f1b(4, 2, 8))
    assert res.peak_in_flight_chunks == [11, 9, 7, 5]
    assert res.peak_in_flight == [8, 8, 7, 5]


# --------------------------------------------------- structure of valid ones

@PROPS
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved"]), p=PS, v=VS, m=MS)
def test_every_valid_schedule_simulates(name, p, v, m):
    try:
        s = make_schedule(name, p, v, m)
    except ScheduleError:
        assert (name == "1f1b" and v > 1) or (name == "interleaved" and v > 1 and m % p)
        return
    simulate(s)
    sends = [a for acts in s.ranks for a in acts if a.is_send]
    if p == 1:
        assert sends == []
    else:  # one hand-off per chunk boundary, each way
        assert len(sends) == 2 * m * (p * s.v - 1)
    for r, acts in enumerate(s.ranks):
        assert {a.chunk % p for a in acts} <= {r}


def test_interleaved_forward_order_rank0():
    """Megatron's order: groups of p microbatches through all local chunks."""
    s = interleaved_1f1b(2, 2, 4)
    fwd = [(a.microbatch, a.chunk) for a in s.computes(0) if a.kind == "F"]
    assert fwd == [(0, 0), (1, 0), (0, 2), (1, 2), (2, 0), (3, 0), (2, 2), (3, 2)]
    bwd = [(a.microbatch, a.chunk) for a in s.computes(0) if a.kind == "B"]
    assert bwd == [(0, 2), (1, 2), (0, 0), (1, 0), (2, 2), (3, 2), (2, 0), (3, 0)]


def test_recv_right_before_compute_send_right_after():
    acts = one_f_one_b(3, 4).ranks[1]
    for k, a in enumerate(acts):
        if a.is_recv:
            assert acts[k + 1].is_compute and acts[k + 1].microbatch == a.microbatch
        if a.is_send:
            assert acts[k - 1].is_compute and acts[k - 1].chunk == a.chunk


def test_str_lists_each_rank():
    text = str(interleaved_1f1b(2, 2, 2))
    lines = text.splitlines()
    assert lines[0].startswith("interleaved p=2 v=2 m=2")
    assert lines[1].startswith("rank 0: F0c0 sF0c0>1 F1c0")
    assert lines[2].startswith("rank 1: rF0c1<0 F0c1")


def test_interleaved_v1_is_1f1b():
    assert interleaved_1f1b(4, 1, 6).ranks == one_f_one_b(4, 6).ranks
    assert make_schedule("interleaved", 4, 1, 6).name == "1f1b"


# --------------------------------------------------- invalid combinations

@pytest.mark.parametrize("args, needle", [
    (("gpipe", 0, 1, 4), "p (pipeline ranks) must be >= 1"),
    (("1f1b", 2, 1, 0), "m (microbatches) must be >= 1"),
    (("interleaved", 2, 0, 4), "v (model chunks per rank) must be >= 1"),
    (("1f1b", 2, 2, 4), "needs v == 1"),
    (("interleaved", 4, 2, 6), "m % p == 0"),
    (("interleaved", 3, 3, 2), "m % p == 0"),
    (("gpipe", 2.0, 1, 4), "must be an int"),
    (("zb", 2, 1, 4), "unknown schedule"),
])
def test_invalid_combinations_raise(args, needle):
    with pytest.raises(ScheduleError) as info:
        make_schedule(*args)
    assert needle in str(info.value)
    assert isinstance(info.value, FxMegatronError) and isinstance(info.value, ValueError)


def test_1f1b_with_chunks_points_to_interleaved():
    with pytest.raises(ScheduleError, match="use 'interleaved'"):
        make_schedule("1f1b", 4, 2, 8)


@PROPS
@given(p=PS, v=st.integers(2, 4), m=MS)
def test_interleaved_m_not_multiple_of_p_raises(p, v, m):
    if m % p == 0:
        simulate(interleaved_1f1b(p, v, m))
    else:
        with pytest.raises(ScheduleError, match=r"m % p == 0"):
            interleaved_1f1b(p, v, m)


def test_bad_action_and_times():
    with pytest.raises(ScheduleError, match="kind"):
        Action("X", 0, 0)
    with pytest.raises(ScheduleError, match="needs a peer"):
        Action("SEND_F", 0, 0)
    with pytest.raises(ScheduleError, match="> 0"):
        simulate(gpipe(2, 2), f_time=0)


# ------------------------------------------ the simulator catches bad ones

def _edit(s: Schedule, rank: int, actions) -> Schedule:
    ranks = [list(a) for a in s.ranks]
    ranks[rank] = list(actions)
    return dataclasses.replace(s, ranks=ranks)


def _index(acts, kind, microbatch, chunk=None):
    return next(k for k, a in enumerate(acts) if a.kind == kind and a.microbatch == microbatch
                and (chunk is None or a.chunk == chunk))


def test_detects_recv_after_its_forward():
    s = one_f_one_b(3, 4)
    acts = list(s.ranks[1])
    k = _index(acts, "RECV_F", 2)
    assert acts[k + 1] == Action("F", 2, 1)
    acts[k], acts[k + 1] = acts[k + 1], acts[k]
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ F\(microbatch=2, chunk=1\): "
                                            r"input not available: needs RECV_F"):
        simulate(_edit(s, 1, acts))


def test_detects_dropped_send():
    s = interleaved_1f1b(2, 2, 4)
    acts = list(s.ranks[1])
    del acts[_index(acts, "SEND_B", 1, chunk=1)]
    with pytest.raises(ScheduleError, match=r"RECV_B\(microbatch=1, chunk=0, peer=1\): "
                                            r"no matching SEND_B on rank 1"):
        simulate(_edit(s, 1, acts))


def test_detects_dropped_recv():
    s = one_f_one_b(2, 2)
    acts = [a for a in s.ranks[1] if a != Action("RECV_F", 1, 1, peer=0)]
    with pytest.raises(ScheduleError, match="no matching RECV_F on rank 1"):
        simulate(_edit(s, 1, acts))


def test_detects_deadlock_from_postponed_send():
    """Rank 1 posts the gradient of microbatch 0 only at the very end, which
    needs microbatch 2's activation, which rank 0 sends only after B(0): a
    cycle of waits through both ranks."""
    s = one_f_one_b(2, 4)
    acts = list(s.ranks[1])
    acts.append(acts.pop(_index(acts, "SEND_B", 0)))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(_edit(s, 1, acts))
    msg = str(info.value)
    assert "rank 0, action #" in msg and "RECV_B(microbatch=0" in msg
    assert "rank 1, action #" in msg and "RECV_F(microbatch=2" in msg


def test_detects_deadlock_from_two_reordered_ranks():
    """Both ranks wait for the other first: rank 0 receives chunk 2's input
    before sending chunk 0's output, rank 1 receives chunk 1's gradient
    before running anything."""
    s = interleaved_1f1b(2, 2, 2)
    r0 = list(s.ranks[0])
    r0.insert(0, r0.pop(_index(r0, "RECV_F", 0, chunk=2)))
    r1 = list(s.ranks[1])
    r1.insert(0, r1.pop(_index(r1, "RECV_B", 0, chunk=1)))
    bad = _edit(_edit(s, 0, r0), 1, r1)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0, action #0 RECV_F.*"
                                            r"rank 1, action #0 RECV_B"):
        simulate(bad)


def test_detects_wrong_peer():
    s = one_f_one_b(3, 2)
    acts = [dataclasses.replace(a, peer=2) if a.kind == "SEND_F" else a for a in s.ranks[0]]
    with pytest.raises(ScheduleError, match="rank 0, action #1 SEND_F.*wrong peer 2, "
                                            "expected rank 1"):
        simulate(_edit(s, 0, acts))


def test_detects_backward_before_forward():
    s = gpipe(1, 2)
    acts = [Action("F", 0, 0), Action("B", 1, 0), Action("F", 1, 0), Action("B", 0, 0)]
    with pytest.raises(ScheduleError, match=r"action #1 B\(microbatch=1.*backward before"):
        simulate(_edit(s, 0, acts))


def test_detects_missing_gradient_input():
    s = gpipe(1, 1, v=2)  # chunks 0 and 1 both on rank 0, handed off locally
    acts = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)]
    with pytest.raises(ScheduleError, match=r"B\(microbatch=0, chunk=0\): input not available"):
        simulate(_edit(s, 0, acts))


def test_detects_duplicate_and_missing_compute():
    s = gpipe(1, 2)
    dup = list(s.ranks[0]) + [Action("F", 0, 0)]
    with pytest.raises(ScheduleError, match="duplicate compute"):
        simulate(_edit(s, 0, dup))
    missing = [a for a in s.ranks[0] if a != Action("B", 1, 0)]
    with pytest.raises(ScheduleError, match=r"missing compute B\(microbatch=1, chunk=0\)"):
        simulate(_edit(s, 0, missing))


def test_detects_send_before_compute_and_compute_on_wrong_rank():
    s = one_f_one_b(2, 1)
    acts = list(s.ranks[0])
    acts[0], acts[1] = acts[1], acts[0]  # SEND_F before F
    with pytest.raises(ScheduleError, match="before the compute that produces it"):
        simulate(_edit(s, 0, acts))
    wrong = [Action("F", 0, 1)] + list(s.ranks[0])[1:]
    with pytest.raises(ScheduleError, match="chunk 1 lives on rank 1, not 0"):
        simulate(_edit(s, 0, wrong))


def test_no_sends_when_p_is_1():
    s = gpipe(1, 3, v=3)
    bad = list(s.ranks[0])
    bad.insert(1, Action("SEND_F", 0, 0, peer=0))
    with pytest.raises(ScheduleError, match="handed off locally"):
        simulate(_edit(s, 0, bad))


# ------------------------------------------------------------------ drawing

@pytest.mark.parametrize("ext", ["png", "svg"])
def test_draw_timeline_writes_file(tmp_path, ext):
    from fxmegatron.schedules.draw import draw_timeline

    path = draw_timeline(interleaved_1f1b(2, 2, 4), str(tmp_path / f"t.{ext}"))
    data = open(path, "rb").read()
    if ext == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert b"<svg" in data and b"interleaved: p=2, v=2, m=4" in data


def test_draw_rejects_other_extension(tmp_path):
    from fxmegatron.schedules.draw import draw_timeline

    with pytest.raises(ScheduleError, match=".png or .svg"):
        draw_timeline(gpipe(2, 2), str(tmp_path / "t.pdf"))


def test_cli_print_and_error(capsys):
    from fxmegatron.schedules.draw import main

    assert main(["--schedule", "1f1b", "-p", "2", "-m", "2", "--print"]) == 0
    one = capsys.readouterr().out
    assert main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--virtual-stages", "1", "--print"]) == 0
    assert capsys.readouterr().out == one           # the other commands' names, the same schedule
    out = one
    assert "rank 1: rF0c1<0 F0c1 B0c1 sB0c1>0" in out and "bubble_fraction=0.5000" in out
    assert main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "6", "--print"]) == 2
    assert "m % p == 0" in capsys.readouterr().err
