"""Issue 58, item 1: OpenEnv environments (``task.environment.openenv``). Every test here talks to a real OpenEnv
server — ``examples/openenv_counter/server.py``, an ``openenv-core`` ``Environment`` served by
``create_fastapi_app`` and uvicorn — started as its own process; none fakes the server or the client.

The first tests drive one side, :class:`OpenEnvEpisode` (the session of one trajectory), against that server; the
last ones go through the user's door: ``rlboost-hpc task check`` and ``rlboost-hpc run`` of the example, a manager
kill in the middle, every session the run opened closed on the server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlboost_hpc.config_task import OpenEnvCfg
from rlboost_hpc.rollout.engines.sglang_server import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples/openenv_counter"
ROW = {"prompt": "Tom had a toy car.", "start": 5, "target": 4}


class CounterServer:
    """The example's OpenEnv server in its own process on a fixed port (so a restart is the same URL)."""

    def __init__(self, log: Path) -> None:
        self.port, self.log, self.proc = free_port(), log, None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "CounterServer":
        self.proc = subprocess.Popen([sys.executable, str(EXAMPLE / "server.py"), "--port", str(self.port)],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(1200):  # ≈ 5 s of imports on an idle box; the test's timeout is the last resort
            if self.proc.poll() is not None:
                raise AssertionError(f"the OpenEnv server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                self.sessions()
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the OpenEnv server did not answer in 120 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def sessions(self) -> dict:
        """What the server counted: environments ``opened``, ``closed`` and ``open`` now (since it started)."""
        with urllib.request.urlopen(self.url + "/sessions", timeout=5) as r:
            return json.loads(r.read())


@pytest.fixture
def server(tmp_path):
    s = CounterServer(tmp_path / "server.log").start()
    yield s
    s.stop()


def episode(url: str, timeout_s: float = 10.0, **kw):
    from rlboost_hpc.tasks.openenv import OpenEnvEpisode

    cfg = OpenEnvCfg(**{"url": url, "observation_field": "text", "reset_columns": ["start", "target"],
                        "backoff_s": 0.2, **kw})
    return OpenEnvEpisode(cfg, timeout_s)


def test_one_side_an_episode_is_one_session_reset_with_the_rows_columns_stepped_and_closed(server):
    """The episode against the real server: reset passes the row's columns (and a seed from the row), each step's
    reward and done are the environment's, close ends the session on the server — and the same row and turns give
    the same answers in a second session (what a rebuild by replay relies on)."""
    from rlboost_hpc.tasks.openenv import row_seed

    answers = []
    for _ in range(2):
        e = episode(server.url)
        first = e.reset(ROW)
        assert server.sessions()["open"] == 1
        answers.append([first, e.step("up up"), e.step("down down down")])
        e.close()
        e.close()  # a second close changes nothing
        assert server.sessions()["open"] == 0
    assert answers[0] == answers[1]
    assert answers[0] == ["Counter 5, target 4: up or down?", ("Counter 7, target 4: up or down?", -0.2, False),
                          ("Counter 4: target reached!", 1.0, True)]
    assert row_seed(ROW) == row_seed(dict(reversed(list(ROW.items())))) != row_seed({**ROW, "start": 6})


def test_one_side_a_dropped_session_is_reopened_by_replay_and_the_episode_goes_on_where_it_was(server):
    """The server dies mid-episode and comes back on the same URL: the next step opens a new session, replays reset
    and the earlier turns (each answer checked), and answers as the episode would have."""
    e = episode(server.url)
    e.reset(ROW)
    assert e.step("up") == ("Counter 6, target 4: up or down?", -0.1, False)
    server.stop()
    server.start()
    assert e.step("down") == ("Counter 5, target 4: up or down?", 0.1, False)
    assert server.sessions() == {"opened": 1, "closed": 0, "open": 1}  # the replay's session, held on
    assert e.step("down") == ("Counter 4: target reached!", 1.0, True)
    e.close()
    assert server.sessions()["open"] == 0


def test_one_side_a_server_gone_or_answering_otherwise_fails_the_call_naming_what_is_wrong(server, tmp_path):
    """A server that is not there: ConnectionError after 1 + retries tries, naming the URL. An observation without
    the configured field: OpenEnvError naming task.environment.openenv.observation_field. A row without a
    reset column: KeyError naming task.environment.openenv.reset_columns."""
    from rlboost_hpc.tasks.openenv import OpenEnvError

    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=r"OpenEnv server http://127\.0\.0\.1:\d+: .*\(3 tries\)"):
        episode(gone, retries=2).reset(ROW)
    e = episode(server.url, observation_field="nope")
    with pytest.raises(OpenEnvError, match=r"observation_field = 'nope'.*\['target', 'text', 'value'\]"):
        e.reset(ROW)
    e.close()
    with pytest.raises(KeyError, match="reset_columns: the row has no column 'target'"):
        episode(server.url).reset({"prompt": "x", "start": 1})
    assert server.sessions()["open"] == 0


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_task_check_probes_the_openenv_server_and_refuses_one_that_is_not_there_naming_the_key(server, tmp_path):
    """`rlboost-hpc task check` of the example: first observations through the server's sessions, a step, OK; every
    session it opened closed. Pointed at a port where no server listens: exit 2 naming
    task.environment.openenv.url, no traceback."""
    cache = f"task.data.cache_dir='{tmp_path / 'cache'}'"
    p = cli("task", "check", "--config", str(EXAMPLE / "config.toml"), "--set", f"task.environment.openenv.url="
            f"'{server.url}'", "--set", cache)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "environment openenv: first observation of row" in p.stdout and "task check: OK" in p.stdout, p.stdout
    s = server.sessions()
    assert s["open"] == 0 and s["opened"] > 3, s
    p = cli("task", "check", "--config", str(EXAMPLE / "config.toml"), "--set",
            f"task.environment.openenv.url='http://127.0.0.1:{free_port()}'", "--set", cache)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "task.environment.openenv.url" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.chaos
def test_the_openenv_example_trains_through_a_manager_kill_and_every_session_it_opened_is_closed(server, tmp_path):
    """`rlboost-hpc run` of examples/openenv_counter on the local cluster (preemptible workers), its manager SIGKILLed
    while trajectories are half-way: the restarted manager's tool processes open new sessions and replay the
    journaled turns (each answer checked); the run ends with nothing lost, duplicated, off-version or trained
    twice, the environment's reward trained on, and the server holding no session open."""
    from test_environment import trained_through_a_manager_kill

    rep = trained_through_a_manager_kill(EXAMPLE / "config.toml", tmp_path,
                                         f"task.environment.openenv.url='{server.url}'")
    assert rep["reward_functions"]["openenv"]["calls"] > 0
    # the killed manager's sessions were closed by the server when their sockets closed; every other by its episode
    s = server.sessions()
    assert s["open"] == 0 and s["opened"] > 3 * 8 * 8 / 8, s
