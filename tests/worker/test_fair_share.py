"""Fair share in the scheduler (worker/fair_share.py): one client cannot hold more than its cap of
running slots, so another client's request is admitted at the next pass; admission alternates
between waiting clients; a client's slots come back as its requests finish or abort."""

from cde.shared.protocol import GenerateRequest
from cde.worker.fair_share import default_per_client
from cde.worker.scheduler import Scheduler


def _scheduler(max_running: int, per_client: int | None) -> Scheduler:
    return Scheduler(1000, max_running, 256, eot_id=None, max_running_per_client=per_client)


def _admitted(s: Scheduler) -> list[str]:
    """The requests the next pass admits."""
    return [new.params.request_id for new in s.schedule().new]


def _add(s: Scheduler, client: str, n: int, max_tokens: int = 192) -> list[str]:
    ids = [f"{client}{i}" for i in range(n)]
    for rid in ids:
        s.add(GenerateRequest(rid, [1] * 64, max_tokens=max_tokens, client=client))
    return ids


def test_the_default_cap_leaves_a_quarter_of_the_slots():
    assert [default_per_client(n) for n in (1, 2, 4, 16, 64)] == [1, 1, 3, 12, 48]


def test_one_client_with_n_16_leaves_room_for_another():
    s = _scheduler(16, default_per_client(16))
    _add(s, "a", 16)
    assert _admitted(s) == [f"a{i}" for i in range(12)] and len(s.waiting) == 4
    _add(s, "b", 1, max_tokens=16)
    assert _admitted(s) == ["b0"]  # at the next pass
    assert {q.req.client for q in s.waiting} == {"a"}


def test_admission_alternates_between_clients():
    s = _scheduler(6, None)
    _add(s, "a", 6)
    _add(s, "b", 3)
    _add(s, "c", 1)
    order = _admitted(s)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_a_clients_slots_come_back_when_its_requests_end():
    s = _scheduler(4, 2)
    _add(s, "a", 4)
    assert _admitted(s) == ["a0", "a1"]
    assert _admitted(s) == []  # two slots free, but a is at its cap
    assert s.abort("a0")
    assert _admitted(s) == ["a2"]


def test_a_client_at_its_cap_lets_the_next_pass_plan_ahead():
    """Async scheduling stops only for an admission the next pass makes: not while the waiting
    client is at its cap, nor while the one whose turn it is waits for pages."""
    s = _scheduler(4, 2)
    _add(s, "a", 3)
    assert _admitted(s) == ["a0", "a1"] and not s.may_admit()
    _add(s, "b", 1)
    assert s.may_admit() and _admitted(s) == ["b0"] and not s.may_admit()
    short = Scheduler(4, 4, 256, eot_id=None)
    short.add(GenerateRequest("big", [1] * 64, max_tokens=128))  # 3 of the 4 pages
    short.schedule()
    short.add(GenerateRequest("late", [], max_tokens=65))  # 2 pages
    assert not short.may_admit()
    assert short.abort("big") and short.may_admit()
