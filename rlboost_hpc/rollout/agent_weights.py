"""The rollout agent's weights: which version it wants, pulling it, and loading it into the engine.

A collaborator of :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (its ``weight_slot``, :class:`WeightSlot`).
Owns the agent's side of weight versions: the version the manager announced and where to fetch it (relay peers,
then the trainer; :meth:`WeightSlot.want_version`), the pull on the long-lived builder thread — which also builds the
first engine — with its retry back-off, and the load of a finished pull: only while the engine is idle, or, with
``on_new_version = "continue"``, between two decode iterations, every running response continued under the new
weights. A version counts only in the manager epoch it was loaded in (:meth:`WeightSlot.held_version`). A version's
identity is (number, whole-version checksum): the agent pulls whenever the manager's latest differs from what it holds
in either — also to a lower number, which a trainer resumed from an older checkpoint announces — and the pull
refuses a holder whose version of that number has another checksum; a finished pull of a version above the one now
wanted (made by a trainer that no longer exists) is dropped, never loaded.

LoRA runs (``Welcome.adapter``): the first engine is built on the base (:mod:`rlboost_hpc.weights.lora_base`:
``model.path`` on this node, the node's cache, or one pull), then every version is an adapter. An adapter is loaded
at once into a free slot of the engine — requests of older versions go on under theirs, each response's tokens
stamped with the version that produced it — and the slot it needs is freed first from a version no request in flight
names (the oldest); versions older than the engine's ``max_adapters`` window are unloaded once nothing names them.
When every slot is named (never under the manager's staleness window) the load waits for the next loop iteration
while generation goes on: no load or unload ever waits on requests. The version's checksum is the adapter's combined
with the base's (:func:`~rlboost_hpc.protocol.adapter.adapter_version_checksum`); an instance whose base is not the
run's refuses to serve, says why (``WeightsFailed``) and never pulls again. (A holder's adapter is checked against
that combined identity once pulled, not by the pull: the manifest carries the adapter's own checksum.) After a
resumed trainer's lower number (a new lineage) the adapters loaded before serve nothing — a number alone does not
say whose version it is — and are the first unloaded.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.protocol.version import NO_VERSION, VersionId
from rlboost_hpc.weights.lora_base import BaseMismatch
from rlboost_hpc.rollout.agent_responses import AgentResponses
from rlboost_hpc.rollout.engines.base import Engine, GenRequest
from rlboost_hpc.rollout.engines.factory import EngineFactory
from rlboost_hpc.weights.source import BaseWeights, PulledVersion, WeightSource, identity

log = logging.getLogger("rlboost.agent")


def weights_loaded(version: int, got: PulledVersion, load_s: float, *, checksum: int | None = None,
                   base: BaseWeights | None = None) -> M.WeightsLoaded:
    """The one place a ``WeightsLoaded`` is built: ``version`` loaded from ``got`` in ``load_s`` seconds (engine
    build or load; 0 for a re-registration that moved nothing); ``checksum``: the version's identity when it is not
    ``got``'s (an adapter on its base); ``base``: the base loaded with it (a LoRA instance's first version: its
    source and network bytes; its seconds added to ``pull_s``)."""
    return M.WeightsLoaded(version=version, checksum=got.checksum if checksum is None else checksum, nbytes=got.nbytes,
                           pull_s=got.pull_s + (base.seconds if base else 0.0), load_s=load_s,
                           wire_bytes=got.wire_bytes, base_source=base.source if base else "",
                           base_wire_bytes=base.wire_bytes if base else 0)


@dataclass
class _Pulled:
    """What the builder thread hands back: the version, its pull (None on failure), the error, a new engine with its
    build seconds, whether the failure means this instance must never serve (another base), and the base loaded."""

    version: int
    got: PulledVersion | None
    error: str | None = None
    engine: Engine | None = None
    build_s: float = 0.0
    refuse: bool = False
    base: BaseWeights | None = None


class WeightSlot:
    """The weights of one rollout instance (see the module docstring): the engine, the manager epoch its weights were
    loaded in, the version the manager wants and where to fetch it, the pull in flight on the long-lived builder
    thread and its back-off, the adapter versions of the current lineage. A collaborator of
    :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (its ``weight_slot``) that owns this state; it reaches the rest of
    the agent only through what it is built with — ``send`` (a message to the manager), ``welcome()`` (the manager's
    ``Welcome``, None before one), ``wake()`` (wake the agent's loop: a pull finished), ``responses`` (to continue
    running responses across a load), ``label()`` (``job#attempt`` for logs) and ``on_loaded()``. Single-threaded
    (the agent's loop) except the builder thread's pull, whose result the loop takes."""

    def __init__(self, *, source: WeightSource, engine_factory: EngineFactory, keys: RunKeys | None,
                 builder: ThreadPoolExecutor, send: Callable[[M._Msg], None],
                 welcome: Callable[[], M.Welcome | None], wake: Callable[[], None], responses: AgentResponses,
                 label: Callable[[], str], on_loaded: Callable[[], None] = lambda: None,
                 engine: Engine | None = None, engine_epoch: int | None = None, relay_wait_s: float = 10.0,
                 fault_load_delay_s: float = 0.0, fault_slow_load: Callable[[], float] | None = None) -> None:
        self.source, self.engine_factory, self.keys, self._builder = source, engine_factory, keys, builder
        self._send, self._welcome, self._wake, self.responses = send, welcome, wake, responses
        self._label, self._on_loaded = label, on_loaded
        self.engine = engine  # an engine kept from a previous connection (worker reconnect)
        self.engine_epoch = engine_epoch  # manager epoch of the engine's weights (versions are (epoch, version))
        self.relay_wait_s = relay_wait_s  # longest wait for relay capacity before pulling from the trainer
        self.fault_load_delay_s = fault_load_delay_s  # chaos: weight loads slower than the heartbeat deadline
        self.fault_slow_load = fault_slow_load  # chaos: extra seconds of the next load, when the cluster scheduled one
        self.want = NO_VERSION  # the manager's latest version
        self.want_source = ("", "")  # where the trainer serves it (weights endpoint, shards); "": the Welcome's
        self.want_peers: list[str] = []
        self._pull: Future | None = None
        self._pull_failures = 0
        self._next_pull_at = 0.0
        self._refused: str | None = None  # why this instance refuses to serve for good (another base model)
        self._lineage_adapters: set[int] = set()  # adapter versions loaded since the trainer's lineage last changed

    @property
    def welcome(self) -> M.Welcome | None:
        """The manager's ``Welcome`` (its epoch, weight server, model, settings); None before one."""
        return self._welcome()

    def held_version(self) -> int:
        """The version the engine holds in the current manager's epoch (-1: none / unknown weights)."""
        if self.engine is None or self.welcome is None or self.engine_epoch != self.welcome.epoch:
            return -1
        return self.engine.version

    def servable(self, version: int) -> bool:
        """Whether the engine serves ``version`` in the current epoch: the version held, or (adapter engines) any
        adapter version it still holds that was loaded since the trainer's lineage last changed."""
        held = self.held_version()
        if held < 0 or not self.engine.max_adapters:
            return held >= 0 and version == held
        return version in self._lineage_adapters and version in self.engine.adapter_versions()

    def _fault_delay_s(self) -> float:
        """Chaos: extra seconds of this weight load — every load's (``fault_load_delay_s``) plus one the local cluster
        scheduled for this instance (``fault_slow_load``; consumed by this load)."""
        return self.fault_load_delay_s + (self.fault_slow_load() if self.fault_slow_load is not None else 0.0)

    def held_identity(self) -> VersionId:
        """The version the engine holds in the current manager's epoch (:data:`NO_VERSION`: none)."""
        v = self.held_version()
        return VersionId(v, int(getattr(self.engine, "weights_checksum", 0) or 0)) if v >= 0 else NO_VERSION

    def stale(self) -> bool:
        """The manager's latest differs from what the engine holds: in number (higher or lower: a resumed trainer's
        version), or — both checksums known — in checksum (the same number made by other weights)."""
        return self.want.number >= 0 and not self.want.same_weights(self.held_identity())

    def want_version(self, version: VersionId, peers: list[str], wait: bool,
                     source: tuple[str, str] = ("", "")) -> None:
        """The manager's latest ``version`` (its checksum 0: not known) and where to fetch it: relay
        ``peers`` (then the trainer at ``source`` = (weights endpoint, shard manifest); an empty endpoint: the
        ``Welcome``'s); with ``wait``, not before a ``PullFrom`` — or ``relay_wait_s``, after which the trainer serves
        it anyway. The manager's latest rules, whatever its number: a trainer resumed from an older checkpoint makes
        a lower number the latest, and serves it from its own weight server."""
        if source[0]:
            self.want_source = source
        if version == self.want and self._pull is not None:
            return  # (a repeat of what the pull in flight is fetching)
        if version.number < self.want.number or (version.number == self.want.number
                                                 and not version.same_weights(self.want)):
            log.warning("the manager's latest version is now %s, not above %s: a resumed trainer's; taking it",
                        version, self.want)
            self._lineage_adapters.clear()  # the adapters held are another lineage's: they serve nothing now
        self.want = version  # a pull in flight for another: the next fetches this
        self.want_peers = list(peers)
        if wait:
            self._next_pull_at = max(self._next_pull_at, time.monotonic() + self.relay_wait_s)

    def pull_from(self, version: VersionId, peers: list[str]) -> None:
        """The manager's ``PullFrom``: relay capacity for ``version`` at ``peers`` — start now (or once the pull in
        flight ends), if it is still the version wanted."""
        if version == self.want:
            self.want_peers = list(peers)
            self._next_pull_at = time.monotonic()

    def _start_pull(self, want: VersionId) -> None:
        """Pull version ``want`` (refusing a holder's version of another identity, when it is known: whole weights or
        a LoRA adapter on the run's base) on the builder thread; build the engine there too when there is none yet (on
        the run's base first, in a LoRA run)."""
        version, checksum = want.number, want.checksum
        assert self.welcome is not None
        weights, factory, model_config = self.source, self.engine_factory, self.welcome.model_config
        endpoint, shards = self.want_source if self.want_source[0] else (self.welcome.weights_endpoint,
                                                                          self.welcome.weights_shards)
        keys = self.keys
        peers = list(self.want_peers)
        arch_json, adapter = self.welcome.model_arch, self.welcome.adapter
        build = self.engine is None
        label = self._label()
        slow = self._fault_delay_s if build else (lambda: 0.0)  # (a load's own delay is taken where it loads)

        def work() -> _Pulled:
            arch = ModelArch.from_json(arch_json) if arch_json else None
            base = None
            if build and adapter is not None:
                try:
                    base = weights.base(adapter, arch, keys=keys, label=label)
                except BaseMismatch as e:
                    return _Pulled(version, None, f"refusing to serve: {e}", refuse=True)
                except Exception as e:  # noqa: BLE001 - a failed base pull is retried like any pull
                    return _Pulled(version, None, f"base model: {type(e).__name__}: {e}")
            try:
                got = weights.pull(endpoint, version, peers=peers, keys=keys, shards=shards, checksum=checksum,
                                   adapter=adapter)
            except Exception as e:  # reported to the manager with its cause
                return _Pulled(version, None, f"{type(e).__name__}: {e}")
            if not build:
                return _Pulled(version, got)
            t0 = time.monotonic()
            try:
                kw = {"adapter": adapter} if adapter is not None else {}
                eng = factory(model_config, base.state_dict if base is not None else got.state_dict, arch=arch, **kw)
                if adapter is not None:
                    eng.load_adapter(got.state_dict, version)  # (this lineage's: :meth:`_finish_pull` records it)
                eng.version = version
                eng.weights_checksum = identity(got.checksum, adapter)
                time.sleep(slow())  # (chaos) a slow first load, on this thread like a slow real start
            except Exception as e:
                return _Pulled(version, None, f"engine start failed: {type(e).__name__}: {e}")
            return _Pulled(version, got, engine=eng, build_s=time.monotonic() - t0, base=base)

        self._pull = self._builder.submit(work)
        self._pull.add_done_callback(lambda _f: self._wake())  # load it without waiting out the idle poll

    def step(self) -> None:
        """Start a pull when stale; install a freshly built engine, or load a finished pull once idle (adapter
        engines: once a slot is free)."""
        if self._pull is not None and self._pull.done():
            self._finish_pull(self._pull.result())
            return
        if self.engine is not None and len(self.engine.adapter_versions()) > 1:
            self._unload_outside_window(self.engine.version)  # old versions whose last response finished
        if self._pull is None and self._refused is None and self.stale() and time.monotonic() >= self._next_pull_at:
            self._start_pull(self.want)

    def _finish_pull(self, r: _Pulled) -> None:
        """Install or load the pull ``r`` — or report its failure — when the engine allows it now."""
        if r.error is not None:
            self._pull = None
            self._pull_failures += 1
            self._next_pull_at = time.monotonic() + min(5.0, 0.2 * 2 ** self._pull_failures)
            if r.refuse:
                self._refused = r.error
                log.error("instance %s %s", self._label(), r.error)
            else:
                log.warning("pull of version %d failed: %s", r.version, r.error)
            self._send(M.WeightsFailed(version=r.version, error=r.error))
            return
        adapter = self.welcome.adapter if self.welcome is not None else None
        pulled = VersionId(r.version, identity(r.got.checksum, adapter))
        if r.version > self.want.number or (r.version == self.want.number and not pulled.same_weights(self.want)):
            # pulled for a version the manager no longer announces, above (or beside) its latest: a trainer that
            # no longer exists made it (a resume started another lineage) — it can never be routed to
            self._pull = None
            log.warning("dropping pulled version %s: the manager's latest is now %s", pulled, self.want)
            return
        eng = self.engine
        resume: list[GenRequest] = []
        if r.engine is None and eng is not None:
            continue_mode = self.welcome is not None and self.welcome.on_new_version == "continue"
            if eng.num_active and continue_mode:  # every response goes on under the new version
                resume = self.responses.interrupt_for_load()
            elif eng.num_active and not eng.max_adapters:
                return  # full weights load only when idle
            if eng.max_adapters and not self._free_adapter_slot(r.version):
                return  # every slot serves a response in flight: the next iteration tries again (nothing waits)
        t0 = time.monotonic()
        if r.engine is not None:
            self.engine = r.engine
            if r.base is not None:
                log.info("base %016x loaded from %s in %.2fs (%d bytes received); serving adapters on it",
                         r.base.checksum, r.base.source, r.base.seconds, r.base.wire_bytes)
        elif not self._load(r, adapter, pulled.checksum, resume):
            return
        self._pull, self._pull_failures = None, 0
        self.engine_epoch = self.welcome.epoch
        if self.engine.max_adapters:
            self._lineage_adapters.add(r.version)
        self.responses.resume(resume, r.version)
        self.responses.forget_finished()  # responses of the version before: no manager asks for them again
        self._on_loaded()
        load_s = r.build_s if r.engine is not None else time.monotonic() - t0
        self._send(weights_loaded(r.version, r.got, load_s, checksum=self.engine.weights_checksum, base=r.base))

    def _load(self, r: _Pulled, adapter: AdapterSpec | None, checksum: int, resume: list[GenRequest]) -> bool:
        """Load the pulled version into the engine (an adapter into its free slot), its identity's ``checksum``
        (:func:`~rlboost_hpc.weights.source.identity`) recorded with it; False — reported, the engine unchanged,
        ``resume`` re-added under the version it had — when the load failed."""
        try:
            delay = self._fault_delay_s()
            if delay:
                time.sleep(delay)  # on this thread, like a slow real load
            if adapter is not None and self.engine.max_adapters:
                self.engine.load_adapter(r.got.state_dict, r.version)
                self.engine.weights_checksum = checksum
            else:
                self.engine.load_weights(r.got.state_dict, r.version)
                self.engine.weights_checksum = r.got.checksum
        except Exception as e:
            self._pull = None
            self._pull_failures += 1
            for gen in resume:  # (the engine kept its weights) they go on under the version they began with
                self.engine.add(gen)
            self._send(M.WeightsFailed(version=r.version, error=f"load failed: {type(e).__name__}: {e}"))
            return False
        self._unload_outside_window(r.version)
        return True

    def _free_adapter_slot(self, version: int) -> bool:
        """Make room for adapter ``version``: unload the oldest versions no request in flight names until a slot is
        free (a version already loaded keeps its own slot). False when every slot is named."""
        eng = self.engine
        held = [v for v in eng.adapter_versions() if v != version]
        while len(held) >= eng.max_adapters:
            # another lineage's adapters first (they serve nothing), then the oldest
            idle = sorted((v for v in held if not eng.adapter_in_use(v)), key=lambda v: v in self._lineage_adapters)
            if not idle:
                return False
            eng.unload_adapter(idle[0])
            held.remove(idle[0])
        return True

    def _unload_outside_window(self, newest: int) -> None:
        """Unload every adapter version older than the ``max_adapters`` newest that no request in flight names."""
        eng = self.engine
        if not eng.max_adapters:
            return
        for v in eng.adapter_versions():
            if v <= newest - eng.max_adapters and not eng.adapter_in_use(v):
                eng.unload_adapter(v)
