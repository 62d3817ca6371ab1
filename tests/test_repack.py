"""workflows/repack.py: the best-fit repack planner, on worked examples (expected plans worked out in the
comments) and as a Hypothesis property over random loads checking the planner's invariants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.workflows.repack import C_MAX, Move, ReplicaLoad, is_candidate, plan_repack, released

CAP = 1000  # KV capacity (tokens) in the worked examples: C_max = 0.9 x 1000 = 900 tokens
B = 8  # roofline batch in the worked examples (sequences)


def _r(rid: str, kv: int, prev: int, n: int, version: int = 0, cap: int = CAP,
       waiting: int = 0) -> ReplicaLoad:
    """A load report: kv tokens now, at the previous report, trajectories in flight."""
    return ReplicaLoad(replica_id=rid, policy_version=version, kv_used=kv, kv_prev=prev, kv_capacity=cap,
                       in_flight=n, waiting=waiting)


def test_default_threshold() -> None:
    assert C_MAX == 0.9


def test_best_fit_consolidates_onto_the_densest_candidate() -> None:
    loads = [
        _r("a", 100, 200, 1),
        _r("b", 300, 400, 2),
        _r("c", 500, 600, 3),
        _r("d", 895, 990, 4),  # falling and just below C_max (895 < 900): a candidate
        _r("e", 400, 350, 2),  # rising (400 > 350): still admitting, not a candidate
        _r("f", 200, 300, 8),  # 8 trajectories = B: not below the roofline batch, not a candidate
        _r("g", 950, 990, 1),  # falling but above C_max (950 >= 900): at its peak, not a candidate
    ]
    # Candidates by kv ascending: a(100), b(300), c(500), d(895).
    # s=a (100, 1): fits b (300+100=400), c (600), d (895+100=995 > 900: no). Densest of b, c: c (500).
    #   a -> c; c now holds 600 tokens, 4 trajectories.
    # s=b (300, 2): fits c (600+300=900 <= 900; 4+2=6 <= 8); d: 895+300 > 900. b -> c; c holds 900, 6.
    # s=c: received moves, never a source. s=d (895, 4): c is full (900+895 > 900): stays.
    plan = plan_repack(loads, c_max=0.9, roofline_batch=B)
    assert plan == [Move("a", "c", 0, 100, 1), Move("b", "c", 0, 300, 2)]
    assert released(plan) == ["a", "b"]


def test_can_fit_on_the_kv_limit() -> None:
    loads = [_r("a", 100, 200, 1), _r("b", 300, 400, 1), _r("c", 850, 860, 1)]
    # s=a: c would hold 850+100 = 950 > 900, so only b fits (300+100 = 400): a -> b, though c is denser.
    # s=b: received, skipped. s=c (850): b would hold 400+850 = 1250 > 900: no destination.
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [Move("a", "b", 0, 100, 1)]


def test_can_fit_on_the_batch_limit() -> None:
    loads = [_r("a", 100, 200, 5), _r("b", 200, 300, 2), _r("c", 300, 400, 4)]
    # s=a (5 trajectories): c would decode 4+5 = 9 > B = 8, b would decode 2+5 = 7: a -> b (kv 300, n 7).
    # s=b: received. s=c (300, 4): b has room for the tokens (300+300 = 600) but not the batch (7+4 = 11).
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [Move("a", "b", 0, 100, 5)]


def test_limits_are_inclusive() -> None:
    # exactly C_max tokens (600+300 = 900) and exactly B trajectories (5+3 = 8) still fit
    loads = [_r("a", 300, 400, 3), _r("b", 600, 700, 5)]
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [Move("a", "b", 0, 300, 3)]


def test_each_destination_uses_its_own_capacity() -> None:
    loads = [_r("a", 100, 200, 1), _r("b", 400, 420, 1, cap=500), _r("c", 300, 310, 1, cap=2000)]
    # C_max: b 0.9 x 500 = 450, c 0.9 x 2000 = 1800. Order: a(100), c(300), b(400).
    # s=a: b would hold 500 > 450 (no), c 400 <= 1800: a -> c. s=c: received.
    # s=b (400): c would hold 400+400 = 800 <= 1800: b -> c.
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [
        Move("a", "c", 0, 100, 1), Move("b", "c", 0, 400, 1)
    ]


def test_never_across_versions() -> None:
    loads = [_r("a", 100, 200, 1, version=1), _r("b", 500, 600, 1, version=2),
             _r("c", 200, 300, 1, version=1), _r("d", 300, 400, 1, version=2)]
    # Without versions a would go to b (densest, 500). Per version: v1 {a(100), c(200)}: a -> c;
    # v2 {d(300), b(500)}: d -> b. Moves come out by version ascending.
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [
        Move("a", "c", 1, 100, 1), Move("d", "b", 2, 300, 1)
    ]
    # a version with a single candidate has nowhere to send it
    assert plan_repack([_r("a", 100, 200, 1, version=1), _r("b", 100, 200, 1, version=2)],
                       c_max=0.9, roofline_batch=B) == []


def test_ties_break_by_replica_id() -> None:
    # destinations x and y equally dense (400): the smaller id, x, takes a
    loads = [_r("y", 400, 500, 1), _r("a", 100, 200, 1), _r("x", 400, 500, 1)]
    # order: a(100), x(400), y(400) (kv tie: id). s=a -> x (tie with y). s=x: received.
    # s=y (400): x would hold 500+400 = 900 <= 900, 2+1 <= 8: y -> x.
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [
        Move("a", "x", 0, 100, 1), Move("y", "x", 0, 400, 1)
    ]


def test_empty_plans() -> None:
    # nobody in ramp-down: kv equal to or above the previous report
    steady = [_r("a", 100, 100, 1), _r("b", 300, 200, 2), _r("c", 500, 500, 3)]
    assert plan_repack(steady, c_max=0.9, roofline_batch=B) == []
    # everybody falling but at or above C_max (900 tokens)
    peak = [_r("a", 900, 990, 1), _r("b", 950, 1000, 2)]
    assert plan_repack(peak, c_max=0.9, roofline_batch=B) == []
    # a replica with nothing in flight is neither a source nor a destination: a has nowhere to go
    idle = [_r("a", 100, 200, 1), _r("z", 0, 300, 0)]
    assert not is_candidate(idle[1], c_max=0.9, roofline_batch=B)
    assert plan_repack(idle, c_max=0.9, roofline_batch=B) == []
    assert plan_repack([], c_max=0.9, roofline_batch=B) == []


def test_waiting_prompts_do_not_block_a_source() -> None:
    # a drains before loading a newer version, holding 3 prompts it will start only after loading
    loads = [_r("a", 100, 200, 1, waiting=3), _r("b", 300, 400, 1)]
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == [Move("a", "b", 0, 100, 1)]


def test_c_max_scales_the_threshold() -> None:
    loads = [_r("a", 40, 200, 1), _r("b", 950, 990, 1)]
    # c_max 0.9 (C_max 900): b (950) is at its peak, not a candidate, so a has nowhere to go.
    # c_max 1.0 (C_max 1000): b is falling below it (950 < min(1000, 990)); s=a: b holds 950+40 = 990 <= 1000.
    assert plan_repack(loads, c_max=0.9, roofline_batch=B) == []
    assert plan_repack(loads, c_max=1.0, roofline_batch=B) == [Move("a", "b", 0, 40, 1)]
    # with a at 100 tokens b would hold 1050 > 1000, and a cannot take b (100+950 > 1000): nothing moves
    assert plan_repack([_r("a", 100, 200, 1), loads[1]], c_max=1.0, roofline_batch=B) == []


@pytest.mark.parametrize(("kwargs", "loads", "message"), [
    ({"c_max": 0.0, "roofline_batch": B}, [], "c_max=0.0"),
    ({"c_max": 1.5, "roofline_batch": B}, [], "c_max=1.5"),
    ({"c_max": 0.9, "roofline_batch": 0}, [], "roofline_batch=0"),
    ({"c_max": 0.9, "roofline_batch": B}, [_r("a", 1, 2, 1), _r("a", 1, 2, 1)], "replica_id='a'"),
    ({"c_max": 0.9, "roofline_batch": B}, [_r("a", 1, 2, 1, cap=0)], "kv_capacity=0"),
    ({"c_max": 0.9, "roofline_batch": B}, [_r("a", -1, 2, 1)], "kv_used=-1"),
    ({"c_max": 0.9, "roofline_batch": B}, [_r("a", 1, 2, -2)], "in_flight=-2"),
])
def test_invalid_input_names_the_field(kwargs: dict, loads: list[ReplicaLoad], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_repack(loads, **kwargs)


# -- properties over random loads ------------------------------------------------------------------------


@st.composite
def _loads(draw: st.DrawFn) -> list[ReplicaLoad]:
    n = draw(st.integers(0, 12))
    out = []
    for i in range(n):
        cap = draw(st.sampled_from([1000, 1000, 100]))  # mostly one size; a small one now and then
        kv = draw(st.integers(0, cap // 5) | st.integers(0, cap))  # mostly small loads, so moves fit
        prev = min(cap, max(0, kv + draw(st.integers(-cap // 10, cap // 2))))  # mostly falling
        version = draw(st.integers(0, 1) | st.integers(0, 2))
        in_flight = draw(st.integers(0, 3) | st.integers(0, 10))
        out.append(ReplicaLoad(replica_id=f"r{i:02d}", policy_version=version, kv_used=kv, kv_prev=prev,
                               kv_capacity=cap, in_flight=in_flight, waiting=draw(st.integers(0, 3))))
    return out


def _densest_fits(cands: list[ReplicaLoad], s: ReplicaLoad, emptied: set[str], kv: dict[str, int],
                  n: dict[str, int], c_max: float, b: int) -> list[str]:
    """Ids of the feasible destinations for s that are densest right now (the argmax set, before ties)."""
    fits = [d for d in cands if d.policy_version == s.policy_version and d.replica_id != s.replica_id
            and d.replica_id not in emptied and kv[d.replica_id] + s.kv_used <= d.kv_limit(c_max)
            and n[d.replica_id] + s.in_flight <= b]
    top = max((kv[d.replica_id] for d in fits), default=None)
    return sorted(d.replica_id for d in fits if kv[d.replica_id] == top)


@settings(max_examples=400, deadline=None)
@given(loads=_loads(), c_max=st.sampled_from([0.5, 0.75, 0.9, 1.0]), b=st.integers(1, 10),
       perm=st.randoms(use_true_random=False))
def test_plan_invariants(loads: list[ReplicaLoad], c_max: float, b: int, perm: random.Random) -> None:
    plan = plan_repack(loads, c_max=c_max, roofline_batch=b)
    by_id = {r.replica_id: r for r in loads}
    cands = [r for r in loads if is_candidate(r, c_max=c_max, roofline_batch=b)]
    cand_ids = {r.replica_id for r in cands}

    # determinism: the same loads in another order give the same plan
    shuffled = list(loads)
    perm.shuffle(shuffled)
    assert plan_repack(shuffled, c_max=c_max, roofline_batch=b) == plan

    sources = [m.source for m in plan]
    destinations = {m.destination for m in plan}
    assert len(sources) == len(set(sources))  # a source is emptied at most once
    assert not set(sources) & destinations  # ... and is never a destination
    assert set(sources) | destinations <= cand_ids  # only ramp-down replicas with work take part
    if not cands:
        assert plan == []

    # replay: each move within one version, carries the source's whole load, and goes to the densest
    # destination that fits at that point of the plan (ties: the smaller id)
    kv = {r.replica_id: r.kv_used for r in loads}
    n = {r.replica_id: r.in_flight for r in loads}
    emptied: set[str] = set()
    for m in plan:
        s, d = by_id[m.source], by_id[m.destination]
        assert s.policy_version == d.policy_version == m.policy_version
        assert (m.kv_tokens, m.trajectories) == (s.kv_used, s.in_flight)
        densest = _densest_fits(cands, s, emptied, kv, n, c_max, b)
        assert densest and m.destination == densest[0]
        kv[d.replica_id] += s.kv_used
        n[d.replica_id] += s.in_flight
        emptied.add(s.replica_id)

    # every destination ends within both limits
    for d in destinations:
        assert kv[d] <= by_id[d].kv_limit(c_max)
        assert n[d] <= b

    # maximal: a candidate left in place has no feasible destination in the final plan (loads only grow and
    # the emptied set only grows, so what did not fit at its turn does not fit now)
    for s in cands:
        if s.replica_id not in emptied and s.replica_id not in destinations:
            assert _densest_fits(cands, s, emptied, kv, n, c_max, b) == []


@settings(max_examples=200, deadline=None)
@given(loads=_loads(), b=st.integers(1, 10))
def test_no_ramp_down_means_no_plan(loads: list[ReplicaLoad], b: int) -> None:
    # make every replica non-falling (kv_prev <= kv_used): nobody is in ramp-down
    steady = [ReplicaLoad(r.replica_id, r.policy_version, r.kv_used, min(r.kv_prev, r.kv_used), r.kv_capacity,
                          r.in_flight, r.waiting) for r in loads]
    assert plan_repack(steady, c_max=0.9, roofline_batch=b) == []
    # every replica at or above C_max (kv_used >= 0.9 x capacity), whatever its previous report
    full = [ReplicaLoad(r.replica_id, r.policy_version, max(r.kv_used, math.ceil(r.kv_limit(0.9))), r.kv_prev,
                        r.kv_capacity, r.in_flight, r.waiting) for r in loads]
    assert plan_repack(full, c_max=0.9, roofline_batch=b) == []
