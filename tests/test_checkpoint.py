"""Crash-resume building blocks (issue 7 §2, case C1): trainer checkpoints, the manager journal, resume checks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlboost_hpc.config import load_config
from rlboost_hpc.manager.journal import Journal, JournalError, last_version, read
from _util import load_hf_dir
from rlboost_hpc.run import _resume_point
from rlboost_hpc.trainer import checkpoint
from rlboost_hpc.trainer.backends.base import Sample
from rlboost_hpc.trainer.backends.torch_backend import TorchBackend
from rlboost_hpc.trainer.loop import DataFrontier


@pytest.fixture(scope="module")
def model(stories260k_hf_dir):
    return load_hf_dir(stories260k_hf_dir)


def _batch():
    return [Sample(prompt_ids=[1, 5, 9], response_ids=[7, 8, 2], behaviour_logprobs=[-1.0, -2.0, -0.5], advantage=a)
            for a in (1.0, -1.0)]


def _step(b: TorchBackend) -> float:
    m = b.accumulate(_batch(), 2)
    b.optimizer_step()
    return m["loss"]


def test_resume_reproduces_the_next_step_exactly(model, tmp_path):
    """Stop after step k, restore into a fresh backend built from the initial weights: the next step's loss and
    weights equal the uninterrupted run's (fp32, same order of operations)."""
    config, sd = model
    a = TorchBackend(config, sd, lr=1e-3)
    _step(a)
    checkpoint.save(tmp_path, 1, a, {"version": 1}, {"note": "x"})
    want_loss = _step(a)
    b = TorchBackend(config, sd, lr=1e-3)
    step, tstate, rstate = checkpoint.load(checkpoint.latest(tmp_path), b)
    assert (step, tstate, rstate) == (1, {"version": 1}, {"note": "x"})
    assert _step(b) == want_loss
    for k, v in a.export_weights().items():
        assert torch.equal(v, b.export_weights()[k]), k


def test_background_checkpoint_holds_the_state_of_its_step_while_training_goes_on(model, tmp_path):
    """The writer captures model, optimizer and loop state at save(); the next step runs while it is written; what
    lands equals the synchronous save of the same moment, and resuming from it reproduces the next step."""
    import threading

    config, sd = model
    a = TorchBackend(config, sd, lr=1e-3)
    _step(a)
    gate = threading.Event()
    inner = a.checkpoint_writer

    def held(path):  # the file write waits until the next step has changed the live weights
        write = inner(path)
        return lambda: (gate.wait(10), write())

    a.checkpoint_writer = held
    w = checkpoint.CheckpointWriter(tmp_path)
    loop_state = {"version": 1}
    w.save(1, a, loop_state, {"note": "x"})
    assert checkpoint.latest(tmp_path) is None  # not written yet: save() returned at once
    want_loss = _step(a)
    loop_state["version"] = 99  # the loop moves on: the checkpoint keeps what it captured
    gate.set()
    assert w.wait() == checkpoint.latest(tmp_path)
    b = TorchBackend(config, sd, lr=1e-3)
    step, tstate, _ = checkpoint.load(checkpoint.latest(tmp_path), b, verified=True)
    assert (step, tstate) == (1, {"version": 1})
    assert _step(b) == want_loss


def test_a_failed_background_checkpoint_is_raised_by_the_next_save(model, tmp_path):
    config, sd = model
    a = TorchBackend(config, sd, lr=1e-3)

    def broken(path):
        def write():
            raise OSError(28, "No space left on device")
        return write

    a.checkpoint_writer = broken
    w = checkpoint.CheckpointWriter(tmp_path)
    w.save(1, a, {}, {})
    with pytest.raises(OSError, match="No space"):
        w.save(2, a, {}, {})
    assert checkpoint.latest(tmp_path) is None


def test_checkpoints_are_atomic_rotated_and_verified(model, tmp_path):
    config, sd = model
    b = TorchBackend(config, sd, lr=1e-3)
    for s in (1, 2, 3):
        checkpoint.save(tmp_path, s, b, {"s": s}, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]
    (root / "step-000004.tmp").mkdir()  # a crash in the middle of writing step 4: ignored
    assert checkpoint.latest(tmp_path).name == "step-000003"
    f = root / "step-000003" / "backend" / "torch_backend.pt"
    f.write_bytes(f.read_bytes()[:-10])  # truncated on disk
    with pytest.raises(checkpoint.CheckpointError, match=r"is corrupt: 1 file\(s\) missing or changed .*torch_backend.pt"):
        checkpoint.load(root / "step-000003", b)
    (root / "latest").write_text("step-000009\n")
    with pytest.raises(checkpoint.CheckpointError, match="names 'step-000009', which is not a checkpoint"):
        checkpoint.latest(tmp_path)


def test_journal_epochs_torn_tail_and_corruption(tmp_path):
    p = tmp_path / "j.jsonl"
    j = Journal(p)
    j.append({"event": "version", "version": 0})
    j.append({"event": "version", "version": 1})
    j.close()
    with open(p, "a") as f:
        f.write('{"event": "version", "vers')  # the crash hit mid-write
    assert last_version(read(p)) == 1
    j2 = Journal(p)  # cuts the torn line, next epoch
    assert j2.epoch == 2
    j2.append({"event": "version", "version": 2})
    j2.close()
    assert [(r["event"], r["epoch"]) for r in read(p)] == [("start", 1), ("version", 1), ("version", 1),
                                                            ("start", 2), ("version", 2)]
    lines = p.read_text().splitlines()
    lines[1] = "garbage"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(JournalError, match="line 2 is corrupt"):
        read(p)


def test_resume_point_refuses_what_does_not_add_up(model, tmp_path):
    config, sd = model
    b = TorchBackend(config, sd, lr=1e-3)
    req = load_config(None, ["trainer.resume='require'"])
    with pytest.raises(checkpoint.CheckpointError, match="trainer.resume = require but .* has no checkpoint"):
        _resume_point(req, tmp_path)
    assert _resume_point(load_config(None, []), tmp_path) is None  # auto, nothing there: a fresh start
    checkpoint.save(tmp_path, 5, b, {}, {})
    with pytest.raises(checkpoint.CheckpointError, match="manager journal .* is missing or empty"):
        _resume_point(req, tmp_path)
    j = Journal(tmp_path / "manager-journal.jsonl")
    j.append({"event": "version", "version": 3})
    j.close()
    with pytest.raises(checkpoint.CheckpointError, match="at version 5 but the manager journal records versions up to 3"):
        _resume_point(req, tmp_path)
    j = Journal(tmp_path / "manager-journal.jsonl")
    j.append({"event": "version", "version": 6})
    j.close()
    assert _resume_point(req, tmp_path).name == "step-000005"
    assert _resume_point(load_config(None, ["trainer.resume='never'"]), tmp_path) is None


def test_progress_without_its_checkpoints_is_refused_not_retrained_from_step_0(tmp_path):
    """Regression (issue 16): deleting checkpoints/ of a run whose journal records versions up to 5 and starting it
    again exited 0 after retraining from step 0."""
    j = Journal(tmp_path / "manager-journal.jsonl")
    for v in range(6):
        j.append({"event": "version", "version": v})
    j.close()
    with pytest.raises(checkpoint.CheckpointError, match="records versions up to 5, but .* no checkpoint"):
        _resume_point(load_config(None, []), tmp_path)
    # before the first checkpoint was due there is nothing to lose: a fresh start
    assert _resume_point(load_config(None, ["trainer.checkpoint_every=10"]), tmp_path) is None
    assert _resume_point(load_config(None, ["trainer.checkpoint_every=0"]), tmp_path) is None


def test_a_torn_newest_checkpoint_resumes_from_the_previous_verified_one(model, tmp_path, caplog):
    """Issue 16: nothing was fsynced and a torn newest checkpoint stopped the run (exit 2) although an older
    verified one was there. Now files and directories are fsynced, the loop state is JSON (no pickle), and a
    newest checkpoint that does not verify is skipped for the previous one, with a log line naming both."""
    import json
    import logging

    config, sd = model
    b = TorchBackend(config, sd, lr=1e-3)
    checkpoint.save(tmp_path, 4, b, {"version": 4}, {"k": 1})
    checkpoint.save(tmp_path, 5, b, {"version": 5}, {"k": 2})
    newest = tmp_path / "checkpoints" / "step-000005"
    assert json.loads((newest / "trainer.json").read_text())["trainer"] == {"version": 5}
    assert not list(newest.glob("*.pt")) or all(p.parent.name == "backend" for p in newest.rglob("*.pt"))
    with open(newest / "trainer.json", "r+b") as f:  # torn by a power loss
        f.truncate(10)
    j = Journal(tmp_path / "manager-journal.jsonl")
    j.append({"event": "version", "version": 5})
    j.close()
    with caplog.at_level(logging.WARNING, logger="rlboost.checkpoint"):
        ckpt = _resume_point(load_config(None, []), tmp_path)
    assert ckpt.name == "step-000004"
    assert "step-000005" in caplog.text and "step-000004" in caplog.text
    step, trainer_state, run_state = checkpoint.load(ckpt, TorchBackend(config, sd, lr=1e-3))
    assert (step, trainer_state, run_state) == (4, {"version": 4}, {"k": 1})
    with open(tmp_path / "checkpoints" / "step-000004" / "trainer.json", "r+b") as f:
        f.truncate(10)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint of this run verifies"):
        _resume_point(load_config(None, []), tmp_path)


def test_data_frontier_state_resumes_the_same_prompt_order():
    from rlboost_hpc.tasks.base import Prompt

    prompts = [Prompt(pid=f"p{i}", text=str(i)) for i in range(10)]
    a = DataFrontier(prompts, seed=3)
    a.take(13)  # into the second epoch
    b = DataFrontier(prompts, seed=3)
    b.restore(*a.state())
    assert [p.pid for p in a.take(25)] == [p.pid for p in b.take(25)]


def test_cli_resume_without_a_checkpoint_is_a_clear_error(repo_root, tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(tmp_path / "r"), "--resume",
                        "--no-progress"], capture_output=True, text=True, timeout=120, cwd=repo_root)
    assert p.returncode == 2
    assert "trainer.resume = require but" in p.stderr and "has no checkpoint" in p.stderr
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.mark.megatron
@pytest.mark.integration
def test_megatron_backend_run_resumes_from_its_dist_checkpoint(repo_root, tmp_path):
    """trainer.backend=megatron: the checkpoint's backend part is Megatron's dist_checkpointing; a second
    invocation resumes from it and the run's ledgers stay exact."""
    from test_demo_run import run_cli

    out = tmp_path / "mg"
    for steps in (2, 4):
        p = run_cli(repo_root, out, f"trainer.steps={steps}", 'trainer.backend="megatron"')
        assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert (rep["steps"], rep["resumes"], rep["resumed_from_step"]) == (4, 1, 2)
    assert rep["responses_lost"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["responses_trained"] == 4 * 64
    assert any((out / "checkpoints/step-000004/backend").glob("*.distcp"))


def test_checkpoint_from_another_version_is_a_clear_error(model, tmp_path):
    """Regression: a checkpoint whose run state lacked a key added later ('counts') crashed the resume with a bare
    KeyError; it is now a CheckpointError naming the key."""
    config, sd = model
    b = TorchBackend(config, sd, lr=1e-3)
    checkpoint.save(tmp_path, 7, b, {}, {"step_metrics": [], "before": {}, "resumes": 0})
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks \['counts'\] \(written by another version"):
        checkpoint.load(checkpoint.latest(tmp_path), b, run_keys=("step_metrics", "counts"))


@pytest.mark.integration
def test_rerunning_a_finished_run_reports_the_same_totals(repo_root, tmp_path):
    """Regression: the same command again on a finished run resumed with 0 steps left and divided the restored
    tokens by ~0 s of training (6.7 M tokens/s); throughput now uses the training time of every incarnation. Since
    issue 28 a finished run with its report reports again without resuming (the report unchanged); a resume with 0
    steps left still happens when the report is gone (a crash after the last checkpoint, before the report)."""
    from test_demo_run import run_cli

    reps = []
    for i in range(3):
        if i == 2:
            (tmp_path / "r/report.json").unlink()  # the last checkpoint is there, the report is not
        p = run_cli(repo_root, tmp_path / "r", "trainer.steps=2")
        assert p.returncode == 0, p.stderr[-3000:]
        reps.append(json.loads((tmp_path / "r/report.json").read_text()))
    a, again, b = reps
    assert again == a  # reported again, nothing run
    assert b["resumes"] == 1 and b["steps"] == a["steps"] == 2 and b["responses_trained"] == a["responses_trained"]
    assert b["throughput_tokens_per_s"] == pytest.approx(a["throughput_tokens_per_s"], rel=0.5)
    # a checkpoint holds its own step's record only (it held every step's: O(steps) per checkpoint); the earlier
    # records come back from metrics.jsonl, fsynced before the checkpoint was published
    run_state = json.loads((checkpoint.latest(tmp_path / "r") / "trainer.json").read_text())["run"]
    assert "step_metrics" not in run_state and run_state["metrics_lines"] == 1
    assert run_state["last_step_metrics"]["step"] == 1
    steps = [json.loads(x)["step"] for x in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_step_records_before_a_checkpoint_come_from_metrics_jsonl_and_a_short_file_is_not_fatal(tmp_path, caplog):
    from rlboost_hpc.run import _metrics_before

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(5)))
    assert [m["step"] for m in _metrics_before(tmp_path, 3)] == [0, 1, 2]  # later lines: steps after the checkpoint
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "tor')  # truncated by hand
    with caplog.at_level("WARNING"):
        assert [m["step"] for m in _metrics_before(tmp_path, 3)] == [0]
    assert "holds 1 of the 3 step records" in caplog.text
