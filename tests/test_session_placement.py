"""Session placement policies and turn planning: pure logic, no model."""

from __future__ import annotations

import random

import pytest

from ragfuse.engine.errors import RequestError
from ragfuse.engine.sessions import FIFOPolicy, LRUPolicy, SchedulerAwarePolicy, SessionInfo, SessionPlacement
from ragfuse.engine.sessions.history import common_prefix, plan_turn, surely_fed
from ragfuse.engine.sessions.source import read_buffer_layers


def infos() -> list[SessionInfo]:
    # created order a, b, c, d; last access order d, b, a, c (c the most recent)
    return [SessionInfo("a", 10, 0.0, 3.0), SessionInfo("b", 10, 1.0, 2.0), SessionInfo("c", 10, 2.0, 4.0),
            SessionInfo("d", 10, 3.0, 1.0)]


def ids(order: list[SessionInfo]) -> list[str]:
    return [s.session_id for s in order]


def test_lru_and_fifo_orders_ignore_the_queue() -> None:
    assert ids(LRUPolicy().order(infos(), ["d"], 4)) == ["d", "b", "a", "c"]
    assert ids(FIFOPolicy().order(infos(), ["a"], 4)) == ["a", "b", "c", "d"]


def test_scheduler_aware_evicts_outside_the_window_first_then_from_its_tail() -> None:
    order = SchedulerAwarePolicy().order(infos(), ["c", "d", "a", "b"], window=3)
    # b is queued beyond the window: evicted first; then the window from its tail: a, d, c
    assert ids(order) == ["b", "a", "d", "c"]


def placement(policy, cpu: int = 20, disk: int = 1000) -> SessionPlacement:
    p = SessionPlacement(cpu, disk, policy)
    for t, sid in enumerate(["a", "b"]):
        p.admit(sid, 10, float(t))
    return p


def test_admission_keeps_the_queued_session_in_memory_where_lru_would_drop_it() -> None:
    lru, aware = placement(LRUPolicy()), placement(SchedulerAwarePolicy())
    for p in (lru, aware):
        moves = p.admit("c", 10, 5.0, queue=["a"])
        assert p.tier_of("c") == "cpu"
        assert ("persist", "c") in [(m.action, m.session_id) for m in moves]
    assert lru.tier_of("a") == "disk" and lru.tier_of("b") == "cpu"  # a was least recently used
    assert aware.tier_of("a") == "cpu" and aware.tier_of("b") == "disk"  # a is about to run


def test_a_session_not_queued_goes_to_disk_only_when_memory_holds_those_queued_next() -> None:
    """A job queue served one turn at a time: the turn that just ran saved its session into memory by
    evicting the session queued next, which prefetching had just brought in, so that one ran from disk."""
    aware = placement(SchedulerAwarePolicy(), cpu=20)  # memory holds a and b
    moves = aware.admit("c", 10, 5.0, queue=["a", "b"])
    assert aware.tier_of("c") == "disk" and aware.tier_of("a") == aware.tier_of("b") == "cpu"
    assert [(m.action, m.session_id) for m in moves] == [("persist", "c")]
    aware.admit("a", 10, 6.0, queue=["a", "b"])  # a queued session is admitted as before
    assert aware.tier_of("a") == "cpu"
    lru = placement(LRUPolicy(), cpu=20)
    lru.admit("c", 10, 5.0, queue=["a", "b"])
    assert lru.tier_of("c") == "cpu" and lru.tier_of("a") == "disk"  # recency alone


def test_prefetch_window_fetches_queued_disk_sessions_and_counts_hits_by_tier() -> None:
    p = placement(SchedulerAwarePolicy(), cpu=20)
    p.admit("c", 10, 5.0)  # memory holds b, c; a is on disk only
    assert p.tier_of("a") == "disk"
    assert p.prefetch_window() == 2  # 20 bytes of memory / 10 bytes a session
    moves = p.prefetch(["a", "c"])
    assert [(m.action, m.session_id) for m in moves] == [("uncache", "b"), ("fetch", "a")]
    assert p.access("a", 7.0) == "cpu" and p.access("zz", 7.0) is None
    assert (p.stats.hits_cpu, p.stats.misses) == (1, 1)
    assert LRUPolicy().prefetches is False and placement(LRUPolicy()).prefetch(["a"]) == []


def test_disk_eviction_forgets_whole_sessions_and_ttl_expires_idle_ones() -> None:
    p = SessionPlacement(0, 25, LRUPolicy(), ttl_s=10.0)
    p.admit("a", 10, 0.0)
    p.admit("b", 10, 1.0)
    moves = p.admit("c", 10, 2.0)
    assert ("forget", "a") in [(m.action, m.session_id) for m in moves] and p.tier_of("a") is None
    assert [m.session_id for m in p.expire(11.5)] == ["b"]
    assert p.tier_of("c") == "disk" and p.stats.expired == 1


def test_plan_reuses_the_common_prefix_and_feeds_the_rest() -> None:
    stored = list(range(10, 30))  # 20 logical tokens, rows for the first 19
    plan = plan_turn(list(range(10, 30)) + [7, 8, 9], stored, [(0, 19)], 100, 8, 3, 2)
    assert plan.reused == 19 and plan.ranges == [(0, 23)] and plan.rows is None
    diverged = plan_turn(list(range(10, 20)) + [1, 2, 3], stored, [(0, 19)], 100, 8, 3, 2)
    assert diverged.reused == 10 and diverged.token_ids == list(range(10, 20)) + [1, 2, 3]


def test_plan_cuts_the_oldest_history_on_overflow_keeping_first_and_new_tokens() -> None:
    conv = list(range(100, 160))  # 60 tokens, the last 10 new; rows stored for the first 50
    plan = plan_turn(conv, conv[:50], [(0, 50)], max_len=48, reserve=8, new_tokens=10, keep_first=4)
    # body = 60 - 10 - 4 = 46; need 60 + 8 - 48 = 20; cut max(20, 23) = 23 after the first 4
    assert plan.ranges == [(0, 4), (27, 60)] and plan.truncated == 23
    assert plan.rows == list(range(4)) + list(range(27, 50)) and plan.reused == 27
    assert plan.token_ids == conv[:4] + conv[27:]
    with pytest.raises(RequestError, match="does not fit"):
        plan_turn(conv, None, None, max_len=20, reserve=8, new_tokens=30, keep_first=4)


def test_surely_fed_is_the_history_both_plans_feed() -> None:
    history = list(range(100, 150))  # 50 logical tokens; rows stored for [0, 4) and [20, 50): 16 cut before
    stored = [(0, 4), (20, 50)]
    assert surely_fed(history, stored, [1] * 6, 200, 8, 4) == [(0, 4), (20, 50)]  # no overflow
    # overflow: over the rows, 34 fed + 6 + 8 - 40 = 8 to cut, max(8, 15) = 15 after the first 4 -> [35, 50);
    # recomputed whole, 50 fed: 24 to cut, max(24, 23) = 24 -> [28, 50); both: [35, 50)
    assert surely_fed(history, stored, [1] * 6, 40, 8, 4) == [(0, 4), (35, 50)]
    assert surely_fed(history, stored, [1] * 40, 40, 8, 4) == []  # the prompt does not fit at all


@pytest.mark.parametrize("seed", range(5))
def test_a_shorter_prompt_feeds_all_that_surely_fed_promised(seed: int) -> None:
    """What lets a follow-up question leave out chunks the history holds: planned for the whole
    prompt, the promise holds for any shorter prompt, over the stored rows or recomputed."""
    rng = random.Random(seed)
    for _ in range(200):
        n = rng.randrange(5, 80)
        history = [rng.randrange(1000) for _ in range(n)]
        a = rng.randrange(0, n)
        b = rng.randrange(a, n)
        stored = [r for r in [(0, a), (b, n)] if r[1] > r[0]] or [(0, n)]
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        max_len, reserve, keep = rng.randrange(20, 120), rng.randrange(1, 16), rng.randrange(0, 6)
        promised = surely_fed(history, stored, prompt, max_len, reserve, keep)
        shorter = prompt[: rng.randrange(1, len(prompt) + 1)]
        for rows in ((history, stored), (None, None)):
            try:
                plan = plan_turn(history + shorter, *rows, max_len, reserve, len(shorter), keep)
            except RequestError:
                assert promised == []
                continue
            fed = {i for s, e in plan.ranges for i in range(s, e)}
            assert all(i in fed for s, e in promised for i in range(s, e))


def _stalls(layers: int, load_s: float, prefill_s: float, k: int) -> bool:
    """Whether a turn with ``k`` layers in the read buffer waits for a copy: layer i >= k lands
    (i - k + 1) c after the start and is needed at i f."""
    c, f = load_s / layers, prefill_s / layers
    return any((i - k + 1) * c > i * f + 1e-12 for i in range(k, layers))


@pytest.mark.parametrize("load_s,prefill_s", [(69.0, 33.0), (10.0, 12.0), (3.0, 10.0), (40.0, 39.0), (100.0, 1.0)])
def test_read_buffer_is_the_fewest_layers_that_leave_no_stall(load_s: float, prefill_s: float) -> None:
    k = read_buffer_layers(32, load_s, prefill_s)
    assert 1 <= k <= 32 and not _stalls(32, load_s, prefill_s, k)
    assert k == 1 or _stalls(32, load_s, prefill_s, k - 1)
    assert read_buffer_layers(32, 0.0, 5.0) == 0  # nothing to load
    assert read_buffer_layers(32, 5.0, 0.0) == 32


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2], [1, 2, 3], 2), ([5], [6], 0)])
def test_common_prefix_small(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == n


def test_common_prefix_across_chunks() -> None:
    a = list(range(1000))
    for at in (0, 255, 256, 257, 511, 999):
        b = a[:at] + [-1] + a[at + 1 :]
        assert common_prefix(a, b) == common_prefix(b, a) == at
    assert common_prefix(a, a[:700]) == 700
