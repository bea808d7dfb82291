"""Sharded weight versions without Megatron: two holders each serve half of every tensor (as two TP ranks do);
a rollout instance's weight source pulls from both in parallel, assembles HF tensors, follows versions with
per-holder deltas, and never mixes versions when one holder is behind."""
from __future__ import annotations

import json

import pytest
import torch

from rlboost_hpc.rollout.remote_weights import RemoteWeights
from rlboost_hpc.weights import WeightServer, WeightTransferError
from rlboost_hpc.weights.sharded import FORMAT, load_manifest, version_checksum

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g),
          "model.norm.weight": torch.randn(16, generator=g),
          "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g)}
    if seed:  # a sparse RL-like update
        for t in sd.values():
            t.view(-1)[::37] += 0.01 * seed
    return sd


def split(sd):
    """Two holders' pieces (rows split in half) and the assembly manifest's piece specs."""
    pieces: list[dict[str, torch.Tensor]] = [{}, {}]
    specs = []
    for name, t in sd.items():
        half = t.shape[0] // 2
        for h, (a, b) in enumerate(((0, half), (half, t.shape[0]))):
            key = f"{name}@0:{a}:{b}"
            pieces[h][key] = t[a:b]
            specs.append({"key": key, "hf_name": name, "dim": 0, "start": a, "stop": b,
                          "slice_shape": [b - a, *t.shape[1:]], "full_shape": list(t.shape), "position": f"tp{h}-pp0"})
    return pieces, specs


@pytest.fixture
def holders():
    servers = [WeightServer(chunk_bytes=1024).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def publish(servers, version, sd, only=(0, 1)):
    pieces, specs = split(sd)
    checks = {}
    for h in only:
        checks[f"tp{h}-pp0"] = servers[h].publish(version, pieces[h]).checksum
    return specs, checks


def test_sharded_pulls_assemble_follow_deltas_and_never_mix_versions(holders):
    specs, checks = publish(holders, 1, full_state(0))
    manifest = {"format": FORMAT, "dtype": "bfloat16", "layout": {"tp": 2, "pp": 1}, "pieces": specs, "aliases": {},
                "holders": [{"holder": h, "rank": h, "tp_rank": h, "pp_rank": 0, "dp_rank": 0,
                             "position": f"tp{h}-pp0", "endpoint": s.endpoint, "nbytes": s.manifest().total_bytes}
                            for h, s in enumerate(holders)]}
    weights = RemoteWeights(streams=2, window=4, timeout_s=5.0)
    shards = json.dumps(manifest)

    got = weights.pull("tcp://127.0.0.1:1", 1, shards=shards)  # the single endpoint is not used
    sd = got.state_dict
    assert set(sd) == set(full_state(0))
    for name, t in full_state(0).items():
        assert torch.equal(sd[name], t.to(torch.bfloat16)), name
    assert got.checksum == version_checksum(checks) and got.nbytes == sum(h.manifest().total_bytes for h in holders)
    full_wire = got.wire_bytes

    _, checks2 = publish(holders, 2, full_state(1))
    got2 = weights.pull("tcp://127.0.0.1:1", 2, shards=shards)
    for name, t in full_state(1).items():
        assert torch.equal(got2.state_dict[name], t.to(torch.bfloat16)), name
    assert got2.checksum == version_checksum(checks2) != got.checksum
    assert got2.wire_bytes < full_wire / 2  # each holder shipped its delta against version 1

    publish(holders, 3, full_state(2), only=(0,))  # holder 1 is behind: version 3 is not complete
    with pytest.raises(WeightTransferError) as ei:
        weights.pull("tcp://127.0.0.1:1", 3, shards=shards)
    assert ei.value.code in ("unknown_version", "no_version")
    _, checks4 = publish(holders, 4, full_state(3))  # both hold 4: the instance recovers with a full pull
    got4 = weights.pull("tcp://127.0.0.1:1", 4, shards=shards)
    assert got4.checksum == version_checksum(checks4)
    assert torch.equal(got4.state_dict["model.norm.weight"], full_state(3)["model.norm.weight"].to(torch.bfloat16))


def test_load_manifest_rejects_what_is_not_a_shard_manifest():
    for bad in ("not json", "[]", json.dumps({"format": "other/1", "holders": [1], "pieces": [1]}),
                json.dumps({"format": FORMAT, "holders": [], "pieces": []})):
        with pytest.raises(ValueError, match="shard manifest"):
            load_manifest(bad)
