"""The flat-buffer layout and its columnar tensor table: exact round trips, zeroed padding, tensor-count-independent
paths (one copy call, one view per tensor), and a pull into the base's buffer reusing its views."""
from __future__ import annotations

import pytest
import torch

from rlboost_hpc.protocol.weight_msgs import TensorTable, table_arrays, validate_table
from rlboost_hpc.models import layout
from rlboost_hpc.weights import WeightPuller, WeightServer


def awkward_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.scalar": torch.tensor(2.5),
        "c.empty": torch.zeros(0, 4),
        "d.ids": torch.arange(7, dtype=torch.int64),
        "e.mask": torch.tensor([True, False, True]),
        "f.4d": torch.randn(2, 1, 3, 2, generator=g),
        "g.transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "h.half": torch.randn(5, generator=g).half(),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_flatten_then_views_round_trip_exactly_and_padding_is_zero(dtype):
    sd = awkward_state()
    table, total = layout.plan(sd, dtype)
    validate_table(table, total)
    assert table.names == sorted(sd)
    dirty = torch.full((total,), 0xAB, dtype=torch.uint8)  # e.g. a pinned buffer: contents undefined
    layout.flatten_into(dirty, sd, table)
    fresh = layout.host_buffer(total)
    layout.flatten_into(fresh, sd, table)
    assert torch.equal(dirty, fresh)  # padding zeroed: byte-identical to a zero-filled buffer
    views = layout.tensor_views(dirty, table)
    for name, t in sd.items():
        want = t.to(layout.target_dtype(t, dtype))
        assert views[name].dtype == want.dtype and views[name].shape == want.shape
        assert torch.equal(views[name], want), name
        if views[name].numel():
            assert views[name].data_ptr() == dirty.data_ptr() + int(table_arrays(table).offsets[
                table.names.index(name)])
    spec = {s.name: s for s in table.specs()}
    assert spec["a.weight"].shape == (3, 5) and spec["b.scalar"].shape == () and spec["a.weight"].offset % 64 == 0


def test_views_of_a_table_in_another_order():
    """A holder may order its tensors differently from layout.plan: views still land where the table says."""
    sd = {"x": torch.arange(4, dtype=torch.int32), "y": torch.arange(3, dtype=torch.int16)}
    table, total = layout.plan(sd, None)
    specs = table.specs()
    swapped = TensorTable.from_specs([specs[1], specs[0]])
    buf = layout.host_buffer(total)
    layout.flatten_into(buf, sd, table)
    views = layout.tensor_views(buf, swapped)
    assert list(views) == ["y", "x"] and torch.equal(views["x"], sd["x"]) and torch.equal(views["y"], sd["y"])


def test_copy_tensors_casts_into_parameters_and_checks_lengths():
    dst = [torch.nn.Parameter(torch.zeros(2, 3)), torch.zeros(4, dtype=torch.bfloat16)]
    src = [torch.ones(2, 3, dtype=torch.bfloat16), torch.arange(4.0)]
    layout.copy_tensors(dst, src)
    assert torch.equal(dst[0].detach(), torch.ones(2, 3)) and dst[0].grad_fn is None
    assert torch.equal(dst[1], torch.arange(4.0).bfloat16())
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        layout.copy_tensors(dst, src[:1])
    layout.copy_tensors([], [])


@pytest.mark.integration
def test_pull_into_the_base_buffer_reuses_its_views_with_the_new_bytes():
    with WeightServer(chunk_bytes=4096, delta=False) as srv:
        srv.publish(1, awkward_state(1))
        first = WeightPuller(srv.endpoint).pull()
        views_before = {k: id(v) for k, v in first.state_dict.items()}
        srv.publish(2, awkward_state(2))
        second = WeightPuller(srv.endpoint).pull(base=first)
        assert second.buffer.data_ptr() == first.buffer.data_ptr()  # received into the base's buffer
        assert {k: id(v) for k, v in second.state_dict.items()} == views_before  # no per-tensor work
        for name, t in awkward_state(2).items():
            assert torch.equal(second.state_dict[name], t.to(layout.target_dtype(t, torch.bfloat16))), name
        # another layout: fresh views, never the base's
        srv.publish(3, {"only": torch.ones(3)})
        third = WeightPuller(srv.endpoint).pull(base=second)
        assert list(third.state_dict) == ["only"] and torch.equal(third.state_dict["only"], torch.ones(3).bfloat16())


@pytest.mark.fuzz
def test_mutated_manifests_are_rejected_or_viewable():
    """Decoding is total and a manifest that validates can be viewed without out-of-bounds access: random byte
    flips in an encoded manifest either raise ProtocolError or yield a table whose views fit the buffer."""
    import random

    import msgspec

    from rlboost_hpc.protocol.errors import ProtocolError
    from rlboost_hpc.protocol.weight_msgs import Manifest, combine_checksums, decode_reply, encode, num_chunks, \
        validate_manifest

    table, total = layout.plan(awkward_state(), torch.bfloat16)
    digests = [i + 1 for i in range(num_chunks(total, 64))]
    frame = encode(Manifest(version=3, total_bytes=total, chunk_bytes=64, tensors=table, chunk_checksums=digests,
                            checksum=combine_checksums(digests)))
    rng = random.Random(0)
    viewed = 0
    for _ in range(3000):
        data = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            m = decode_reply(bytes(data))
            if not isinstance(m, Manifest):
                continue
            m = msgspec.structs.replace(m, checksum=combine_checksums(list(m.chunk_checksums)))
            validate_manifest(m)
        except ProtocolError:
            continue
        views = layout.tensor_views(torch.zeros(m.total_bytes, dtype=torch.uint8), m.tensors)
        assert len(views) == len(set(m.tensors.names))
        viewed += 1
    assert viewed > 0  # some mutations (e.g. of checksum digits) keep the manifest valid


def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.w": torch.randn(3, i + 1, generator=g) for i in range(9)}
    return sd | {"norm": torch.randn(5, generator=g)}


@pytest.mark.parametrize("wire", [torch.bfloat16, None])
def test_a_flat_state_publishes_the_bytes_of_its_tensors_with_one_copy(wire):
    sd = _model_state()
    flat = layout.FlatState.pack(sd, wire)
    assert layout.plan(flat, wire) == layout.plan(sd, wire)  # its table is the one the tensors would get
    table, total = layout.plan(sd, wire)
    want, got = layout.host_buffer(total), torch.full((total,), 0xCD, dtype=torch.uint8)
    layout.flatten_into(want, sd, table)
    layout.flatten_into(got, flat, table)
    assert torch.equal(want, got)  # padding included: the flat tensor's padding is zero
    assert list(flat) == sorted(sd) and all(torch.equal(flat[k], sd[k]) for k in sd) and "norm" in flat
    other = torch.float16 if wire is None else None  # published in a dtype it was not packed for: tensor by tensor
    assert layout.plan(flat, other) == layout.plan(sd, other)


def test_adopted_parameters_train_inside_the_flat_tensor_and_its_padding_stays_zero():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7), torch.nn.Linear(7, 2))
    params = dict(model.named_parameters())
    flat = layout.FlatState.pack(params)
    before = {k: p.detach().clone() for k, p in params.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before adopt: parameters keep their identity
    flat.adopt(params)
    assert all(torch.equal(p.detach(), before[k]) for k, p in params.items())
    for _ in range(3):
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    for k, p in model.named_parameters():
        assert p.data_ptr() == flat[k].data_ptr() and torch.equal(p.detach(), flat[k]) and not torch.equal(p, before[k])
    a = table_arrays(flat.table)
    item = 2  # bf16 wire elements
    covered = torch.zeros(flat.flat.numel(), dtype=torch.bool)
    for off, n in zip((a.offsets // item).tolist(), a.numel.tolist()):
        covered[off: off + n] = True
    assert not flat.flat[~covered].any()  # nothing reached the padding
    table, total = layout.plan(flat, torch.bfloat16)
    a_buf, b_buf = layout.host_buffer(total), layout.host_buffer(total)
    layout.flatten_into(a_buf, flat, table)
    layout.flatten_into(b_buf, {k: p.detach() for k, p in model.named_parameters()}, table)
    assert torch.equal(a_buf, b_buf)


def test_flat_state_errors_and_copies_only_between_equal_layouts():
    with pytest.raises(ValueError, match="one dtype"):
        layout.FlatState.pack({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float16)})
    with pytest.raises(ValueError, match="floating-point"):
        layout.FlatState.pack({"a": torch.ones(2), "ids": torch.arange(3)})
    table, total = layout.plan({"a": torch.ones(2), "ids": torch.arange(3)}, None)
    with pytest.raises(ValueError, match="one wire dtype"):
        layout.FlatState(table, torch.zeros(total))
    flat = layout.FlatState.pack(_model_state(0))
    with pytest.raises(ValueError, match="contiguous elements"):
        layout.FlatState(flat.table, torch.zeros(flat.flat.numel() + 1))
    same = layout.FlatState.pack({k: v.bfloat16() for k, v in _model_state(1).items()})
    other = layout.FlatState.pack({k: v for k, v in _model_state(1).items() if k != "norm"})
    kept = flat.flat.clone()
    assert not flat.copy_from(other) and torch.equal(flat.flat, kept)
    assert flat.copy_from(same) and all(torch.equal(flat[k], same[k].float()) for k in same)
    with pytest.raises(ValueError, match="cannot live"):
        flat.adopt({"norm": torch.nn.Parameter(torch.zeros(6))})


def test_state_view_is_flat_for_one_dtype_and_per_tensor_views_otherwise():
    one = {k: v.bfloat16() for k, v in _model_state().items()}
    table, total = layout.plan(one, None)
    buf = layout.host_buffer(total)
    layout.flatten_into(buf, one, table)
    view = layout.state_view(buf, table)
    assert isinstance(view, layout.FlatState) and view.flat.data_ptr() == buf.data_ptr()
    assert all(torch.equal(view[k], one[k]) for k in one)
    table, total = layout.plan(awkward_state(), None)
    buf = layout.host_buffer(total)
    layout.flatten_into(buf, awkward_state(), table)
    assert isinstance(layout.state_view(buf, table), dict)


@pytest.mark.parametrize("nbytes", [1, 4096, (2 << 20) - 1, 2 << 20, (4 << 20) + 12345])
def test_host_buffers_have_the_asked_size_however_they_are_mapped(nbytes):
    buf = layout.host_buffer(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8
    buf[-1] = 7
    assert int(buf[-1]) == 7


@pytest.mark.integration
def test_a_pulled_single_dtype_version_is_flat_and_loads_into_an_equal_layout_with_one_copy():
    sd = _model_state(2)
    with WeightServer(chunk_bytes=256, delta=False) as srv:
        srv.publish(1, layout.FlatState.pack(sd))
        got = WeightPuller(srv.endpoint).pull()
    assert isinstance(got.state_dict, layout.FlatState) and got.state_dict.wire_dtype == torch.bfloat16
    engine = layout.FlatState.pack({k: torch.zeros(v.shape) for k, v in sd.items()})  # fp32 weights, bf16 wire
    assert engine.copy_from(got.state_dict)
    assert all(torch.equal(engine[k], sd[k].bfloat16().float()) for k in sd)


def test_a_pooled_buffer_is_never_handed_out_again_while_anything_views_it():
    pool = layout.HostBufferPool(keep=2)
    a = pool.take(3 << 20)
    first = a.data_ptr()
    keep_alive = [a[6:10].view(torch.int16), a.numpy(), memoryview(a.numpy())]
    del a
    for held in keep_alive:  # a tensor view, an array, a memoryview: each alone keeps the buffer taken
        others = [x for x in keep_alive if x is not held]
        keep_alive = [held]
        del others
        b = pool.take(3 << 20)
        assert b.data_ptr() != first
        del b
    del held
    keep_alive.clear()
    assert pool.take(3 << 20).data_ptr() == first and pool.reused >= 1
    assert len(pool._regions) <= 2  # bounded: free mappings beyond `keep` are released
    assert pool.take(64 << 20).numel() == 64 << 20  # too small to reuse: a new mapping of the asked size


class RecordingPinner:
    """A contract stand-in for :class:`layout.CudaHostPinner` (CUDA cannot run here): records what the pool pins
    and unpins, checks every unpin matches a live pin and that a pinned range is never unpinned twice."""

    def __init__(self, refuse: int = 0) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.refuse = refuse  # refuse this many pins first (the driver out of pinnable memory)

    def pin(self, address: int, nbytes: int) -> bool:
        self.calls.append(("pin", address))
        if self.refuse:
            self.refuse -= 1
            return False
        assert address not in self.pinned
        self.pinned[address] = nbytes
        return True

    def unpin(self, address: int) -> None:
        self.calls.append(("unpin", address))
        assert address in self.pinned, "unpinned a range that is not pinned"
        del self.pinned[address]


def test_contract_a_pinning_pool_pins_each_mapping_once_and_unpins_before_releasing_it():
    pinner = RecordingPinner()
    pool = layout.HostBufferPool(keep=2, pinner=pinner)
    a = pool.take(3 << 20)
    assert pinner.pinned == {a.data_ptr(): 4 << 20}  # the whole mapping (whole 2 MiB pages)
    first = a.data_ptr()
    del a
    for _ in range(3):  # reused: pinned once, not again per version
        b = pool.take(3 << 20)
        assert b.data_ptr() == first
        del b
    assert [c for c, _ in pinner.calls] == ["pin"] and pool.pinned == 1
    # a viewed buffer forgotten beyond `keep` stays pinned until its last view goes, then is unpinned
    viewed = pool.take(3 << 20)
    others = [pool.take(8 << 20), pool.take(16 << 20)]  # two more mappings: `viewed`'s is the oldest
    assert viewed.data_ptr() in pinner.pinned and len(pool._regions) == 2
    gone = viewed.data_ptr()
    del viewed
    pool.take(1 << 20)
    assert gone not in pinner.pinned and ("unpin", gone) in pinner.calls
    del others
    pool.take(40 << 20)  # free mappings beyond `keep` are unpinned as they are released
    assert len(pinner.pinned) == len([r for r in pool._regions if r.address]) <= 2


def test_contract_a_pin_the_driver_refuses_leaves_a_working_pageable_buffer():
    pinner = RecordingPinner(refuse=1)
    pool = layout.HostBufferPool(keep=1, pinner=pinner)
    a = pool.take(1 << 20)
    a.fill_(7)
    assert int(a.sum()) == 7 << 20 and pool.pin_failures == 1 and pool.pinned == 0 and not pinner.pinned
    del a
    pool.take(5 << 20)  # the refused mapping is released without an unpin
    assert [c for c, _ in pinner.calls] == ["pin", "pin"] and pool.pinned == 1


@pytest.mark.gpu
def test_a_cuda_pinned_pool_buffer_is_pinned_and_receives_device_copies():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = layout.HostBufferPool(keep=1, pin_memory=True)
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    buf = pool.take(src.numel())
    assert buf.is_pinned() and pool.pinned == 1
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())
    del buf
    pool.take(64 << 20)  # the first mapping is unpinned and released
    assert pool.pinned == 2 and pool.pin_failures == 0
    # a rollout worker's torch engine on the GPU pulls into pinned buffers (its load is a host-to-device copy)
    from rlboost_hpc.rollout.engines.factory import receive_buffer_factory

    assert receive_buffer_factory({"kind": "torch", "device": "cuda"})(1 << 20).is_pinned()
    assert receive_buffer_factory({"kind": "torch", "device": "cpu"}) is None


@pytest.mark.integration
@pytest.mark.parametrize("chunk_bytes", [4096, 4097])  # 4097: not a multiple of bf16's 2 bytes — cast in one piece
def test_a_flat_publish_overlaps_cast_and_checksums_reuses_evicted_buffers_and_never_touches_a_viewed_one(
        chunk_bytes):
    sd = {k: v.repeat(40, 1) for k, v in _model_state(4).items() if v.dim() == 2}
    with WeightServer(chunk_bytes=chunk_bytes, keep_versions=1, delta=False) as flat_srv, \
            WeightServer(chunk_bytes=chunk_bytes, keep_versions=1, delta=False) as dict_srv:
        flat = layout.FlatState.pack(sd)
        m1 = flat_srv.publish(1, flat)
        assert m1.chunk_checksums == dict_srv.publish(1, sd).chunk_checksums and m1.checksum
        reader = flat_srv.local_state_dict(1)  # an in-process engine still reads version 1
        snapshot = {k: reader[k].clone() for k in reader}
        for v in range(2, 6):
            with torch.no_grad():
                for t in flat.values():  # as an optimizer does: through the views, never the padding
                    t.mul_(-1.5)
            m = flat_srv.publish(v, flat)
            assert m.chunk_checksums == dict_srv.publish(v, dict(flat)).chunk_checksums
        assert all(torch.equal(reader[k], snapshot[k]) for k in snapshot)  # its buffer was never reused
        st = flat_srv.stats
        assert st["publish_buffers_reused"] >= 2 and st["publish_copy_seconds"] > 0 and st["publish_hash_seconds"] > 0
        got = WeightPuller(flat_srv.endpoint).pull()
        assert all(torch.equal(got.state_dict[k], flat[k].bfloat16()) for k in sd)
