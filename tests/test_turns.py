"""services/turns.py with real threads: the policy goes to one call at a time, and the waiting steps of a run
take it lowest first, whatever order they arrived in; a step whose predecessor is not here does not wait for it."""

from __future__ import annotations

import threading
import time

from laminar.services.turns import Turns


def _waiter(turns: Turns, step, order: list, hold_s: float = 0.0) -> threading.Thread:
    def run():
        got, _ = turns.acquire(step)
        assert got
        order.append(step)
        time.sleep(hold_s)
        turns.release()

    t = threading.Thread(target=run)
    t.start()
    return t


def _until_waiting(turns: Turns, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(turns._waiting) < n:
        assert time.monotonic() < deadline, turns._waiting
        time.sleep(0.001)


def test_waiting_steps_take_their_turns_in_step_order_whatever_their_arrival():
    for arrival in ([3, 2, 1], [2, 3, 1], [1, 3, 2], [3, 1, 2]):
        turns, order = Turns(), []
        assert turns.acquire(("r", 0)) == (True, False)  # step 0 runs
        threads = []
        for i, s in enumerate(arrival):
            threads.append(_waiter(turns, ("r", s), order))
            _until_waiting(turns, i + 1)
        turns.release()
        for t in threads:
            t.join(10)
        assert order == [("r", 1), ("r", 2), ("r", 3)], (arrival, order)


def test_a_step_whose_predecessor_is_not_here_does_not_wait_for_it():
    turns = Turns()
    assert turns.acquire(("r", 5)) == (True, False)  # step 4 went to another trainer, or has not arrived
    turns.release()
    turns._waiting.append(("r", 1))  # step 1 of run r waits (its thread not yet woken)
    assert turns.acquire(("r", 2), timeout=0.1) == (False, True)  # a later step of run r gives it the turn ...
    assert turns.acquire(("other-run", 5), timeout=0.1) == (True, False)  # ... another run's step is not behind it
    turns.release()


def test_one_call_at_a_time_and_a_timeout_gives_up_with_heartbeats():
    turns, beats = Turns(), []
    assert turns.acquire()[0]  # an init: no step
    t0 = time.monotonic()
    got, waited = turns.acquire(("r", 1), timeout=0.3, on_wait=lambda: beats.append(1), every_s=0.1)
    assert (got, waited) == (False, True) and time.monotonic() - t0 >= 0.29 and len(beats) >= 2
    assert turns._waiting == []  # gave up: no longer ahead of anyone
    turns.release()
    assert turns.acquire(timeout=0.1) == (True, False)


def test_a_waiter_that_gives_up_lets_the_next_step_go():
    turns, order = Turns(), []
    assert turns.acquire(("r", 0))[0]
    t2 = _waiter(turns, ("r", 2), order)
    _until_waiting(turns, 1)
    got = []
    t1 = threading.Thread(target=lambda: got.append(turns.acquire(("r", 1), timeout=0.2)))
    t1.start()
    t1.join(10)
    assert got == [(False, True)]  # step 1 gave up while step 0 held the turn
    turns.release()
    t2.join(10)
    assert order == [("r", 2)]
