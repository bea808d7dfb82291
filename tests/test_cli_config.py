"""Config validation and CLI error paths: bad input gets a specific error and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rlboost_hpc.config import ConfigError, load_config


def test_default_config_file_matches_defaults(repo_root):
    cfg = load_config(repo_root / "configs/local.toml")
    assert cfg.rollout.group_size == 8 and cfg.weights.dtype == "bfloat16"


@pytest.mark.parametrize("name", ["local.toml", "gsm8k-qwen3.toml", "gsm8k-qwen3-cpu.toml", "gsm8k-tools.toml"])
def test_shipped_configs_load(repo_root, name):
    cfg = load_config(repo_root / "configs" / name)
    assert cfg.model.name == "stories260K"
    if name.startswith("gsm8k-qwen3"):  # the template a user copies: their model directory, the chat template
        assert cfg.task.name == "gsm8k" and cfg.model.path and cfg.task.chat_template == "auto"
    if name == "gsm8k-tools.toml":  # multi-turn: the calculator, Qwen's tool-call tokens
        assert cfg.task.name == "gsm8k_tools" and cfg.task.turns.max > 1 and cfg.model.path
        assert cfg.trajectory_tokens() == cfg.task.turns.max_tokens >= cfg.rollout.max_new_tokens


def test_multi_turn_keys_are_checked_together():
    assert load_config(None, ["task.turns.max=3", "rollout.max_new_tokens=10"]).trajectory_tokens() == 30
    with pytest.raises(ConfigError, match="task.turns.max_tokens applies to multi-turn tasks only"):
        load_config(None, ["task.turns.max_tokens=100"])
    with pytest.raises(ConfigError, match=r"task.turns.max_tokens \(5\) must be >= rollout.max_new_tokens"):
        load_config(None, ["task.turns.max=2", "task.turns.max_tokens=5", "rollout.max_new_tokens=10"])
    with pytest.raises(ConfigError, match="tool_call_close"):
        load_config(None, ["task.turns.max=2", "task.turns.tool_call_close=''"])


def test_renamed_and_moved_keys_name_their_new_home():
    with pytest.raises(ConfigError, match="model.hf_dir was renamed: use model.path"):
        load_config(None, ["model.hf_dir='/x'"])
    with pytest.raises(ConfigError, match="rollout.sglang.device moved: use rollout.device"):
        load_config(None, ["rollout.sglang.device='cpu'"])


def test_the_task_kind_is_inferred_from_its_tables_and_a_given_one_must_agree_with_them():
    """Issue 56: ``task.kind`` (builtin, own, reasoning_gym) is the one discriminator the run branches on."""
    assert load_config(None).task.kind == "builtin"
    assert load_config(None, ["task.data.path='d.jsonl'", "task.rewards.functions=['r.py:f']"]).task.kind == "own"
    assert load_config(None, ["task.reasoning_gym.name='chain_sum'"]).task.kind == "reasoning_gym"
    from rlboost_hpc.config_task import TaskCfg, TaskDataCfg, TaskRewardsCfg

    built = TaskCfg(data=TaskDataCfg(path="d.jsonl"), rewards=TaskRewardsCfg(functions=["r.py:f"]))
    assert built.kind == "own"  # (tables given as their models, as code builds them)
    for sets, needle in [(["task.kind='own'"], "task.kind = own needs task.data.path"),
                         (["task.kind='builtin'", "task.data.path='d.jsonl'", "task.rewards.functions=['r.py:f']"],
                          "task.data.path is set but task.kind = builtin"),
                         (["task.kind='reasoning_gym'"], "needs task.reasoning_gym"),
                         (["task.kind='builtin'", "task.reasoning_gym.name='chain_sum'"],
                          "task.reasoning_gym is set but task.kind = builtin"),
                         (["task.rewards.functions=['r.py:f']"], "need task.data.path")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, sets)


def test_keys_of_the_earlier_task_layout_in_a_file_or_a_set_are_read_under_their_new_names(tmp_path, caplog):
    """Issue 56 item 1 (a new user's findings): a file's old keys move before the overrides apply, so a ``--set`` of
    the new name overrides them; an old-named ``--set`` overrides a file of the new layout; each source is named in
    its own line; an error of a moved ``--set`` names that ``--set``; an old key written as a table, or a key given
    under both names in one file, is refused naming both."""
    import logging

    old = tmp_path / "old.toml"
    old.write_text('[task]\ndataset = "d.jsonl"\nreward_functions = ["r.py:f"]\nmax_turns = 2\n')
    with caplog.at_level(logging.WARNING, logger="rlboost.config"):
        cfg = load_config(old, ["task.data.path='e.jsonl'", "task.max_turns=3"])
    assert cfg.task.data.path == "e.jsonl" and cfg.task.turns.max == 3 and cfg.task.rewards.functions == ["r.py:f"]
    said = [r.getMessage() for r in caplog.records if r.name == "rlboost.config"]
    assert len(said) == 2 and str(old) in said[0] and "task.dataset → task.data.path" in said[0], said
    assert said[1].startswith("--set") and "task.max_turns → task.turns.max" in said[1], said
    with pytest.raises(ConfigError, match=r"task.turns.max: Input should be greater than or equal to 1 \(from --set "
                                          r"task.turns.max=0\)"):
        load_config(old, ["task.max_turns=0"])
    both = tmp_path / "both.toml"
    both.write_text('[task]\ndataset = "d.jsonl"\nreward_functions = ["r.py:f"]\n[task.data]\npath = "e.jsonl"\n')
    with pytest.raises(ConfigError, match=rf"task.dataset and task.data.path are the same key.*\(in {both}\)"):
        load_config(both)
    table = tmp_path / "table.toml"
    table.write_text('[task.dataset]\npath = "d.jsonl"\n')
    with pytest.raises(ConfigError, match=r"\[task.dataset\] is no table: .* now task.data.path .*\[task.data\]"):
        load_config(table)


def test_one_side_a_checkpoint_of_the_flat_task_layout_resumes_against_the_same_data_set(tmp_path):
    """One side (a hand-written ``trainer.json`` and a stand-in setup): a checkpoint written before ``[task]`` was
    nested records its data set's fingerprint under ``task.dataset``; resuming it against the same file is allowed,
    against a changed one refused naming the key of this layout."""
    import json
    from types import SimpleNamespace

    from rlboost_hpc.run_setup import check_same_data
    from rlboost_hpc.trainer.checkpoint import CheckpointError

    (tmp_path / "trainer.json").write_text(json.dumps({"run": {"datasets": {"task.dataset": "f1"}}}))

    def setup(fingerprint):
        return SimpleNamespace(checkpoint_identity=lambda: {"datasets": {"task.data.path": fingerprint}},
                               task=SimpleNamespace(data_source=lambda key: "d.jsonl"))
    check_same_data(tmp_path, setup("f1"), None)
    with pytest.raises(CheckpointError, match="task.data.path = d.jsonl: the data set changed"):
        check_same_data(tmp_path, setup("f2"), None)


def test_dotted_overrides_are_typed(repo_root):
    cfg = load_config(repo_root / "configs/local.toml", ["trainer.steps=3", "weights.dtype=float32",
                                                         "cluster.kill_fraction=0.5"])
    assert cfg.trainer.steps == 3 and cfg.weights.dtype == "float32" and cfg.cluster.kill_fraction == 0.5


@pytest.mark.parametrize("override,needle", [
    (["trainer.stepz=3"], "trainer.stepz"),
    (["nonsense.key=1"], "nonsense"),
    (["trainer.steps=-1"], "trainer.steps"),
    (["weights.dtype=float8"], "weights.dtype"),
    (["trainer"], "key.path=value"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, override)


def test_malformed_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_heartbeat_timeout_must_exceed_interval():
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        load_config(None, ["manager.heartbeat_s=1.0", "manager.heartbeat_timeout_s=1.5"])


def test_several_instances_per_worker_only_for_emulated_instances_on_the_local_cluster():
    """Only emulated instances share a worker process: a real engine's would share one device and its memory."""
    for extra, got in [([], "torch / local"), (["rollout.engine='emulated'", "cluster.kind='slurm'"],
                                                "emulated / slurm")]:
        with pytest.raises(ConfigError, match=rf"cluster\.instances_per_worker = 4 needs .*\(got {got}\)"):
            load_config(None, ["cluster.instances_per_worker=4", *extra])
    with pytest.raises(ConfigError, match=r"cluster\.instances_per_worker"):
        load_config(None, ["cluster.instances_per_worker=0"])
    cfg = load_config(None, ["cluster.instances_per_worker=4", "rollout.engine='emulated'"])
    assert cfg.cluster.instances_per_worker == 4


def _run_cli(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_cli_unknown_config_key_exits_2(tmp_path):
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", "trainer.stepz=1")
    assert p.returncode == 2 and "trainer.stepz" in p.stderr


@pytest.mark.parametrize("override, needle", [
    ("trainer.loss_aggregation='sum'", "trainer.loss_aggregation"),
    ("trainer.kl_estimator='k4'", "trainer.kl_estimator"),
    ("trainer.behaviour_correction='is'", "trainer.behaviour_correction"),
    ("trainer.behaviour_level='batch'", "trainer.behaviour_level"),
    ("trainer.behaviour_cap=0", "trainer.behaviour_cap"),
    ("trainer.behaviour_cap=-1.5", "trainer.behaviour_cap"),
    ("trainer.clip_eps_high=0.1", "trainer.clip_eps_high"),
    ("trainer.clip_eps_high=0", "trainer.clip_eps_high"),
    ("trainer.advantage_std_norm='maybe'", "trainer.advantage_std_norm"),
])
def test_grpo_options_refuse_unknown_modes_and_bad_numbers_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_grpo_options_load_with_their_defaults_and_overrides(repo_root):
    t = load_config(repo_root / "configs/local.toml").trainer
    assert (t.loss_aggregation, t.advantage_std_norm, t.kl_estimator, t.behaviour_correction, t.behaviour_cap,
            t.behaviour_level, t.mask_truncated, t.clip_eps_high) == ("seq_mean_token_mean", True, "k3", "none", 2.0,
                                                                     "token", False, None)
    t = load_config(None, ["trainer.clip_eps_high=0.28", "trainer.loss_aggregation='token_mean'",
                           "trainer.behaviour_correction='mis'", "trainer.mask_truncated=true"]).trainer
    assert t.clip_eps_high == 0.28 and t.loss_aggregation == "token_mean" and t.behaviour_correction == "mis"


def test_a_bad_grpo_option_exits_2_naming_the_key(tmp_path):
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", "trainer.clip_eps_high=0.1")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "trainer.clip_eps_high" in p.stderr and "trainer.clip_eps" in p.stderr


def test_behaviour_correction_with_an_engine_that_returns_no_logprobs_is_refused_naming_the_engine(monkeypatch):
    """The check runs before the model loads (RunSetup.load); ConfigError is BadInput: exit 2."""
    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.rollout.engines import factory
    from rlboost_hpc.run_setup import RunSetup

    cfg = load_config(None, ["rollout.engine='sglang'", "trainer.behaviour_correction='tis'"])
    monkeypatch.setitem(factory.BEHAVIOUR_LOGPROBS, "sglang", False)
    with pytest.raises(ConfigError, match="rollout.engine = sglang returns none") as e:
        RunSetup.load(cfg)
    assert isinstance(e.value, BadInput) and "trainer.behaviour_correction = tis" in str(e.value)
    monkeypatch.setitem(factory.BEHAVIOUR_LOGPROBS, "sglang", True)
    from rlboost_hpc.run_setup import check_behaviour_logprobs

    check_behaviour_logprobs(cfg)  # both engines of the project return them


def test_top_p_below_1_is_refused_naming_the_key(tmp_path):
    """Regression (issue 16): top_p < 1 was accepted although the trainer scores tokens under the full softmax
    (drawn from the renormalised nucleus, trained under another distribution)."""
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", "rollout.top_p=0.5")
    assert p.returncode == 2 and "rollout.top_p" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o" / "report.json").exists()


def test_seeding_bounds_that_contradict_each_other_are_refused_naming_both_keys(tmp_path):
    """Regression (issue 15): the config loaded, then the run died with a traceback and exit 1."""
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", "policy.t_seed_ceil_s=0.01")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "policy.t_seed_ceil_s" in p.stderr and "policy.t_seed_floor_s" in p.stderr


def test_a_renamed_key_is_refused_naming_its_new_name(tmp_path):
    """T_seed has one name (``policy.t_seed_*``): a config still using ``trainer.seed_window_s`` exits 2 and says
    what the key is called now, in a file or an override."""
    cfg = tmp_path / "old.toml"
    cfg.write_text("[trainer]\nsteps = 2\nseed_window_s = 0.5\n")
    p = _run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "trainer.seed_window_s is now policy.t_seed_initial_s" in p.stderr and str(cfg) in p.stderr
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", "policy.seed_floor_s=1")
    assert p.returncode == 2 and "policy.seed_floor_s is now policy.t_seed_floor_s" in p.stderr
    assert not (tmp_path / "o" / "report.json").exists()


@pytest.mark.parametrize("argv", [["run", "--log-level", "FOO"], ["scavenger", "/nonexistent", "--log-level", "FOO"]])
def test_an_unknown_log_level_is_a_usage_error(tmp_path, argv):
    """Regression (issue 15): ``--log-level FOO`` exited 1 from inside logging."""
    p = _run_cli(*argv, "--out", str(tmp_path / "o")) if argv[0] == "run" else _run_cli(*argv)
    assert p.returncode == 2 and "--log-level" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_missing_data_file_exits_2_with_origin(tmp_path):
    """An empty data directory: the demo's model comes from the package's own copy (issue 48), a data set that is not
    shipped (GSM8K) is exit 2 naming the file and its public origin."""
    (tmp_path / "data").mkdir()
    p = _run_cli("run", "--out", str(tmp_path / "o"), "--set", f"data.dir='{tmp_path / 'data'}'",
                 "--set", f"model.cache_dir='{tmp_path / 'cache'}'", "--set", "task.name=gsm8k")
    assert p.returncode == 2
    assert "gsm8k/train.jsonl" in p.stderr and "Public origin" in p.stderr and "Traceback" not in p.stderr


def test_cli_bad_trace_file_exits_2_naming_the_line(tmp_path, repo_root):
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,node1\n1000,add,node2\nxx,remove,node1\n")
    p = _run_cli("run", "--config", str(repo_root / "configs/local.toml"), "--out", str(tmp_path / "o"),
                 "--set", f"cluster.trace='{trace}'", "--set", "trainer.steps=1")
    assert p.returncode == 2
    assert "bad.csv:3" in p.stderr


def test_cli_trace_window_the_settings_cannot_find_exits_2_naming_the_keys(tmp_path, repo_root):
    """Regression: ``cluster.max_workers=1`` with the default window requirements once ended in a ValueError
    traceback (exit 1) from the window search; it is bad input: exit 2 naming the keys to change."""
    p = _run_cli("run", "--config", str(repo_root / "configs/local.toml"), "--out", str(tmp_path / "o"),
                 "--set", "cluster.max_workers=1", "--set", "trainer.steps=1")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "no 2560 s window" in p.stderr and "cluster.min_changes" in p.stderr


@pytest.mark.integration
def test_an_in_process_run_leaves_the_process_environment_as_it_was(repo_root, tmp_path, monkeypatch):
    """Regression: ``run()`` once set ``RLBOOST_RUN_ID`` (and ``RLBOOST_DATA`` for ``data.dir``) in the calling
    process; a later run in the same process (a pytest session) then carried the first run's id in its logs
    and endpoints. The run id and data directory are now passed, never stored in ``os.environ``."""
    import json
    import os
    import shutil

    from rlboost_hpc.paths import DEFAULT_DATA_DIR, data_dir
    from rlboost_hpc.run import run

    monkeypatch.delenv("RLBOOST_RUN_ID", raising=False)
    monkeypatch.delenv("RLBOOST_DATA", raising=False)
    data = tmp_path / "data"
    shutil.copytree(DEFAULT_DATA_DIR / "stories260K", data / "stories260K")
    before = dict(os.environ)
    cfg = load_config(repo_root / "configs/local.toml", [
        "trainer.steps=1", "cluster.max_workers=0", "trainer.eval_samples=1", "task.heldout_prompts=2",
        f"data.dir='{data}'", f"model.cache_dir='{tmp_path / 'models'}'"])
    rep = run(cfg, tmp_path / "first", progress=False)
    assert rep["steps"] == 1
    assert json.loads((tmp_path / "first/endpoints.json").read_text())["run_id"] == "first"
    assert {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} == {
        k: v for k, v in before.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    assert data_dir() == DEFAULT_DATA_DIR  # data.dir held only while the run ran


def test_chaos_refuses_an_out_dir_holding_another_run(tmp_path):
    """Regression (issue 16): `chaos --out DIR` silently deleted DIR's checkpoints and journal."""
    run_dir = tmp_path / "precious"
    (run_dir / "checkpoints" / "step-000005").mkdir(parents=True)
    (run_dir / "report.json").write_text("{}")
    p = _run_cli("chaos", "--out", str(run_dir), "--steps", "2")
    assert p.returncode == 2 and "--fresh" in p.stderr and "Traceback" not in p.stderr
    assert (run_dir / "checkpoints" / "step-000005").is_dir()


@pytest.mark.integration
def test_on_a_terminal_the_progress_bar_owns_the_screen_and_json_lines_go_to_the_run_directory(repo_root, tmp_path):
    """Issue 16: run with stdout on a terminal (a pseudo-terminal here): the progress bar is drawn there, no JSON
    line reaches stderr, and the trainer's and the manager's JSON lines (INFO and up) are in ``RUN_DIR/logs/``."""
    import json
    import os
    import pty
    import threading

    master, slave = pty.openpty()
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.cli", "run", "--config",
                             str(repo_root / "configs/local.toml"), "--out", str(out), "--set", "trainer.steps=2",
                             "--set", "cluster.max_workers=0", "--set", "trainer.export_model=false"],
                            stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=repo_root)
    os.close(slave)
    screen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            screen.extend(chunk)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    t.join(10)
    os.close(master)
    text = screen.decode(errors="replace")
    assert proc.returncode == 0, err[-3000:]
    assert "step 2/2" in text and "run summary" in text, text[-2000:]
    assert not [ln for ln in err.splitlines() if ln.lstrip().startswith("{")], err[-2000:]
    for role in ("trainer", "manager"):
        lines = [json.loads(ln) for ln in (out / "logs" / f"{role}.jsonl").read_text().splitlines()]
        assert lines and all(x["role"] == role and x["run"] == "run" for x in lines), lines[:3]
        assert any(x["level"] == "INFO" for x in lines), role


@pytest.mark.parametrize("cmd", ["run", "worker", "scavenger", "stats", "simulate", "chaos"])
def test_help_describes_every_flag_with_its_default(cmd, monkeypatch, capsys):
    """Issue 16: ``rlboost-hpc CMD --help`` describes every argument, and shows each default that exists."""
    import argparse

    from rlboost_hpc import cli
    from rlboost_hpc.clihelp import DefaultsHelpFormatter

    shown: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.print_help
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda self, file=None: (shown.append(self), real(self, file)))
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--help"])
    assert e.value.code == 0
    parser, text = shown[-1], capsys.readouterr().out
    assert parser.formatter_class is DefaultsHelpFormatter and parser.description
    flat = "".join(text.split())  # argparse wraps long values (even inside a path, at a hyphen)
    for a in parser._actions:
        assert a.help, (cmd, a.option_strings or a.dest)
        if a.default not in (None, False, [], argparse.SUPPRESS) and a.option_strings:
            assert "".join(f"(default: {a.default})".split()) in flat, (cmd, a.option_strings)


def test_every_error_a_command_reports_has_exactly_one_of_the_two_bases():
    """Commands catch two bases, never a hand-kept list: bad input → exit 2, a failed run → exit 1."""
    from rlboost_hpc.cluster.traces import TraceFormatError
    from rlboost_hpc.config import ConfigError
    from rlboost_hpc.errors import BadInput, RunFailed
    from rlboost_hpc.manager.journal import JournalError
    from rlboost_hpc.models.arch import ModelFormatError
    from rlboost_hpc.models.device import DeviceError
    from rlboost_hpc.paths import DataFileMissing
    from rlboost_hpc.rollout.spec import WorkerSpecError
    from rlboost_hpc.rundir import RunDirError
    from rlboost_hpc.trainer.checkpoint import CheckpointError
    from rlboost_hpc.trainer.client import ManagerError
    from rlboost_hpc.trainer.loop import RolloutFailed
    from scavenger.config import ScavengerConfigError

    bad = [ConfigError, TraceFormatError, JournalError, ModelFormatError, DeviceError, DataFileMissing,
           WorkerSpecError, RunDirError, CheckpointError, ScavengerConfigError]
    assert all(issubclass(c, BadInput) and not issubclass(c, RunFailed) for c in bad)
    assert all(issubclass(c, RunFailed) and not issubclass(c, BadInput) for c in (ManagerError, RolloutFailed))
    assert (BadInput.exit_status, RunFailed.exit_status) == (2, 1)


def test_every_config_key_has_a_description():
    """Issue 32: the config is the one home of every knob, and says what each one does — every field of every
    section (nested sections included) has a description, every section a docstring; the task key lists every
    registered task."""
    import typing

    from pydantic import BaseModel

    from rlboost_hpc.config import RunConfig
    from rlboost_hpc.tasks.base import known_tasks

    def sections(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield ann
        for a in typing.get_args(ann):
            yield from sections(a)

    undescribed, undocumented, seen = [], [], set()

    def walk(model, prefix):
        if not (model.__doc__ or "").strip():
            undocumented.append(model.__name__)
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                undescribed.append(prefix + name)
            for sub in sections(field.annotation):
                if sub not in seen:
                    seen.add(sub)
                    walk(sub, f"{prefix}{name}.")

    walk(RunConfig, "")
    assert len(seen) >= 11 and not undescribed and not undocumented, (undescribed, undocumented)
    desc = RunConfig.model_fields["task"].annotation.model_fields["name"].description
    assert all(t in desc for t in known_tasks()), (desc, known_tasks())


def test_scheduled_slow_loads_need_a_length():
    """Issue 50 item 4: ``cluster.faults.kinds`` with slow_load scheduled by progress and no ``slow_load_s`` would
    inject nothing; it is refused naming both keys."""
    with pytest.raises(ConfigError, match="slow_load_s > 0"):
        load_config(None, ["cluster.faults.every_steps=2", "cluster.faults.kinds=['slow_load']"])
    cfg = load_config(None, ["cluster.faults.every_steps=2", "cluster.faults.kinds=['stall', 'slow_load']",
                             "cluster.faults.slow_load_s=5"])
    assert cfg.cluster.faults.kinds == ["stall", "slow_load"]
    with pytest.raises(ConfigError, match="kinds"):
        load_config(None, ["cluster.faults.kinds=['meteor']"])
