"""The ``rlboost-hpc`` command line as a user meets it (issue 28): every command's bad input exits 2 with one line
naming the file or key (never a traceback), Ctrl-C says what to do next, a finished run reports again without
starting anything, a run directory of another model is refused in one line, and what a step costs is said before
the first one starts. Each runs the real command in a subprocess."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlboost_hpc.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
LOCAL = str(REPO / "configs/local.toml")


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def one_line_refusal(p: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, no traceback, every needle in stderr, and at most two plain lines there (JSON log lines aside)."""
    plain = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert all(n in p.stderr for n in needles) and len(plain) <= 2, p.stderr[-3000:]


@pytest.mark.parametrize("cmd", ["run", "chaos"])
def test_an_out_that_is_a_file_exits_2_naming_it(tmp_path, cmd):
    """Regression: ``run --out F`` died in ``setup_logging`` (NotADirectoryError), ``chaos --out F`` with
    FileExistsError — both exit 1 with a traceback."""
    f = tmp_path / "F"
    f.write_text("precious")
    one_line_refusal(cli(cmd, "--config", LOCAL, "--out", str(f)), str(f), "is a file, not a directory")
    assert f.read_text() == "precious"


@pytest.mark.parametrize("args,needle", [
    (["--config", "missing.toml"], "config file not found: missing.toml"),
    (["--set", "trainer.stesp=1"],
     "trainer.stesp: not a configuration key (did you mean trainer.steps?) (from --set trainer.stesp=1)"),
    (["--config", "BAD"], "trainer.stesp: not a configuration key (did you mean trainer.steps?) (in "),
])
def test_chaos_refuses_bad_configuration_before_writing_anything(tmp_path, args, needle):
    """Regression: ``chaos`` never caught the configuration's errors (exit 1, traceback), after it had made its
    output directory and trace."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nstesp = 1\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    one_line_refusal(cli("chaos", *args, "--out", str(tmp_path / "out"), cwd=tmp_path), needle)
    assert not (tmp_path / "out").exists()


def test_set_errors_name_the_command_line_and_checks_across_keys_read_plainly(tmp_path):
    """Regression: a bad ``--set`` was reported as "invalid configuration in configs/local.toml", and a check across
    keys as ``<root>: Value error, …``."""
    with pytest.raises(ConfigError) as e:
        load_config(LOCAL, ["trainer.stesp=1"])
    assert "(from --set trainer.stesp=1)" in str(e.value) and f"in {LOCAL}" not in str(e.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nsteps = -1\n")
    with pytest.raises(ConfigError, match=rf"trainer.steps: .* \(in {bad}\)"):
        load_config(bad)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policy.t_seed_ceil_s=0.01"])
    assert "<root>" not in str(e.value) and "Value error" not in str(e.value)
    assert "policy.t_seed_ceil_s (0.01) must be >= policy.t_seed_floor_s" in str(e.value)
    assert "(from --set policy.t_seed_ceil_s=0.01)" in str(e.value)


@pytest.mark.parametrize("key,hint", [
    ("trainer.lora.rnak", "did you mean trainer.lora.rank?"),
    ("task.data.pathh", "did you mean task.data.path?"),
    ("rollout.tempreature", "did you mean rollout.temperature?"),
    ("trainer.xyzzy", None),
])
def test_an_unknown_key_of_any_table_names_the_keys_it_resembles(tmp_path, key, hint):
    """A misspelt key in a sub-table (``trainer.lora``, ``task.data``) is refused naming the keys of that table it
    resembles; one like none of them is only refused. Through the door: ``rlboost-hpc run --set``, exit 2, one line,
    nothing written."""
    out = tmp_path / "out"
    r = cli("run", "--config", LOCAL, "--set", f"{key}=1", "--out", str(out), cwd=tmp_path)
    one_line_refusal(r, f"{key}: not a configuration key")
    assert (hint in r.stderr) if hint else "did you mean" not in r.stderr
    assert not out.exists()


def test_a_suggested_key_is_not_named_as_a_source_of_the_error():
    """Regression (the did-you-mean hint): ``--set trainer.steps=5 --set trainer.stesp=1`` named both overrides as the
    source, because the hint's ``trainer.steps`` was matched like a key of the message."""
    with pytest.raises(ConfigError) as e:
        load_config(LOCAL, ["trainer.steps=5", "trainer.stesp=1"])
    assert "(from --set trainer.stesp=1)" in str(e.value) and "--set trainer.steps=5" not in str(e.value)


def test_version_and_help_print_each_default_once():
    """``--version`` exists; the scavenger's help printed ``--no-requeue … (default: True)``, the default of the
    flag it switches off."""
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.startswith("rlboost-hpc ") and p.stdout.split()[1][0].isdigit()
    text = " ".join(cli("scavenger", "--help").stdout.split())
    assert text.count("(default: True)") == 1 and "--no-requeue submit with --no-requeue (preempted jobs" in text
    p = cli("launch", "--help")
    assert p.returncode == 0 and "usage: sbatch/launch RUN_DIR CONFIG.toml" in p.stdout


def test_the_scavenger_refuses_a_run_directory_that_does_not_exist(tmp_path):
    """Regression: the scavenger silently created a mistyped run directory and waited there for a target."""
    p = cli("scavenger", str(tmp_path / "typo"), "--once")
    one_line_refusal(p, "no such run directory", str(tmp_path / "typo"))
    assert not (tmp_path / "typo").exists()


def _finished_run(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    p = cli("run", "--config", LOCAL, "--out", str(out), "--no-progress", "--set", "trainer.steps=2",
            "--set", "cluster.max_workers=0", "--set", "trainer.export_model=false")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.integration
def test_a_finished_run_reports_again_without_starting_anything_and_another_model_is_refused(tmp_path):
    """Regression: the same command on a finished run restarted the manager and workers, evaluated twice more and
    rewrote ``report.json`` with ``resumes: 1``; the same ``--out`` with another model printed a 24-line
    ``load_state_dict`` dump after 13 s. Also: the step's cost is logged before the first step."""
    out = _finished_run(tmp_path)
    first = (out / "report.json").read_bytes()
    trainer_log = (out / "logs" / "trainer.jsonl").read_text()
    cfg = load_config(LOCAL)
    step_n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert f"a step generates up to {step_n * cfg.rollout.max_new_tokens:,} tokens" in trainer_log
    assert f"decode tokens/s at batch {min(cfg.rollout.max_batch, step_n)}" in trainer_log
    starts = (out / "manager-journal.jsonl").read_text().count('"start"')
    p = cli("run", "--config", LOCAL, "--out", str(out), "--no-progress", "--set", "trainer.steps=2",
            "--set", "cluster.max_workers=0", "--set", "trainer.export_model=false")
    assert p.returncode == 0 and "run summary" in p.stdout, p.stderr[-3000:]
    assert "holds this run finished (2 steps): its report again, nothing started" in p.stderr
    assert (out / "report.json").read_bytes() == first
    assert (out / "manager-journal.jsonl").read_text().count('"start"') == starts  # no manager started

    from _models import make_model_dir

    other = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False)
    p = cli("run", "--config", LOCAL, "--out", str(out), "--no-progress", "--set", "trainer.steps=3",
            "--set", f"model.path='{other}'", "--set", "cluster.max_workers=0")
    one_line_refusal(p, f"{out} holds a run of another model", "use a new --out or --set trainer.resume=never")
    assert "size mismatch" not in p.stderr and (out / "report.json").read_bytes() == first


@pytest.mark.integration
def test_ctrl_c_prints_one_line_that_says_how_to_resume(tmp_path):
    """Regression: Ctrl-C on a terminal printed two KeyboardInterrupt tracebacks (the trainer's and the manager
    process's, ≈ 85 lines) and nothing about resuming. Ctrl-C is typed into a pseudo-terminal, so the terminal
    sends SIGINT to the whole foreground process group, as a user's would."""
    out = tmp_path / "run"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the terminal
        os.execv(sys.executable, [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", LOCAL, "--out",
                                  str(out), "--set", "trainer.export_model=false"])
    screen, sent, deadline, status = bytearray(), False, time.monotonic() + 300, None
    try:
        while status is None and time.monotonic() < deadline:
            if not sent and b"step 2/" in screen:
                os.write(fd, b"\x03")
                sent = True
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    screen.extend(os.read(fd, 65536))
                except OSError:  # the child closed the terminal
                    pass
            done, st = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(st) if done else None
    finally:
        if status is None:
            os.kill(pid, 9)
        os.close(fd)
    text = screen.decode(errors="replace")
    assert sent and status == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "rlboost-hpc run: interrupted; run the same command again to resume from the last checkpoint" in text


def test_a_ctrl_c_python_swallows_in_a_finalizer_still_stops_the_run(monkeypatch):
    """Regression (CI, once): Ctrl-C at step 2 of 60 and the run trained to step 60 and exited 0. A SIGINT whose
    ``KeyboardInterrupt`` is raised inside a finalizer (a ZeroMQ socket's ``__del__``) is swallowed by Python
    ("Exception ignored"); the run loop's check at the next step boundary raises it again."""
    import gc
    import signal

    from rlboost_hpc import interrupts

    class Finalized:
        def __del__(self):  # the signal lands while Python runs this finalizer's bytecode
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        Finalized()  # Python's own handler: the interrupt is lost
        gc.collect()
        assert swallowed == [KeyboardInterrupt]
        interrupts.check()  # not installed: nothing latched
        interrupts.install()
        Finalized()
        gc.collect()
        assert swallowed == [KeyboardInterrupt, KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    finally:
        interrupts.uninstall()
    interrupts.check()  # (later tests run the loop in this process)


def test_probe_rates_and_the_estimate_are_consistent():
    """The step-cost arithmetic (hand-computed): 64 responses × 100 prompt tokens at 1,000 prefill tokens/s plus
    64 × 256 new tokens at 512 decode tokens/s = 6.4 + 32 s."""
    from rlboost_hpc.trainer.cost import EngineRates, estimate

    c = estimate(EngineRates(batch=32, prefill_tokens_per_s=1000.0, decode_tokens_per_s=512.0), step_responses=64,
                 eval_responses=10, tokens_per_response=256, mean_prompt_tokens=100.0)
    assert c.step_tokens == 64 * 256 and c.step_prompt_tokens == 6400
    assert c.step_s == pytest.approx(38.4) and c.eval_s == pytest.approx(1.0 + 5.0)
    with pytest.raises(ValueError):
        estimate(EngineRates(1, 0.0, 1.0), step_responses=1, eval_responses=1, tokens_per_response=1,
                 mean_prompt_tokens=1)


def test_engines_size_their_kv_cache_for_the_run_not_the_models_whole_context(stories260k_hf_dir):
    """Regression: every torch engine (reserved, workers, evaluation) allocated KV cache for the model's whole
    context — for Qwen3-0.6B (40,960 positions) 300 GB at batch 64 in fp32, an out-of-memory death before the
    first step. The run's engines hold the longest prompt + the response budget."""
    from rlboost_hpc.models.hf_dir import load_model_dir
    from rlboost_hpc.rollout.engines.factory import factory_from_spec
    from rlboost_hpc.rollout.spec import WorkerSpec

    policy = load_model_dir(stories260k_hf_dir)
    cfg = load_config(LOCAL)
    spec = WorkerSpec.from_config(cfg, context_tokens=80)
    assert spec.engine["max_len"] == 80
    eng = factory_from_spec(spec.engine, 4)(policy.hf_config, policy.state_dict, arch=policy.arch)
    assert eng.max_len == 80 and eng.cache.k.shape[-2] == 80
    eng = factory_from_spec({"kind": "torch"}, 4)(policy.hf_config, policy.state_dict, arch=policy.arch)
    assert eng.max_len == policy.arch.max_position_embeddings  # (a spec of an older trainer: as before)


def test_train_sbatch_never_retries_bad_input(tmp_path):
    """``sbatch/train.sbatch`` restarts a trainer that exits 1 (a failed run resumes) but never one that exits 2:
    bad input — here an ``--out`` that is a file, which exited 1 with a traceback before — costs one start, not
    three allocations' worth (run outside Slurm: the script needs only its environment)."""
    f = tmp_path / "run-dir-is-a-file"
    f.write_text("")
    env = dict(os.environ, RLBOOST_RUN_DIR=str(f), RLBOOST_CONFIG=LOCAL, RLBOOST_PYTHON=sys.executable)
    p = subprocess.run(["bash", str(REPO / "sbatch/train.sbatch")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and "restart" not in p.stderr and "is a file, not a directory" in p.stderr, p.stderr


def test_a_librarys_python_warnings_become_json_log_lines(tmp_path):
    """megatron-core's plain-text ``UserWarning`` lines landed in the middle of the JSON log stream."""
    code = ("import warnings, logging; from rlboost_hpc.observe.logs import setup_logging; "
            "setup_logging('trainer', run_id='r'); warnings.warn('a library speaks', UserWarning)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    [line] = [ln for ln in p.stderr.splitlines() if ln.strip()]
    rec = json.loads(line)
    assert rec["level"] == "WARNING" and rec["logger"] == "py.warnings" and "a library speaks" in rec["msg"]


def _closed_pipe_run(args: list[str]) -> subprocess.CompletedProcess:
    """``rlboost-hpc ARGS`` with stdout a pipe whose reader is gone (what ``| head`` leaves once it has its lines)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(w)


def test_output_into_a_closed_pipe_ends_quietly_with_141(tmp_path):
    """Regression (issue 50): ``rlboost-hpc stats RUN --json | head -1`` (and ``harvest check --json | head``,
    ``simulate --paper-table | head``) ended in a BrokenPipeError traceback. Every command's output goes through
    one boundary: the status is 141 (a process a closed pipe ends), stderr stays empty."""
    from test_scavenger_stats import synthetic_events, write_log

    write_log(tmp_path, synthetic_events())
    p = _closed_pipe_run(["stats", str(tmp_path), "--json"])
    assert p.returncode == 141 and p.stderr == "", p.stderr
    p = _closed_pipe_run(["stats", str(tmp_path), "--per-job"])
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_a_command_writing_into_a_closed_pipe_returns_141_from_main(monkeypatch):
    """The same boundary in-process: a command whose write fails with EPIPE returns 141 from ``main``."""
    import rlboost_hpc.cli as cli

    def writes(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("rlboost_hpc.sim.cli.main", writes)
    monkeypatch.setattr(cli, "_discard_stdout", lambda: None)  # (pytest owns this process's stdout)
    assert cli.main(["simulate", "--paper-table"]) == cli.EXIT_PIPE_CLOSED


@pytest.mark.parametrize("args, needle", [
    (["simulate", "--duration", "-5"], "argument --duration: -5 must be > 0"),
    (["simulate", "--jobs", "0"], "argument --jobs: 0 must be >= 1"),
    (["chaos", "--workers", "0"], "argument --workers: 0 must be >= 1"),
    (["chaos", "--kill-fraction", "1.5"], "argument --kill-fraction: 1.5 must be <= 1"),
    (["chaos", "--steps", "many"], "argument --steps: 'many' is not an integer"),
    (["chaos", "--fault-kinds", "stall,meteor"], "kinds are preempt, kill, stall, link_reset, slow_load"),
    (["chaos", "--fault-kinds", "slow_load"], "--fault-kinds slow_load needs --slow-load-s > 0"),
])
def test_numbers_out_of_range_are_bad_usage_exit_2(tmp_path, args, needle):
    """Regression (issue 50): ``simulate --duration -5`` and ``chaos --workers 0`` exited 0 (a run that did nothing
    or a default that replaced the value); a number outside its range is bad usage, before anything starts."""
    p = cli(*args, "--out", str(tmp_path / "out"), cwd=tmp_path) if args[0] == "chaos" else cli(*args, cwd=tmp_path)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_launch_with_a_file_as_its_run_directory_exits_2_naming_it(tmp_path):
    """Issue 50: ``sbatch/launch FILE CONFIG`` exited 1; it is bad input (exit 2, the file named, nothing submitted)."""
    f = tmp_path / "F"
    f.write_text("x")
    p = subprocess.run(["bash", str(REPO / "sbatch/launch"), str(f), LOCAL], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, RLBOOST_PYTHON=sys.executable))
    assert p.returncode == 2 and str(f) in p.stderr and "is a file, not a directory" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_every_command_says_what_it_does_and_the_top_level_names_every_harvest_command():
    """Regression (issue 50): the top-level ``--help`` omitted ``harvest report``; ``harvest check --help`` had no
    description (only its usage and flags)."""
    top = " ".join(cli("--help").stdout.split())
    for sub in ("harvest check", "harvest serve", "harvest report"):
        assert f"`{sub}`" in top, top
    for cmd in (["run"], ["worker"], ["scavenger"], ["stats"], ["simulate"], ["chaos"], ["harvest"],
                ["harvest", "check"], ["harvest", "serve"], ["harvest", "report"]):
        out = cli(*cmd, "--help").stdout
        blocks = [b for b in out.split("\n\n") if b.strip()]
        description = [b for b in blocks[1:] if not b.lstrip().startswith(("options:", "positional", "usage:"))]
        assert description and len(description[0].split()) >= 3, (cmd, out[:600])


def test_the_chaos_verdict_is_one_line_with_pass_or_fail_and_every_invariant():
    from rlboost_hpc.chaos import verdict

    checks = {"responses_lost": 0, "responses_duplicated": 0, "tokens_trained_off_version": 0}
    ok = verdict(checks, 8, 23)
    assert ok.startswith("rlboost-hpc chaos: PASS") and "8 steps, 23 faults" in ok and "\n" not in ok
    assert all(f"{k} 0" in ok for k in checks)
    bad = verdict({**checks, "responses_lost": 2}, 8, 23)
    assert "FAIL" in bad and "responses_lost 2" in bad and bad.endswith("broken: responses_lost")


def test_the_progress_bar_and_the_summary_name_what_they_count():
    """Regression (issue 50): the bar's "migrated" counted the step's trained responses that had moved, the
    summary's "responses migrated" every move (seeds, preemptions, releases; one response moving twice counts 2)."""
    from rlboost_hpc.observe.report import SUMMARY_KEYS, ProgressView

    bar = ProgressView.text({"reward_mean": 0.5, "throughput_tokens_per_s": 900.0, "live_preemptible": 2,
                             "responses_migrated": 3, "responses": 64})
    assert "responses moved 3/64" in bar and "migrated" not in bar
    assert dict(SUMMARY_KEYS)["responses_migrated"].startswith("migrations (moves of unfinished responses")


@pytest.mark.integration
def test_a_renamed_run_directory_is_refused_with_the_id_that_resumes_it_and_resumes_with_it(tmp_path):
    """Regression (issue 50): a copied or renamed run directory could not be resumed, and the refusal did not say
    that ``RLBOOST_RUN_ID=<old name>`` resumes it. It says so now, and doing what it says resumes the run."""
    def run(out: Path, steps: int, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", LOCAL, "--out", str(out),
                               "--no-progress", "--set", f"trainer.steps={steps}", "--set", "cluster.max_workers=0",
                               "--set", "rollout.max_new_tokens=16"], capture_output=True, text=True, timeout=900,
                              cwd=tmp_path, env={**os.environ, **env})

    first = run(tmp_path / "first", 1)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "first").rename(tmp_path / "renamed")
    p = run(tmp_path / "renamed", 2)
    one_line_refusal(p, "belongs to run 'first', not 'renamed'", "RLBOOST_RUN_ID=first")
    p = run(tmp_path / "renamed", 2, RLBOOST_RUN_ID="first")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "renamed/report.json").read_text())
    assert rep["steps"] == 2 and rep["resumes"] == 1


@pytest.mark.parametrize("override, needle", [
    ("cluster.trace=no-such-trace.csv", "cluster.trace = no-such-trace.csv: data file not found"),
    ("task.name=gsm8k", "task.name = gsm8k: data file not found"),
    ("model.path=no-such-model", "model.path: the model directory not found"),
    # issue 57 (a new user's residue): a replay window the trace does not have was found after the model loaded and
    # the held-out evaluation ran
    ("cluster.min_removals=1000", "cluster.trace spot_traces/bamboo/p3-trace.csv: no 2560 s window"),
])
def test_input_files_are_checked_before_anything_heavy_starts(tmp_path, override, needle):
    """Regression (issue 50): a missing trace or data file was reported after 8–13 s of model load and held-out
    evaluation. Every input file is checked first: the refusal comes before the run directory holds a config or any
    log line of a model load or an evaluation."""
    out = tmp_path / "out"
    p = cli("run", "--config", LOCAL, "--out", str(out), "--no-progress", "--set", override,
            "--set", f"data.dir={tmp_path}", cwd=tmp_path)
    one_line_refusal(p, needle)
    assert not (out / "config.json").exists() and "held-out reward" not in p.stderr and '"msg": "model ' not in p.stderr


def _without_root_bypass() -> list[str]:
    """A command prefix that makes file permissions bind (root reads any file: its DAC override is dropped)."""
    if os.geteuid() != 0:
        return []
    import shutil

    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permissions cannot be made to bind")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


def test_an_existing_file_that_cannot_be_read_is_not_reported_as_not_found(tmp_path):
    """Regression (issue 50): an unreadable config (or data file, or model directory) was reported "not found",
    sending the user looking for a file that is there."""
    from rlboost_hpc.paths import unreadable

    conf = tmp_path / "run.toml"
    conf.write_text("[trainer]\nsteps = 1\n")
    conf.chmod(0)
    p = subprocess.run([*_without_root_bypass(), sys.executable, "-m", "rlboost_hpc.cli", "run", "--config",
                        str(conf), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    one_line_refusal(p, f"config file {conf} exists but cannot be read (permission denied)")
    assert "not found" not in p.stderr
    assert unreadable(tmp_path) == "is a directory, not a file" and unreadable(conf, directory=True) == \
        "is not a directory" and unreadable(tmp_path / "nope") == "not found"
