"""The emulated rollout engine (``rollout.engine = "emulated"``): a load-testing engine with a real model's timing and
no model compute.

It runs the live system — agent, protocol, manager, migration, weight pulls — at a production shape on
machines without the GPUs: each :meth:`EmulatedEngine.step` takes the time one continuous-batching iteration of the modelled
engine would take (the simulator's decode and prefill law, :class:`rlboost_hpc.sim.profiles.EnginePerf` of the
chosen Qwen3 profile on H100s: one source for the simulator and this engine), divided by ``time_scale``.

Invariants (each tested):

- **Tokens are a pure function of (response seed, absolute response position)**, as the real engines' sampling is:
  token ``k`` is ``3 + ⌊u(seed, k)·(V − 3)⌋`` (``u`` is the torch engine's counter-based uniform; ids 0–2 are left to
  special tokens, a stop id is skipped), its logprob ``−1 − 7·u(seed ⊕ salt, k)`` nats. A response's length is
  drawn once per seed from a log-normal (median ``response_median`` tokens, σ ``response_sigma``), clipped to its
  budget; the token at the last position is the request's smallest stop id (``finish_reason = "stop"``) when it stops
  before the budget. So a migrated response (resumed with ``prefix_ids``) equals the uninterrupted one token for
  token, whatever engine instance continues it.
- **Weights are real bytes.** The engine keeps a reference to every state dict it is given (the pulled, verified
  version the agent hands over) and reports its size; a load takes the profile's model bytes ÷
  ``load_bytes_per_s`` ÷ ``time_scale`` seconds, and is refused while requests run, as for every engine.
- **LoRA runs** (``adapter``): the engine holds the base (an emulated one: the modelled load of the model's bytes) and
  up to ``max_adapters`` adapter versions of real pulled bytes, each load taking the adapter's bytes ÷
  ``load_bytes_per_s``; loads go to a free slot while requests run, unloads only of versions no request names (the
  contract of adapter engines).
- **Time is modelled, not measured.** An iteration that admits requests pays ``pf_fixed + Σ prefill(ctx)``; every
  iteration pays ``a + b·B + γ·Σctx`` for its ``B`` running requests (the simulator's law). Sleeps run to a
  deadline that carries over, so Python's own overhead does not add up over a response; when the host is slower
  than the model asks the engine simply runs late (never faster) — and says by how much: ``late_seconds`` (wall
  seconds it ran behind the profile while busy: at each iteration, how far past its deadline it already was; after a
  load, how far its sleep overran) next to ``modelled_wall_seconds`` (what the profile asked:
  ``model_seconds ÷ time_scale``); :attr:`EmulatedEngine.late_ratio` is their ratio (1 = on time). The agent
  reports both in its heartbeats, the manager adds them up (``emulated_*_seconds``), and a run's report and the
  benchmark tables mark a run whose instances ran more than :data:`LATE_RATIO_BOUND` late as not representing the
  profile.

What it does not model: the content of tokens (rewards are whatever the task's verifier gives random ids — zero for
GSM8K, noise for the demo), the engine–trainer logprob mismatch (its logprobs are not the trainer's, so
``trainer.behaviour_correction`` is refused with it), KV-cache eviction and recompute beyond the batch and context
limits it enforces, CUDA graph capture and warm-up, and the memory of the model on the GPU (only the pulled bytes
are held, in host memory).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

from rlboost_hpc import defaults as D
from rlboost_hpc.rollout.engines.base import Engine, EngineError, GenRequest, TokenEvent, validate_request
from rlboost_hpc.rollout.engines.torch_engine import uniform_reference
from rlboost_hpc.observe.run_report import LATE_RATIO_BOUND, late_ratio
from rlboost_hpc.sim.profiles import MODELS, EnginePerf, profile

__all__ = ["EmulatedEngine", "EmulatedProfile", "LATE_RATIO_BOUND", "emulated_engine_factory", "emulated_length",
           "emulated_token", "instance_speed", "late_ratio", "state_nbytes"]

#: The first id an emulated token may take (0–2: pad / BOS / EOS of the tokenizers this project ships).
FIRST_TOKEN_ID = 3
_LOGPROB_SALT = 0x5DEECE66D
_LENGTH_POSITION = -1  # u(seed, -1) draws a response's length; positions ≥ 0 are tokens


@dataclass(frozen=True)
class EmulatedProfile:
    """What one emulated instance models: a Qwen3 model on ``instance_tp`` H100s.

    profile: ``"8b"``, ``"14b"`` or ``"32b"`` (:func:`rlboost_hpc.sim.profiles.profile`).
    instance_tp: GPUs of one instance (tensor parallel size of the modelled engine).
    time_scale: model seconds per wall second (> 0; 10 runs the model ten times faster than a GPU would).
    load_bytes_per_s: rate of a weight load into the modelled engine (bytes/s, > 0) — host to device plus the
        engine's own update; the model's bf16 bytes ÷ this rate is one load.
    response_median / response_sigma: the log-normal of response lengths (tokens; σ of the natural log).
    """

    profile: str = D.EMULATED_PROFILE
    instance_tp: int = D.EMULATED_INSTANCE_TP
    time_scale: float = D.EMULATED_TIME_SCALE
    load_bytes_per_s: float = D.EMULATED_LOAD_BYTES_PER_S
    response_median: float = D.EMULATED_RESPONSE_MEDIAN
    response_sigma: float = D.EMULATED_RESPONSE_SIGMA

    def __post_init__(self) -> None:
        if self.profile.lower().replace("qwen3-", "") not in MODELS:
            raise EngineError(f"emulated engine: unknown profile {self.profile!r} (expected one of {list(MODELS)})")
        checks = {"instance_tp": self.instance_tp >= 1, "time_scale": self.time_scale > 0,
                  "load_bytes_per_s": self.load_bytes_per_s > 0, "response_median": self.response_median >= 1,
                  "response_sigma": self.response_sigma >= 0}
        for key, ok in checks.items():
            if not ok:
                raise EngineError(f"emulated engine: {key} = {getattr(self, key)!r} is out of range")

    def perf(self) -> EnginePerf:
        """The modelled engine's decode/prefill constants (the simulator's dedicated-instance settings).

        Raises:
            EngineError: the model does not fit on ``instance_tp`` GPUs.
        """
        p = profile(self.profile, instance_tp=self.instance_tp)
        try:
            return p.instance_perf()
        except ValueError as e:
            raise EngineError(f"emulated engine: {e}") from None

    @property
    def load_model_s(self) -> float:
        """Model seconds of one weight load: the model's bf16 bytes ÷ ``load_bytes_per_s`` (÷ ``time_scale`` for
        the wall seconds it takes)."""
        return profile(self.profile).model.weight_bytes / self.load_bytes_per_s


def emulated_token(seed: int, position: int, vocab_size: int, stop: frozenset[int] = frozenset()) -> tuple[int, float]:
    """Token id and logprob (nats, in [−8, −1)) at absolute response ``position`` of the response seeded ``seed``.

    A pure function: equal arguments give equal results in any process. A drawn id that is a stop id becomes the next
    id that is not (wrapping to :data:`FIRST_TOKEN_ID`), so a response stops only where :func:`emulated_length` says.

    Raises:
        EngineError: ``vocab_size`` leaves no id past the special ones and the stop ids.
    """
    span = vocab_size - FIRST_TOKEN_ID
    if span <= len(stop & set(range(FIRST_TOKEN_ID, vocab_size))):
        raise EngineError(f"emulated engine: vocabulary of {vocab_size} ids leaves no token to emit")
    tok = FIRST_TOKEN_ID + min(span - 1, int(uniform_reference(seed, position) * span))
    while tok in stop:
        tok = tok + 1 if tok + 1 < vocab_size else FIRST_TOKEN_ID
    return tok, -1.0 - 7.0 * uniform_reference(seed ^ _LOGPROB_SALT, position)


def emulated_length(seed: int, median: float, sigma: float) -> int:
    """Response length (tokens, ≥ 1) of the response seeded ``seed``: ``median·exp(σ·z)``, ``z`` standard normal
    from ``u(seed, −1)`` (inverse CDF, clamped away from 0 and 1)."""
    from statistics import NormalDist

    u = min(max(uniform_reference(seed, _LENGTH_POSITION), 1e-12), 1 - 1e-12)
    return max(1, round(median * math.exp(sigma * NormalDist().inv_cdf(u))))


def state_nbytes(state_dict: Mapping) -> int:
    """Bytes of the tensors in ``state_dict`` (a flat state's one buffer is counted once)."""
    seen: set[int] = set()
    total = 0
    for t in state_dict.values():
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass
class _Running:
    req: GenRequest
    stop: frozenset[int]
    length: int  # response position after which the response ends (prefix included)
    produced: int = 0
    prefilled: bool = False
    adapter: int | None = None  # the adapter version serving it (LoRA runs)

    @property
    def position(self) -> int:
        return len(self.req.prefix_ids) + self.produced

    @property
    def context(self) -> int:
        return len(self.req.prompt_ids) + self.position


class EmulatedEngine(Engine):
    """A continuous-batching engine that emits :func:`emulated_token` streams at the modelled rate.

    Args:
        vocab_size: ids are drawn from ``[3, vocab_size)``.
        state_dict: the first version's pulled weights (held, not read).
        emulated: the timing profile.
        max_batch: requests running at once (also capped by the modelled engine's ``max_running``).
        max_len: most positions per request (prompt + prefix + new tokens); None: no limit.
        version: initial weight version.
        sleep / clock: injected for tests (seconds; default ``time.sleep`` / ``time.monotonic``).
        adapter: a LoRA run's spec: ``state_dict`` is the base and the engine serves adapter versions on it.

    Raises:
        EngineError: a bad profile or ``max_batch < 1``.
    """

    def __init__(self, vocab_size: int, state_dict: Mapping, emulated: EmulatedProfile, *, max_batch: int = D.MAX_BATCH,
                 max_len: int | None = None, version: int = 0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, adapter=None) -> None:
        if max_batch < 1:
            raise EngineError(f"max_batch must be ≥ 1, got {max_batch}")
        self.emulated = emulated
        self.perf = emulated.perf()
        self.vocab_size = int(vocab_size)
        self.max_batch = min(max_batch, self.perf.max_running)
        self.max_len = max_len
        self._sleep, self._clock = sleep, clock
        self._due = clock()
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        #: model seconds this engine has spent (prefill, decode, loads): what a real engine would have taken
        self.model_seconds = 0.0
        #: wall seconds this engine ran behind its deadlines while busy (the host was slower than the profile)
        self.late_seconds = 0.0
        self._idle = True  # nothing ran since the last load or idle step: the gap until the next step is not late
        self.weights: Mapping = {}
        self.weights_nbytes = 0
        self._hold(state_dict)
        self.version = version
        self._adapters: dict[int, Mapping] = {}  # LoRA: adapter version → its pulled tensors, oldest first
        if adapter is not None:
            self.max_adapters, self.version = int(adapter.max_adapters), -1
        # the first load (the base, in a LoRA run), like a real engine's start
        self._wait(emulated.load_model_s, then_idle=True)

    # ------------------------------------------------------------------ Engine API
    @property
    def num_active(self) -> int:
        """Requests queued or running."""
        return len(self._waiting) + len(self._running)

    def add(self, req: GenRequest) -> None:
        """Queue ``req`` (copied); it starts at the next :meth:`step`.

        Raises:
            EngineError: duplicate rid or a request :func:`validate_request` refuses.
        """
        if req.rid in self._running or any(w.req.rid == req.rid for w in self._waiting):
            raise EngineError(f"request {req.rid!r}: duplicate rid (already queued or running)")
        copy = validate_request(req, vocab_size=self.vocab_size, max_len=self.max_len)
        adapter = None
        if self.max_adapters:
            adapter = self.version if copy.adapter_version is None else copy.adapter_version
            if adapter not in self._adapters:
                raise EngineError(f"request {req.rid!r}: adapter version {adapter} is not loaded "
                                  f"(loaded: {list(self._adapters)})")
        sp = copy.sampling
        stop = frozenset(int(t) for t in sp.stop_token_ids)
        budget = len(copy.prefix_ids) + copy.max_new_tokens
        length = min(budget, emulated_length(sp.seed, self.emulated.response_median, self.emulated.response_sigma))
        if not stop:
            length = budget  # nothing to stop with: the response runs to its budget
        self._waiting.append(_Running(req=copy, stop=stop, length=max(length, len(copy.prefix_ids) + 1),
                                      adapter=adapter))

    def step(self) -> list[TokenEvent]:
        """One iteration: admit (prefill) waiting requests while slots and KV capacity last, then one token for
        every running request; sleeps the modelled time of both ÷ ``time_scale`` before returning.

        Returns:
            One :class:`TokenEvent` per running request (one token each); an empty list when idle.
        """
        model_s = 0.0
        kv_used = sum(r.context for r in self._running.values())
        admitted = False
        while self._waiting and len(self._running) < self.max_batch:
            r = self._waiting[0]
            if self._running and kv_used + r.context > self.perf.kv_capacity:
                break  # the modelled engine's KV cache is full: it waits for a finished request
            self._waiting.popleft()
            self._running[r.req.rid] = r
            kv_used += r.context
            model_s += self.perf.prefill_time(r.context)
            admitted = True
        if admitted:
            model_s += self.perf.pf_fixed
        if not self._running:
            self._idle = True
            return []
        model_s += self.perf.iter_time(len(self._running), kv_used)
        events = []
        for rid, r in list(self._running.items()):
            tok, lp = emulated_token(r.req.sampling.seed, r.position, self.vocab_size, r.stop)
            r.produced += 1
            ev = TokenEvent(rid=rid, token_ids=[tok], logprobs=[lp])
            if r.position >= r.length:
                if r.length < len(r.req.prefix_ids) + r.req.max_new_tokens:
                    ev.token_ids[0] = min(r.stop)
                    ev.finish_reason = "stop"
                else:
                    ev.finish_reason = "length"
                ev.finished = True
                del self._running[rid]
            events.append(ev)
        self._wait(model_s)
        return events

    def abort(self, rid: str) -> None:  # every token was returned by step()
        """Drop ``rid`` whether queued or running. Unknown rid: no-op."""
        if self._running.pop(rid, None) is not None:
            return
        for w in self._waiting:
            if w.req.rid == rid:
                self._waiting.remove(w)
                return

    def load_weights(self, state_dict: Mapping, version: int) -> None:
        """Hold ``state_dict`` as version ``version`` after the modelled load time.

        Raises:
            EngineError: requests are queued or running (nothing changes).
        """
        if self.num_active:
            raise EngineError(f"load_weights(version={version}) refused: {self.num_active} request(s) active; "
                              "drain or abort them first")
        if self.max_adapters:
            for v in list(self._adapters):
                self.unload_adapter(v)
            self.load_adapter(state_dict, version)
            return
        self._wait(self.emulated.load_model_s, then_idle=True)
        self._hold(state_dict)
        self.version = version

    def adapter_versions(self) -> list[int]:
        """Adapter versions held, oldest first."""
        return list(self._adapters)

    def adapter_in_use(self, version: int) -> bool:
        """Whether a queued or running request is served by adapter ``version``."""
        return any(r.adapter == version for r in (*self._waiting, *self._running.values()))

    def load_adapter(self, state_dict: Mapping, version: int) -> int:
        """Hold adapter ``version`` in a free slot after the modelled load of its bytes (requests may run).

        Raises:
            EngineError: not a LoRA engine, or every slot is taken."""
        if not self.max_adapters:
            raise EngineError("load_adapter: this emulated engine serves full weights")
        self._adapters.pop(version, None)
        if len(self._adapters) >= self.max_adapters:
            raise EngineError(f"load_adapter(version={version}): all {self.max_adapters} adapter slots hold "
                              f"{list(self._adapters)}; unload one no request names first")
        n = state_nbytes(state_dict)
        self._wait(n / self.emulated.load_bytes_per_s)
        self._adapters[version] = state_dict
        self.version, self.last_load_bytes = version, n
        return n

    def unload_adapter(self, version: int) -> None:
        """Drop adapter ``version`` (unknown: no-op).

        Raises:
            EngineError: a queued or running request is served by it."""
        self._drop_adapter(self._adapters, version)

    # ------------------------------------------------------------------ internals
    def _hold(self, state_dict: Mapping) -> None:
        self.weights = state_dict
        self.weights_nbytes = state_nbytes(state_dict)

    @property
    def modelled_wall_seconds(self) -> float:
        """Wall seconds the profile asked for so far: ``model_seconds ÷ time_scale``."""
        return self.model_seconds / self.emulated.time_scale

    @property
    def late_ratio(self) -> float:
        """Wall time taken ÷ the profile's (:func:`late_ratio`): 1.0 on time, 3.2 for a host 3.2× too slow."""
        return late_ratio(self.modelled_wall_seconds, self.late_seconds)

    def _wait(self, model_s: float, *, then_idle: bool = False) -> None:
        """Advance the engine's deadline by ``model_s`` model seconds and sleep until it (a late host does not
        bank time to run faster later). While busy, how far past the deadline it already is counts as late;
        ``then_idle`` (a load: nothing follows at once) counts its own sleep's overrun instead."""
        self.model_seconds += model_s
        now = self._clock()
        if not self._idle and now > self._due:
            self.late_seconds += now - self._due
        self._due = max(self._due, now) + model_s / self.emulated.time_scale
        if self._due > now:
            self._sleep(self._due - now)
        if then_idle:
            end = self._clock()
            self.late_seconds += max(0.0, end - self._due)
        self._idle = then_idle


def instance_speed(instance_id: str, gpu_speeds) -> float:
    """The relative GPU speed of the instance named ``instance_id``: ``gpu_speeds[j mod len]`` where ``j`` is the
    number its identity ends in (local slot ``local-slot3`` → 3, hosted ``<job>.5`` → 5, Slurm job ``8812`` → 8812),
    0 when it ends in none. Deterministic, so a mix of GPU kinds is reproducible run to run.

    Raises:
        EngineError: an empty list or a speed that is not > 0.
    """
    speeds = list(gpu_speeds)
    if not speeds or any(not (isinstance(x, (int, float)) and x > 0) for x in speeds):
        raise EngineError(f"emulated engine: gpu_speeds {speeds!r} must be a non-empty list of numbers > 0")
    m = re.search(r"(\d+)$", instance_id or "")
    return float(speeds[int(m.group(1)) % len(speeds) if m else 0])


def emulated_engine_factory(max_batch: int, max_len: int | None = None, *, instance_id: str = "",
                            gpu_speeds=D.EMULATED_GPU_SPEEDS, **profile_kw):
    """An ``EngineFactory``: an :class:`EmulatedEngine` of the run's vocabulary (``vocab_size`` of the model's
    config) holding the first pulled weights. ``profile_kw`` are :class:`EmulatedProfile` fields; the instance
    ``instance_id`` runs on a GPU :func:`instance_speed` times the profile's (its ``time_scale`` multiplied by it).

    Raises:
        EngineError: an unknown profile field or value, or bad ``gpu_speeds`` (at once, before any worker
            registers), or a model config without ``vocab_size`` (when the engine is built).
    """
    known = set(EmulatedProfile.__dataclass_fields__)
    unknown = set(profile_kw) - known
    if unknown:
        raise EngineError(f"unknown emulated engine option(s) {sorted(unknown)}; known: "
                          f"{sorted(known | {'gpu_speeds'})}")
    prof = EmulatedProfile(**profile_kw)
    prof.perf()  # a model that does not fit is refused now
    prof = dataclasses.replace(prof, time_scale=prof.time_scale * instance_speed(instance_id, gpu_speeds))

    def make(model_config: dict, state_dict: Mapping, arch=None, adapter=None) -> Engine:
        vocab = arch.vocab_size if arch is not None else (model_config or {}).get("vocab_size")
        if not isinstance(vocab, int) or vocab <= FIRST_TOKEN_ID:
            raise EngineError(f"emulated engine: the model config's vocab_size {vocab!r} is not an int > 3")
        return EmulatedEngine(vocab, state_dict, prof, max_batch=max_batch, max_len=max_len, adapter=adapter)

    return make
