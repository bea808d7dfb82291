"""The rollout agent's weights: which version it wants, pulling it, and loading it into the engine.

A part of :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (a mixin: the same state, the same single thread).
Owns the agent's side of weight versions: the version the manager announced and where to fetch it (relay peers,
then the trainer; :meth:`AgentWeights._want`), the pull on the long-lived builder thread — which also builds the
first engine — with its retry back-off, and the load of a finished pull: only while the engine is idle, or, with
``on_new_version = "continue"``, between two decode iterations, every running response continued under the new
weights. A version counts only in the manager epoch it was loaded in (:meth:`AgentWeights.held_version`). A version's
identity is (number, whole-version checksum): the agent pulls whenever the manager's latest differs from what it holds
in either — also to a lower number, which a trainer resumed from an older checkpoint announces — and the pull
refuses a holder whose version of that number has another checksum; a finished pull of a version above the one now
wanted (made by a trainer that no longer exists) is dropped, never loaded. Another kind of weight update (an adapter
loaded next to the base weights) changes this part, not the request loop.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.rollout.engines.base import Engine, GenRequest
from rlboost_hpc.rollout.engines.factory import EngineFactory
from rlboost_hpc.rollout.manager_link import ManagerLink
from rlboost_hpc.rollout.remote_weights import PulledVersion, WeightSource

log = logging.getLogger("rlboost.agent")


def weights_loaded(version: int, got: PulledVersion, load_s: float) -> M.WeightsLoaded:
    """The one place a ``WeightsLoaded`` is built: ``version`` loaded from ``got`` in ``load_s`` seconds (engine
    build or load; 0 for a re-registration that moved nothing)."""
    return M.WeightsLoaded(version=version, checksum=got.checksum, nbytes=got.nbytes, pull_s=got.pull_s,
                           load_s=load_s, wire_bytes=got.wire_bytes)


class AgentWeights:
    """The weight handling of :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (see the module docstring).

    What it uses of the agent is declared below: the state it reads and writes (annotations only; the agent's
    ``__init__`` sets every one, :meth:`~rlboost_hpc.rollout.agent.RolloutAgent.run` the link) and the agent's
    methods it calls (:attr:`CORE_METHODS`). Nothing else of the agent is touched here
    (``tests/test_architecture.py`` checks it).
    """

    #: the agent's methods this part calls
    CORE_METHODS = ("_send", "_interrupt_for_load", "_forget_finished")

    # the agent's state this part reads and writes (set in RolloutAgent.__init__; the link in run())
    link: ManagerLink
    welcome: M.Welcome | None
    keys: RunKeys | None
    engine: Engine | None
    engine_epoch: int | None
    engine_factory: EngineFactory
    weights: WeightSource
    fault_load_delay_s: float
    fault_slow_load: Callable[[], float] | None
    relay_wait_s: float
    want_version: int
    want_checksum: int
    want_source: tuple[str, str]
    want_peers: list[str]
    timings: dict[str, float]
    _builder: ThreadPoolExecutor
    _pull: Future | None
    _pull_failures: int
    _next_pull_at: float

    def held_version(self) -> int:
        """The version the engine holds in the current manager's epoch (-1: none / unknown weights)."""
        if self.engine is None or self.welcome is None or self.engine_epoch != self.welcome.epoch:
            return -1
        return self.engine.version

    def _fault_delay_s(self) -> float:
        """Chaos: extra seconds of this weight load — every load's (``fault_load_delay_s``) plus one the local cluster
        scheduled for this instance (``fault_slow_load``; consumed by this load)."""
        return self.fault_load_delay_s + (self.fault_slow_load() if self.fault_slow_load is not None else 0.0)

    def held_identity(self) -> tuple[int, int]:
        """(version, whole-version checksum) the engine holds in the current manager's epoch ((-1, 0): none)."""
        v = self.held_version()
        return (v, int(getattr(self.engine, "weights_checksum", 0) or 0)) if v >= 0 else (-1, 0)

    def _stale(self) -> bool:
        """The manager's latest differs from what the engine holds: in number (higher or lower: a resumed trainer's
        version), or — both checksums known — in checksum (the same number made by other weights)."""
        held, held_ck = self.held_identity()
        return self.want_version >= 0 and (self.want_version != held or bool(
            self.want_checksum and held_ck and self.want_checksum != held_ck))

    def _want(self, version: int, checksum: int, peers: list[str], wait: bool, source: tuple[str, str] = ("", "")
              ) -> None:
        """The manager's latest ``version`` (whole-version ``checksum``; 0: not known) and where to fetch it: relay
        ``peers`` (then the trainer at ``source`` = (weights endpoint, shard manifest); an empty endpoint: the
        ``Welcome``'s); with ``wait``, not before a ``PullFrom`` — or ``relay_wait_s``, after which the trainer serves
        it anyway. The manager's latest rules, whatever its number: a trainer resumed from an older checkpoint makes
        a lower number the latest, and serves it from its own weight server."""
        if source[0]:
            self.want_source = source
        if (version, checksum) == (self.want_version, self.want_checksum) and self._pull is not None:
            return  # (a repeat of what the pull in flight is fetching)
        if version < self.want_version:
            log.warning("the manager's latest version is now %d (checksum %x), below %d: a resumed trainer's; "
                        "taking it", version, checksum, self.want_version)
        self.want_version, self.want_checksum = version, checksum  # a pull in flight for another: the next fetches this
        self.want_peers = list(peers)
        if wait:
            self._next_pull_at = max(self._next_pull_at, time.monotonic() + self.relay_wait_s)

    def _start_pull(self, version: int, checksum: int = 0) -> None:
        """Pull ``version`` (refusing a holder's version of another whole-version ``checksum``, when not 0) on the
        builder thread; build the engine there too when there is none yet."""
        assert self.welcome is not None
        weights, factory, model_config = self.weights, self.engine_factory, self.welcome.model_config
        endpoint, shards = self.want_source if self.want_source[0] else (self.welcome.weights_endpoint,
                                                                          self.welcome.weights_shards)
        keys = self.keys
        peers = list(self.want_peers)
        arch_json = self.welcome.model_arch
        build = self.engine is None
        slow = self._fault_delay_s if build else (lambda: 0.0)  # (a load's own delay is taken where it loads)

        def work() -> tuple:  # (version, PulledVersion, error, new engine, its build seconds)
            try:
                got = weights.pull(endpoint, version, peers=peers, keys=keys, shards=shards, checksum=checksum)
            except Exception as e:  # reported to the manager with its cause
                return version, None, f"{type(e).__name__}: {e}", None, 0.0
            if not build:
                return version, got, None, None, 0.0
            t0 = time.monotonic()
            try:
                eng = factory(model_config, got.state_dict, arch=ModelArch.from_json(arch_json) if arch_json else None)
                eng.version = version
                eng.weights_checksum = got.checksum
                time.sleep(slow())  # (chaos) a slow first load, on this thread like a slow real start
            except Exception as e:
                return version, None, f"engine start failed: {type(e).__name__}: {e}", None, 0.0
            return version, got, None, eng, time.monotonic() - t0

        self._pull = self._builder.submit(work)
        self._pull.add_done_callback(lambda _f: self.link.wake())  # load it without waiting out the idle poll

    def _weights_step(self) -> None:
        """Start a pull when stale; install a freshly built engine, or load a finished pull once idle."""
        if self._pull is not None and self._pull.done():
            version, got, err, new_engine, build_s = self._pull.result()
            if err is not None:
                self._pull = None
                self._pull_failures += 1
                self._next_pull_at = time.monotonic() + min(5.0, 0.2 * 2 ** self._pull_failures)
                log.warning("pull of version %d failed: %s", version, err)
                self._send(M.WeightsFailed(version=version, error=err))
                return
            if version > self.want_version or (version == self.want_version and self.want_checksum
                                               and got.checksum != self.want_checksum):
                # pulled for a version the manager no longer announces, above (or beside) its latest: a trainer that
                # no longer exists made it (a resume started another lineage) — it can never be routed to
                self._pull = None
                log.warning("dropping pulled version %d (checksum %x): the manager's latest is now %d (checksum %x)",
                            version, got.checksum, self.want_version, self.want_checksum)
                return
            resume: list[GenRequest] = []
            if new_engine is None and self.engine is not None and self.engine.num_active:
                if self.welcome is None or self.welcome.on_new_version != "continue":
                    return  # load only when idle
                resume = self._interrupt_for_load()
            t0 = time.monotonic()
            if new_engine is not None:
                self.engine = new_engine
            else:
                try:
                    delay = self._fault_delay_s()
                    if delay:
                        time.sleep(delay)  # on this thread, like a slow real load
                    self.engine.load_weights(got.state_dict, version)
                    self.engine.weights_checksum = got.checksum
                except Exception as e:
                    self._pull = None
                    self._pull_failures += 1
                    for gen in resume:  # (the engine kept its weights) they go on under the version they began with
                        self.engine.add(gen)
                    self._send(M.WeightsFailed(version=version, error=f"load failed: {type(e).__name__}: {e}"))
                    return
            self._pull, self._pull_failures = None, 0
            self.engine_epoch = self.welcome.epoch
            for gen in resume:  # under the new weights, from every token generated so far
                self.engine.add(gen)
            self._forget_finished()  # responses of the version before: no manager asks for them again
            self.timings.setdefault("weights_loaded", time.time())
            self._send(weights_loaded(version, got, build_s if new_engine is not None else time.monotonic() - t0))
            return
        if self._pull is None and self._stale() and time.monotonic() >= self._next_pull_at:
            self._start_pull(self.want_version, self.want_checksum)
