"""One options object for both sides of a session (ddpwire.session.options)."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from ddpwire import Coordinator, CoordinatorOptions, SessionOptions, Worker
from ddpwire.wire.channel import heartbeat_limit
from ddpwire.wire.extensions import Extension
from ddpwire.session.options import UNSET

from session_helpers import reference_allreduce, spawn


@pytest.mark.parametrize("bad,match", [
    (dict(timeout=0), "timeout"),
    (dict(timeout=float("nan")), "timeout"),
    (dict(heartbeat=-1.0), "heartbeat"),
    (dict(max_frame=0), "max_frame"),
    (dict(samples_per_step=-1), "samples_per_step"),
    (dict(gradient_length=0), "gradient_length"),
])
def test_a_bad_value_is_refused_once_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        SessionOptions(**bad)


def test_values_are_checked_and_completed_once():
    opts = SessionOptions(heartbeat=0.5, token="secret")
    assert opts.heartbeat_timeout == heartbeat_limit(0.5, None)
    assert opts.token == b"secret"
    with pytest.raises(AttributeError):
        opts.timeout = 1.0  # type: ignore[misc]
    assert opts.replace(timeout=5.0).timeout == 5.0
    with pytest.raises(ValueError, match="timeout"):
        opts.replace(timeout=-1)


def test_options_or_keywords_not_both():
    with pytest.raises(TypeError, match="either options= or timeout"):
        Coordinator(options=SessionOptions(), timeout=3.0)
    with pytest.raises(TypeError, match="either options= or heartbeat"):
        Worker.connect(("127.0.0.1", 1), options=SessionOptions(), heartbeat=1.0)
    with pytest.raises(TypeError, match="SessionOptions"):
        Coordinator(options={"timeout": 3.0})  # type: ignore[arg-type]


def test_one_object_runs_both_sides_of_a_session():
    opts = SessionOptions(timeout=20.0, heartbeat=0.2, token="shared secret", samples_per_step=64,
                          gradient_length=500)
    grads = [np.full(500, i + 1, dtype=np.float32) for i in range(2)]
    with Coordinator(("127.0.0.1", 0), 2, options=opts, join_timeout=20.0) as coord:
        assert coord.options.timeout == 20.0 and coord.options.heartbeat_timeout == opts.heartbeat_timeout

        def body():
            with Worker.connect(coord.local_addr, options=opts) as w:
                shard = w.receive_shard()
                return w.allreduce(shard.step, grads[w.worker_id], 0.0, 0, 32).gradients.copy()
        threads = [spawn(body)]
        coord.wait_for_workers(count=1)
        threads.append(spawn(body))
        coord.wait_for_workers()
        coord.send_shard_assignments(0)
        coord.allreduce(0)
        got = [t.join_result() for t in threads]
    assert all(np.array_equal(g, reference_allreduce(grads)) for g in got)


@pytest.mark.parametrize("bad,match", [
    (dict(topology="ring"), "topology must be"),
    (dict(balance="yes"), "balance must be"),
    (dict(elastic=True, topology="mesh"), "elastic=True averages on the star"),
    (dict(elastic=True, compression="bf16"), "elastic=True averages on the star"),
    (dict(resume=True), "resume picks up an elastic session"),
    (dict(compression="int4"), "compression must be"),
    (dict(compression="bf16", topology="star"), "compression travels on the mesh"),
    (dict(coordinator_share=1.0), "coordinator_share must be"),
    (dict(receive_window=1024), "receive_window must be"),
    (dict(receive_window=True), "receive_window must be"),
    (dict(join_timeout=0), "join_timeout"),
    (dict(handshake_timeout=-1), "handshake_timeout"),
])
def test_a_bad_coordinator_option_is_refused_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        CoordinatorOptions(**bad)
    # the Coordinator's keywords are the same checks, made before it listens
    with pytest.raises(ValueError, match=match):
        Coordinator(("127.0.0.1", 0), 2, **bad)


@pytest.mark.parametrize("bad,per_block,match", [
    (dict(), None, "expect_workers must be at least 1"),
    (dict(topology="mesh"), True, "per_block=True steps always take the star"),
    (dict(elastic=True), True, "elastic=True runs flat steps"),
    (dict(elastic=True, min_workers=3), None, r"min_workers must be from 1 to expect_workers \(2\)"),
    (dict(min_workers=1), None, "it needs elastic=True"),
])
def test_what_the_options_need_of_the_session_is_checked_with_it(bad, per_block, match):
    workers = 0 if not bad else 2
    with pytest.raises(ValueError, match=match):
        CoordinatorOptions(**bad).check(workers, per_block)
    with pytest.raises(ValueError, match=match):
        Coordinator(("127.0.0.1", 0), workers, per_block=per_block, **bad)


def test_the_coordinator_keeps_its_options_as_checked():
    with Coordinator(("127.0.0.1", 0), 2, elastic=True, join_timeout=7) as coord:
        config = coord.config
        assert isinstance(config, CoordinatorOptions)
        # an elastic session averages on the star: the topology says so
        assert config.topology == "star" and config.join_timeout == 7.0
        grants = config.grants(per_block=None)
        assert Extension.ELASTIC in grants and Extension.MESH not in grants
    mesh = CoordinatorOptions().grants(per_block=None)
    assert Extension.MESH in mesh and Extension.BALANCE in mesh
    # per-block steps never take the mesh: it is not offered to their workers
    assert Extension.MESH not in CoordinatorOptions().grants(per_block=True)


def test_the_keywords_are_the_options_fields_with_their_defaults():
    # The keywords are a thin layer over the two objects: each field once,
    # a shared one UNSET (so that options= may stand in for it), one of the
    # coordinator's with the CoordinatorOptions default, which help() shows.
    shared = {f.name for f in dataclasses.fields(SessionOptions)}
    own = {f.name: f.default for f in dataclasses.fields(CoordinatorOptions)}
    params = inspect.signature(Coordinator.__init__).parameters
    keywords = {name: p.default for name, p in params.items()
                if p.kind is p.KEYWORD_ONLY and name != "options"}
    assert set(keywords) == shared | set(own)
    assert all(keywords[name] is UNSET for name in shared)
    assert {name: keywords[name] for name in own} == own
    connect = inspect.signature(Worker.connect).parameters
    assert all(connect[name].default is UNSET for name in shared)
