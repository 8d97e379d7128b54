"""The commit budget (hub/pacing.py) on a simulated clock, and ``Retry-After`` in every form a server sends."""

from __future__ import annotations

import email.utils

import pytest

from diloco_lightning.hub.pacing import CommitBudget, retry_after


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _drive(budget: CommitBudget, clock: Clock, attempts_every: float, seconds: float) -> list[float]:
    """A writer that wants to commit every ``attempts_every`` seconds and commits when the budget allows."""
    times = []
    end = clock.t + seconds
    while clock.t < end:
        if budget.wait() <= 0:
            budget.record()
            times.append(clock.t)
        clock.sleep(attempts_every)
    return times


def test_the_budget_is_never_exceeded_in_any_hour_and_commits_are_spread():
    clock = Clock()
    b = CommitBudget(128, clock=clock)
    assert b.burst == 8 and b.wait() == 0
    times = _drive(b, clock, 1.0, 3 * 3600)
    # in every sliding hour at most 128 commits; over three hours the long-run rate is the budget
    j = 0
    for i, t in enumerate(times):
        while times[j] <= t - 3600:
            j += 1
        assert i - j + 1 <= 128
    assert 3 * 128 - 8 <= len(times) <= 3 * 128
    # after the burst, commits come one every 3600 / 128 = 28.1 s (to the writer's 1 s resolution), not in a
    # rush (in later hours the first hour's burst ages out as one, so a few go out together again)
    first = [t for t in times if t < times[0] + 3600]
    gaps = [b2 - a for a, b2 in zip(first[8:], first[9:])]
    assert min(gaps) >= 28 and max(gaps) <= 30
    assert times[7] - times[0] == 7.0  # the burst goes out at once


def test_wait_says_how_long_and_acquire_sleeps_it():
    clock = Clock()
    b = CommitBudget(3600, burst=2, clock=clock)  # one a second after a burst of 2
    b.record()
    b.record()
    assert b.wait() == pytest.approx(1.0)
    clock.sleep(0.25)
    assert b.wait() == pytest.approx(0.75)
    assert b.acquire(sleep=clock.sleep) == pytest.approx(0.75) and b.wait() == 0
    b.record()
    assert b.acquire(sleep=clock.sleep, max_wait=0.1) == pytest.approx(0.1) and b.wait() == pytest.approx(0.9)


def test_the_sliding_hour_holds_even_with_a_large_burst():
    clock = Clock()
    b = CommitBudget(10, burst=10, clock=clock)
    for _ in range(10):
        assert b.wait() == 0
        b.record()
        clock.sleep(1.0)
    # tokens come back at 10 an hour, but the 10 commits of the last hour are the limit until the first ages out
    clock.sleep(600)
    assert b.wait() == pytest.approx(3600 - 610)
    clock.sleep(3600 - 610)
    assert b.wait() == 0 and b.in_window() == 9


def test_a_server_pause_blocks_every_commit_until_it_passes():
    clock = Clock()
    b = CommitBudget(None, clock=clock)  # no budget: only the server's pauses
    assert not b.limited and b.wait() == 0
    b.record()
    assert b.wait() == 0
    b.block(42.0)
    assert b.wait() == pytest.approx(42.0) and b.blocks == 1
    b.block(5.0)  # a shorter pause never shortens a longer one
    assert b.wait() == pytest.approx(42.0)
    clock.sleep(42.0)
    assert b.wait() == 0


def test_state_dict_round_trip():
    clock = Clock()
    b = CommitBudget(128, clock=clock)
    for _ in range(8):
        b.record()
    b.block(7.0)
    state = b.state_dict()
    c = CommitBudget(128, clock=clock)
    c.load_state_dict(state)
    assert c.in_window() == 8 and c.wait() == pytest.approx(b.wait())


@pytest.mark.parametrize("kw", [{"per_hour": -1}, {"per_hour": 0.5}, {"per_hour": True}, {"burst": 0},
                                {"burst": 1.5}, {"window": 0}])
def test_bad_options_name_themselves(kw):
    with pytest.raises(ValueError, match="commits_per_hour|commit_burst|window"):
        CommitBudget(**{"per_hour": 128, **kw})


def test_retry_after_in_seconds_http_date_and_ratelimit():
    now = 1_700_000_000.0
    assert retry_after({"Retry-After": "7"}) == 7.0
    assert retry_after({"Retry-After": " 2.5 "}) == 2.5
    date = email.utils.formatdate(now + 90, usegmt=True)  # "Wed, 15 Nov 2023 22:14:50 GMT"
    assert retry_after({"Retry-After": date}, now=lambda: now) == pytest.approx(90.0)
    past = email.utils.formatdate(now - 90, usegmt=True)
    assert retry_after({"Retry-After": past}, now=lambda: now) == 0.0  # a date gone by: no wait, never negative
    assert retry_after({"RateLimit": '"api";r=0;t=42'}) == 42.0
    assert retry_after({"RateLimit": '"api";r=5;t=42'}) is None  # requests left: no advice
    assert retry_after({"Retry-After": "99999999"}) == 86400.0  # capped at a day
    for junk in ({}, {"Retry-After": "soon"}, {"Retry-After": "-3"}, {"Retry-After": "1e9"}, None, 42):
        assert retry_after(junk) is None
