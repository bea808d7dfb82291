"""The manager's ZeroMQ service loop, in process, against a real socket peer."""
from __future__ import annotations

import threading
import time

import zmq

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.service import ManagerService
from rlboost_hpc.protocol import messages as M


def _serve(svc: ManagerService) -> threading.Thread:
    svc._stop = False
    t = threading.Thread(target=svc.serve_forever, kwargs={"tick_s": 0.01}, daemon=True)
    t.start()
    return t


def test_a_goodbye_queued_before_the_connection_closed_is_applied_before_the_close():
    """Regression (a CI flake): a SIGTERM-ed worker sends its Deregister and exits; when the socket monitor's
    "disconnected" event and the Deregister were both pending in one loop iteration, the close was handled first,
    the instance turned suspect and its responses were migrated as after a crash (tokens regenerated). The loop is
    paused here so that both are pending at once, deterministically."""
    ctx = zmq.Context()
    core = ManagerCore(clock=time.monotonic)
    svc = ManagerService(core, ctx=ctx)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 5000)
    peer.setsockopt(zmq.IDENTITY, b"worker-1")
    try:
        t = _serve(svc)
        peer.connect(svc.endpoint)
        peer.send(M.encode(M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4)))
        assert peer.poll(5000), "no Welcome"
        assert isinstance(M.decode(peer.recv()), M.Welcome)
        svc.stop()
        t.join(5)
        assert not t.is_alive()

        peer.send(M.encode(M.Deregister(reason="preempted (SIGTERM)", tokens_generated=7, cause="preempted")))
        peer.close()  # linger: the Deregister leaves before the connection closes
        deadline = time.monotonic() + 5
        while not svc._monitor.poll(10) and time.monotonic() < deadline:
            pass
        assert svc._monitor.poll(0), "the monitor never reported the closed connection"

        t = _serve(svc)
        deadline = time.monotonic() + 5
        while "j#0" in core.fleet.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        svc.stop()
        t.join(5)
        assert "j#0" in core.fleet.ended and "j#0" not in core.fleet.instances
        assert core.counters.connections_closed == 0
        assert core.counters.instances_preempted_with_warning == 1
    finally:
        svc.close()
        ctx.term()
