"""The suite's own scheduling: tests marked ``one_worker`` (they read one costly module
fixture) run on one pytest-xdist worker under ``--dist worksteal`` (tests/conftest.py's
``pytest_collection_modifyitems`` puts them first; xdist's scheduler is run here on fake
workers, so a release that schedules otherwise fails this test)."""

from __future__ import annotations

import types

import pytest
from xdist.scheduler import WorkStealingScheduling

import conftest


class _Item:
    def __init__(self, name: str, one_worker: bool):
        self.nodeid = name
        self.one_worker = one_worker

    def get_closest_marker(self, name):
        return object() if name == "one_worker" and self.one_worker else None


class _Worker:
    """What the scheduler calls on a worker (what it sends is read from the scheduler's
    ``node2pending``; a steal request is kept until the worker answers it)."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.steal_asked: list[int] = []

    def send_runtest_some(self, indices):
        pass

    def send_steal(self, indices):
        self.steal_asked = list(indices)

    def shutdown(self):
        self.shutting_down = True


def _run_on_two_workers(items: list[_Item]) -> dict[str, str]:
    """Which worker runs each test when the second worker runs three tests in the time the
    first runs one: each ends its tests in its order, and the one that runs out of work
    steals (xdist takes the back half of the other's queue; a worker gives back what it
    has not started)."""
    config = types.SimpleNamespace(getvalue=lambda name: ["2*popen"] if name == "tx" else None)
    scheduler = WorkStealingScheduling(config)
    workers = [_Worker("gw0"), _Worker("gw1")]
    collection = [item.nodeid for item in items]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    ran: dict[str, str] = {}
    for _ in range(10 * len(items)):
        for worker in workers:
            if worker.steal_asked:  # all but the test it runs and the next it holds
                held = scheduler.node2pending[worker][:2]
                given = [i for i in worker.steal_asked if i not in held]
                worker.steal_asked = []
                scheduler.remove_pending_tests_from_node(worker, given)
        for worker, tests in zip(workers, (1, 3)):
            for _ in range(tests):
                pending = scheduler.node2pending[worker]
                if pending and not worker.steal_asked:
                    ran[collection[pending[0]]] = worker.gateway.id
                    scheduler.mark_test_complete(worker, pending[0])
        if not scheduler.has_pending:
            break
    assert sorted(ran) == sorted(collection)
    return ran


@pytest.mark.parametrize("where", [0, 45, 90])
def test_one_worker_tests_run_on_one_worker_wherever_they_are_collected(where):
    names = [f"test_{i}" for i in range(100)]
    items = [_Item(name, one_worker=where <= i < where + 10) for i, name in enumerate(names)]
    conftest.pytest_collection_modifyitems(None, items)
    marked = [item.nodeid for item in items if item.one_worker]
    assert [item.nodeid for item in items[:10]] == marked  # first, in their order
    assert sorted(item.nodeid for item in items) == sorted(names)
    workers = _run_on_two_workers(items)
    assert {workers[name] for name in marked} == {"gw0"}
    # Without the hook, a block that the first worker has not reached when the second
    # runs out of work is split between them.
    workers = _run_on_two_workers([_Item(name, one_worker=False) for name in names])
    assert {workers[name] for name in names[20:30]} == {"gw0", "gw1"}
