"""The suite's own scheduling (tests/conftest.py): the slow files dealt to the xdist workers.

Until 2026-12-06 the dealing never ran: it read `--dist` and `-n` from the worker's options,
which xdist resets to "no" and None in a worker, and only workers collect under xdist. So
each worker took a contiguous half of the files in alphabetical order, and the two longest
notebooks, collected last, ran last on one worker.
"""

import types

import conftest
import pytest


def _items(files: dict[str, int]) -> list:
    return [
        types.SimpleNamespace(nodeid=f"{path}::test_{i}")
        for path, count in files.items()
        for i in range(count)
    ]


def _worker(dist: str, workercount: int = 2):
    """A config as a worker process sees it: xdist's own options reset, `workerinput` as
    the controller's `pytest_configure_node` left it."""
    controller = types.SimpleNamespace(getoption=lambda name, default=None: dist)
    node = types.SimpleNamespace(config=controller, workerinput={"workercount": workercount})
    conftest.pytest_configure_node(node)
    return types.SimpleNamespace(
        option=types.SimpleNamespace(dist="no", numprocesses=None),
        getoption=lambda name, default=None: {"dist": "no"}.get(name, default),
        workerinput=node.workerinput,
    )


def test_workers_deal_the_slow_files_first_under_worksteal():
    slow = sorted(conftest.SLOW_FILES, key=lambda f: -conftest.SLOW_FILES[f])
    files = {"tests/test_a.py": 40, slow[1]: 3, "tests/test_b.py": 40, slow[0]: 2}
    items = _items(files)
    before = list(items)
    conftest.pytest_collection_modifyitems(_worker("worksteal"), items)
    assert sorted(map(id, items)) == sorted(map(id, before))  # nothing lost or repeated
    # xdist's worksteal gives worker i the i-th contiguous half: the heaviest file opens
    # the first, the next heaviest the second, each whole.
    half = len(items) // 2
    first, second = items[:half], items[half:]
    assert [i.nodeid.split("::")[0] for i in first[:2]] == [slow[0]] * 2
    assert [i.nodeid.split("::")[0] for i in second[:3]] == [slow[1]] * 3
    # The other tests keep their order.
    rest = [i for i in items if i.nodeid.split("::")[0] not in slow[:2]]
    assert rest == [i for i in before if i.nodeid.split("::")[0] not in slow[:2]]


@pytest.mark.parametrize("dist", ["load", "no"])
def test_other_modes_and_one_process_keep_the_usual_order(dist):
    files = {"tests/test_a.py": 40, max(conftest.SLOW_FILES, key=conftest.SLOW_FILES.get): 2}
    items = _items(files)
    before = list(items)
    conftest.pytest_collection_modifyitems(_worker(dist), items)
    assert items == before
    # One process (no xdist): no `workerinput`.
    one = types.SimpleNamespace(option=types.SimpleNamespace(dist="no", numprocesses=None))
    conftest.pytest_collection_modifyitems(one, items)
    assert items == before
