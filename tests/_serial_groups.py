"""The suite's xdist groups (registered by tests/conftest.py): tests that share one machine-wide resource run in one
worker, one after another."""
from __future__ import annotations

import pytest


#: Markers whose tests share one resource and run in one xdist worker, one after another (``--dist loadgroup``,
#: group "serial"): the local Slurm cluster (one per machine: its queue, nodes and partitions; a test's cleanup
#: cancels every job it finds) and the SGLang tests (two servers each). Two such tests at once on 2 cores would fight
#: over the cluster or hold four servers.
SERIAL_MARKERS = ("slurm", "sglang")
SERIAL_GROUP = "serial"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Put the tests of :data:`SERIAL_MARKERS` in xdist group :data:`SERIAL_GROUP`.

    pytest-xdist 3.8 groups by a ``@<group>`` suffix it writes to ``item._nodeid``, which pytest ≥ 9.2 no longer
    reads (node ids live in ``item._id``): its ``xdist_group`` marker then groups nothing and the Slurm tests ran in
    both workers at once. The suffix is written here, through the attribute this pytest reads
    (tests/test_serial_groups.py runs a small session in two workers to see that it holds)."""
    for item in items:
        if not any(item.get_closest_marker(m) is not None for m in SERIAL_MARKERS):
            continue
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
        if not getattr(config.option, "loadgroup", False) or item.nodeid.endswith("@" + SERIAL_GROUP):
            continue
        if hasattr(item, "_id"):  # pytest ≥ 9.2
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(f"{item.nodeid}@{SERIAL_GROUP}")
