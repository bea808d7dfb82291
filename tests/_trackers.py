"""Reading back what a run wrote to its experiment trackers, through each tracker's own reader: TensorBoard's event
accumulator, MLflow's client against the run's store, and Weights & Biases' offline run files (``run-<id>.wandb``:
W&B's LevelDB-style record log of its own protobuf ``Record`` messages, decoded with ``wandb.proto``)."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag → [(step, value)] of every scalar in ``logdir``'s event files (TensorBoard's own reader, with its purge
    of steps a restarted writer replaced)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def tensorboard_tags(logdir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    return ea.Tags()


def mlflow_client(run_dir: Path):
    """(client, run id) of the run's MLflow run, as ``trackers.json`` names it."""
    from mlflow.tracking import MlflowClient

    from rlboost_hpc.observe.trackers import file_store_allowed

    ident = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    with file_store_allowed():
        return MlflowClient(tracking_uri=ident["tracking_uri"]), ident["run_id"]


def mlflow_history(run_dir: Path, name: str) -> list[tuple[int, float]]:
    client, run_id = mlflow_client(run_dir)
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


_BLOCK = 32768
_HEADER = 7


def wandb_records(path: Path) -> list:
    """The ``wandb_internal_pb2.Record`` messages of one ``.wandb`` file, in order, every chunk's CRC-32 checked (a
    record still being written at the end is left out)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf = path.read_bytes()
    assert buf[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, out, pending = _HEADER, [], b""
    while pos + _HEADER <= len(buf):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", buf[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        if pos + _HEADER + length > len(buf):  # a record still being written
            break
        data = buf[pos + _HEADER:pos + _HEADER + length]
        assert zlib.crc32(bytes([kind]) + data) & 0xFFFFFFFF == crc, f"{path}: bad CRC at {pos}"
        pos += _HEADER + length
        if kind == 1:
            out.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            out.append(pending + data)
            pending = b""
    records = []
    for data in out:
        r = pb.Record()
        r.ParseFromString(data)
        records.append(r)
    return records


def wandb_offline(run_dir: Path) -> dict:
    """What the run's offline W&B files hold, over every offline directory of the run id in ``trackers.json``:
    ``history`` (list of {key: value} rows, ``_step`` included), ``summary`` ({key: value}, last update wins),
    ``config`` ({key: value} of the config updates), ``files`` (saved paths), ``runs`` (one per directory:
    (id, resumed))."""
    ident = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    out: dict = {"history": [], "summary": {}, "config": {}, "files": [], "runs": []}
    for f in sorted((run_dir / "wandb").glob(f"offline-run-*-{ident}/run-{ident}.wandb")):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in r.history.item})
            elif kind == "summary":
                for i in r.summary.update:
                    out["summary"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
            elif kind == "config":
                for i in r.config.update:
                    out["config"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
            elif kind == "run":
                out["runs"].append((r.run.run_id, r.run.resumed))
                for i in r.run.config.update:
                    out["config"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
            elif kind == "files":
                out["files"] += [x.path for x in r.files.files]
    return out
