"""LoRA at the rollout agent (issue 49): the failures other systems shipped, each made impossible, on the real agent
code with a real torch engine in adapter mode (the manager's link is a stand-in that records frames).

- verl#7495 (the adapter never reached the engine; rollout kept sampling the base): the agent reports the version and
  the adapter-on-base checksum it serves, the manager routes only to a matching checksum, and the served logprobs of a
  trained version are not the base's.
- AReaL#1385 / trl#7017 (adapters never unloaded; a new one loaded before the stale one was unloaded): over 500
  versions, with responses of older versions in flight, an engine never holds more than k + 1 adapters.
- sglang#32238 (an unload waited for references that never drained while generation was paused): no load or unload
  waits for requests; generation goes on while a load is deferred.
- SkyRL#2064 (the frozen base copied again at every sync): a version moves the adapter's bytes only — the base's
  tensors are never written after the first build.
"""
from __future__ import annotations

import time

import torch

from test_agent_unit import _Frames
from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.lora import canonical_base, init_adapter
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.rollout.agent import RolloutAgent
from rlboost_hpc.weights.lora_base import BaseMismatch
from rlboost_hpc.rollout.engines.factory import torch_engine_factory
from rlboost_hpc.weights.source import BaseWeights, PulledVersion
from rlboost_hpc.models.layout import FlatState

torch.set_num_threads(1)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _AdapterSource:
    """The agent's weight source in a LoRA run: the base once (counted), then adapter versions (one FlatState each,
    as a pull hands them over), with the bytes each pull moved."""

    def __init__(self, policy, *, base_error: str | None = None) -> None:
        self.policy, self.base_error = policy, base_error
        self.base_calls, self.pulled_bytes = 0, []
        self.lineage = 0  # a resumed trainer's versions: the same numbers, other bytes (checksum + 100 × lineage)
        self._cache: dict[int, FlatState] = {}

    def adapter(self, version: int) -> FlatState:
        """Version ``version``'s adapter (five distinct ones, in turn: a pull hands over its own buffer)."""
        key = version % 5
        if key not in self._cache:
            a = init_adapter(self.policy.arch, ALL, 4, key)
            g = torch.Generator().manual_seed(key)
            a = {k: (torch.randn(v.shape, generator=g) * 0.3 if "lora_B" in k else v) for k, v in a.items()}
            self._cache[key] = FlatState.pack(a, torch.float32)
        return self._cache[key]

    def base(self, spec, arch, *, keys=None, label=""):
        self.base_calls += 1
        if self.base_error:
            raise BaseMismatch(self.base_error)
        return BaseWeights(canonical_base(self.policy.state_dict, arch), spec.base_checksum, spec.base_bytes, "path")

    def pull(self, endpoint, version, *, peers=(), keys=None, shards="", checksum=0, adapter=None):
        st = self.adapter(version)
        self.pulled_bytes.append(st.nbytes)
        return PulledVersion(st, checksum=1000 + version + 100 * self.lineage, nbytes=st.nbytes, wire_bytes=st.nbytes)


def _spec(k: int) -> AdapterSpec:
    return AdapterSpec(rank=4, alpha=8.0, targets=list(ALL), base_checksum=77, base_bytes=1, base_dtype="float32",
                       max_adapters=k + 1)


def _agent(policy, k: int, source=None, on_new_version: str = "finish") -> tuple[RolloutAgent, _AdapterSource]:
    source = source or _AdapterSource(policy)
    a = RolloutAgent("tcp://127.0.0.1:1", "job", 0, weights=source,
                     engine_factory=torch_engine_factory(8, "cpu", "float32", 128))
    a.link = _Frames()
    a._handle(M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w", model_config={},
                        model_arch=policy.arch.to_json(), heartbeat_s=1.0, stream_every_tokens=4, stream_every_s=0.05,
                        adapter=_spec(k), on_new_version=on_new_version))
    return a, source


def _until(a: RolloutAgent, pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        a.weight_slot.step()
        time.sleep(0.002)


def _work(rid: str, version: int, tokens: int) -> M.Work:
    return M.Work(rid=rid, prompt_ids=[1, 403, 407], prefix_ids=[], tokens_left=tokens, temperature=1.0, top_p=1.0,
                  seed=hash(rid) & 0xFFFF, stop_ids=[], version=version)


def test_the_engine_serves_the_adapter_it_reports_and_a_trained_version_is_not_the_base(stories260k_hf_dir):
    """verl#7495: the agent's WeightsLoaded names the version and the adapter-on-base checksum it serves; a request
    of that version is served by the adapter: its logprobs are not the base's."""
    policy = load_model_dir(stories260k_hf_dir)
    a, src = _agent(policy, k=0)
    _until(a, lambda: a.engine is not None and a.held_version() == 0, "the first engine")
    (loaded,) = [m for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    assert loaded.version == 0 and loaded.checksum == _spec(0).version_checksum(1000) and loaded.base_source == "path"
    assert src.base_calls == 1
    a.responses.assign([_work("r", 0, 12)])
    while a.engine.num_active:
        a.responses.on_events(a.engine.step())
    a.responses.flush()
    tok = [m for m in a.link.msgs if isinstance(m, M.Tokens)]
    ids = [i for t in tok for i in M.unpack_i32(t.ids).tolist()]
    lps = torch.tensor([x for t in tok for x in M.unpack_f32(t.logprobs).tolist()])
    assert all(v == 0 for t in tok for v in t.versions) and len(ids) == 12
    from rlboost_hpc.models.llama import LlamaModel

    base = LlamaModel.from_state_dict(policy.arch, dict(policy.state_dict)).eval()
    with torch.no_grad():
        logits = base(torch.tensor([[1, 403, 407] + ids]))[0, 2:-1]
    base_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert (lps - base_lp).abs().max().item() > 0.05  # the adapter, not the base, produced them


def test_an_instance_whose_base_differs_refuses_to_serve_and_never_pulls_again(stories260k_hf_dir):
    policy = load_model_dir(stories260k_hf_dir)
    src = _AdapterSource(policy, base_error="the base model at /m on this node has checksum 1; the run's base is 77")
    a, _ = _agent(policy, k=0, source=src)
    _until(a, lambda: any(isinstance(m, M.WeightsFailed) for m in a.link.msgs), "the refusal")
    (f,) = [m for m in a.link.msgs if isinstance(m, M.WeightsFailed)]
    assert f.error.startswith("refusing to serve: the base model at /m") and a.engine is None
    for _ in range(50):
        a.weight_slot.step()
    assert src.base_calls == 1 and a.weight_slot._pull is None and not src.pulled_bytes  # no retry, no adapter pulled


def test_500_versions_with_responses_in_flight_never_hold_more_than_k_plus_1_adapters_and_never_wait(
        stories260k_hf_dir):
    """AReaL#1385, trl#7017, sglang#32238, SkyRL#2064 at once: k = 1, a new version every decode iteration and a
    response of the newest version started each time (some outlive several versions)."""
    policy = load_model_dir(stories260k_hf_dir)
    k = 1
    a, src = _agent(policy, k=k)
    _until(a, lambda: a.held_version() == 0, "the first engine")
    eng = a.engine
    base = {n: (p.data_ptr(), p._version) for n, p in eng.model.named_parameters()}
    held_max, loads_in_flight, deferred, slowest = 0, 0, 0, 0.0
    for v in range(1, 501):
        a.responses.assign([_work(f"r{v}", a.held_version(), 1 + v % 4)])  # outlives up to 3 versions
        a._handle(M.NewVersion(version=v))
        while a.held_version() != v:
            busy = eng.num_active
            t0 = time.perf_counter()
            a.weight_slot.step()
            slowest = max(slowest, time.perf_counter() - t0)
            if a.held_version() == v:
                loads_in_flight += busy > 0
            elif a.weight_slot._pull is not None and a.weight_slot._pull.done():
                deferred += 1
                a.responses.on_events(eng.step())  # generation goes on while the load waits for a slot
            else:
                time.sleep(0.0005)  # the pull runs on the builder thread
            held_max = max(held_max, len(eng.adapter_versions()))
        a.responses.on_events(eng.step())
        held_max = max(held_max, len(eng.adapter_versions()))
    assert held_max <= k + 1
    assert loads_in_flight > 300  # loads happened with responses of older versions running
    assert deferred > 0  # ... and some found every slot named: deferred, not forced, while generation went on
    assert slowest < 2.0  # no call waited for requests (a load is a few MB of copies)
    assert set(src.pulled_bytes) == {src.adapter(1).nbytes}  # every version moved the adapter's bytes only
    assert {eng.last_load_bytes} == {eng.model.adapters.nbytes}
    assert {n: (p.data_ptr(), p._version) for n, p in eng.model.named_parameters()} == base  # base never written
    assert src.base_calls == 1
    while eng.num_active:
        a.responses.on_events(eng.step())
    a.responses.flush()
    stamped = {}
    for t in (m for m in a.link.msgs if isinstance(m, M.Tokens)):
        for rid, ver in zip(t.rids, t.versions):
            stamped.setdefault(rid, set()).add(ver)
    assert all(vers == {int(rid[1:]) - 1} for rid, vers in stamped.items())  # each by the version it was assigned


def test_after_a_resume_to_a_lower_version_the_adapters_of_the_old_lineage_serve_nothing(stories260k_hf_dir):
    """Issue 50 × 49: a trainer resumed from an older checkpoint makes versions again under numbers an instance's
    adapter slots already hold (the abandoned lineage's). A request of such a number is refused, never generated by
    the old adapter; the new lineage's versions are loaded over them and served."""
    policy = load_model_dir(stories260k_hf_dir)
    a, src = _agent(policy, k=2)
    _until(a, lambda: a.engine is not None and a.held_version() == 0, "the first engine")
    for v in (1, 2):
        a.weight_slot.want_version(VersionId(v, _spec(2).version_checksum(1000 + v)), [], False)
        _until(a, lambda: a.held_version() == v, f"version {v}")
    assert a.engine.adapter_versions() == [0, 1, 2] and a.weight_slot.servable(1)
    src.lineage = 1
    slot = a.weight_slot  # the resumed trainer's 1 (another lineage) next
    slot.want_version(VersionId(1, _spec(2).version_checksum(1101)), [], False)
    assert not slot.servable(1) and not slot.servable(2) and not slot.servable(0)  # old adapters serve nothing now
    a.responses.assign([_work("old2", 2, 4)])
    (failed,) = [m for m in a.link.msgs if isinstance(m, M.RequestFailed)]
    assert failed.rid == "old2" and a.engine.num_active == 0
    _until(a, lambda: a.held_version() == 1 and 1 in slot._lineage_adapters, "the resumed trainer's version 1")
    assert slot.servable(1) and not slot.servable(2)  # 2 is still the old lineage's until the new 2 is loaded
    a.weight_slot.want_version(VersionId(2, _spec(2).version_checksum(1102)), [], False)
    _until(a, lambda: a.held_version() == 2, "the resumed trainer's version 2")
    assert a.weight_slot.servable(1) and a.weight_slot.servable(2) and len(a.engine.adapter_versions()) <= 3
