"""The emulated cluster, shared by the benchmarks of this folder: built once
per run from DDPWIRE_CLUSTER_* (cluster/params.py), removed at the end."""
from __future__ import annotations

import atexit
import os

import pytest

from . import net, params, plan

try:
    PARAMS = params.ClusterParams.from_env(os.environ)
except ValueError as exc:
    raise pytest.UsageError(str(exc))


@pytest.fixture(scope="session")
def cluster_plan():
    """The emulated network for the whole run, removed at the end whatever happens."""
    reason = net.why_unavailable()
    if reason:
        pytest.skip(reason)
    p = plan.make_plan(PARAMS.max_workers, PARAMS.coord_rate, PARAMS.worker_rate,
                       congestion=PARAMS.congestion)
    cluster = net.Cluster(p)
    try:
        cluster.__enter__()
    except net.NetworkUnavailable as exc:
        pytest.skip(f"cannot build the emulated cluster: {exc}")
    # should the fixture's teardown itself be skipped (a second Ctrl-C)
    atexit.register(cluster.close)
    try:
        yield p
    finally:
        cluster.close()
