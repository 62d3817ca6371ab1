"""client/watch.py next_poll_s: the watch's describes back off while they fail (a server that is down or coming
back is not asked once a second) and return to the poll interval on the first answer."""

from __future__ import annotations

from laminar.client.watch import BACKOFF_MAX_S, POLL_S, next_poll_s


def test_describes_double_their_wait_while_they_fail_and_come_back_at_once():
    waits = [next_poll_s(POLL_S, n) for n in range(10)]
    assert waits[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert waits[6:] == [BACKOFF_MAX_S] * 4
    assert next_poll_s(POLL_S, 10**6) == BACKOFF_MAX_S  # no overflow however long the outage
    assert next_poll_s(0.25, 0) == 0.25 and next_poll_s(60.0, 3) == 60.0  # never below the caller's interval
