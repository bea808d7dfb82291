"""Control-plane cost against the number of rollout instances N, on emulated instances (issue 29, items 4 and 9).

Each point is one real ``rlboost-hpc run`` of the demo (stories260K trainer, manager process, weight server with
delta and relay, the local cluster replaying the p3 spot trace with preemptions) whose N preemptible instances are
*emulated* (``rollout.engine = "emulated"``: the 8B profile's timing on 2 H100s, here 4× slower, no compute; see
``rlboost_hpc/rollout/engines/emulated.py``), hosted N/4 (at most 16) to a worker process
(``cluster.instances_per_worker``). The
step grows with N (N/2 prompts × 8 responses, Θ = 4) so every instance has work; the per-token figures are what
must stay flat.

While a run goes, its manager's Prometheus endpoint is scraped every 0.5 s: its own process CPU seconds and
resident memory (``process_*``), ``rlboost_tokens_received_total``, and the scrape's size and time; worker
processes' resident memory is sampled with psutil. Printed per N: manager CPU-seconds per 1M tokens received and
per step, messages (received + sent by the manager, every kind) per token, manager peak RSS, a worker process's
peak RSS per instance, scrape bytes and time, journal and event-log bytes per step, lost / duplicated /
off-version, and ``late_x``: how late the emulated instances ran against their profile (the report's
``emulated_late_ratio``, wall time ÷ the profile's; a row past 1.2 is marked "not the profile": on that host the
timings are the host's, not the modelled engine's); then each cost's growth exponent in N (log-log slope between the
smallest and the largest N).

Liveness (issue 29 item 8): per N, the silences longer than two heartbeats the manager measured
(``rlboost_instance_silence_seconds``: how many, the bucket bound of the 99th percentile and of the longest) —
what ``manager.heartbeat_timeout_s`` must exceed on that host. With ``--vanish S``, once step 2 starts one worker
process (its K instances) is stopped with SIGSTOP — a node that vanished without closing its connections — and
killed S seconds later; printed: responses handed to it after its last message
(``rlboost_responses_assigned_to_vanished_total``). ``--silence`` runs each N twice, with
``manager.dispatch_silence_s`` at its default and at 10^9 s (the rule off), interleaved.

Weight size S (issue 29 items 2 and 4): ``--weight-gb 0.25 1`` runs each S with each ``--pullers`` N (default 8 and
16) and the *emulated trainer* (``trainer.backend = "emulated"``: an S-byte bf16 weight set, 3 % of its elements
changed per step, the profile's training time per token; no checkpoints), so every version is S real bytes
published, delta-encoded, relayed, pulled, verified and held by every instance. Printed per (S, N):
SetVersion → every instance serving (first / median / last over the instances live at the SetVersion, median over
the updated versions 1…; the manager's ``version_serving`` in ``metrics.jsonl``), trainer egress per version ÷ S
(``weight_trainer_bytes_served``; it includes the replacements' pulls after preemptions), the trainer's share of all
bytes instances received (the rest came from relay peers), bytes pulled per instance per version ÷ S, the mean full
pull (the pulls that moved the whole version — first pulls, with other instances pulling at once through the relay
tree — the manager's ``weight_full_pull_seconds_mean``: transfer and verify) ÷ one raw loopback TCP copy of S bytes
into a warm buffer (``bench_weights.raw_once``, measured here first), and the peak RSS of the trainer's
process (trainer, weight server), of the manager, and of a worker process per instance (÷ S: a holder's memory is
versions kept × S plus a constant).

A point whose memory (≈ 1.35 S per instance + 4.8 S for the trainer's process) would not fit the machine is skipped
and said so. What it does not measure: rollout jobs on Slurm (the scavenger's own Slurm cost at 64 nodes and 128
jobs: ``benchmarks/bench_slurm_scale.py``); on a 24 GiB machine S = 1 GB with 16 pullers and every S = 4 GB point
(≈ 42 GB at 4 pullers) — every instance holds its own copy, as on its own GPU.

Usage: python benchmarks/bench_scale.py [--n 4 16 64] [--steps 6] [--per-process 16] [--vanish 8] [--silence]
[--weight-gb 0.25 1 4 [--pullers 4 8 16]] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from rlboost_hpc.observe.run_report import late_label  # noqa: E402 - after the path of the benchmarks' helpers


def hosted(n: int, per_process: int) -> int:
    """Instances per worker process: at least 4 processes (the trace window needs slots to preempt), at most
    ``per_process`` instances each."""
    return max(1, min(per_process, n // 4))


def settings(n: int, steps: int, per_process: int) -> list[str]:
    return [f"trainer.steps={steps}", "rollout.engine='emulated'", "rollout.emulated.response_median=24",
            "rollout.emulated.time_scale=0.25", "rollout.emulated.load_bytes_per_s=1e12",
            f"cluster.max_workers={n}", f"cluster.instances_per_worker={hosted(n, per_process)}",
            "cluster.time_scale=320", "cluster.replay_s=8", "policy.cap=false",
            f"rollout.prompts_per_step={max(4, n // 2)}", "manager.pending_limit=4"]


def weight_settings(s_gb: float) -> list[str]:
    """The emulated trainer at S = ``s_gb`` × 1e9 bytes; no checkpoints (their write is not what is measured)."""
    return ["trainer.backend='emulated'", f"trainer.emulated.weight_bytes={int(s_gb * 1e9)}",
            "trainer.checkpoint_every=0"]


def loopback_copy_s(nbytes: int, reps: int = 3) -> float:
    """Median seconds of one raw loopback TCP copy of ``nbytes`` into a warm (faulted-in) buffer."""
    import torch
    from bench_weights import RawSender, raw_once
    src = torch.ones(nbytes, dtype=torch.uint8)
    warm = torch.ones(nbytes, dtype=torch.uint8)
    sender = RawSender(memoryview(src.numpy()))
    try:
        times = sorted(raw_once(sender.port, nbytes, warm) for _ in range(reps))
    finally:
        sender.close()
    return times[len(times) // 2]


def weight_figures(out: Path, rep: dict, n: int, s_bytes: int) -> dict:
    """What the S dimension prints, from one run's directory: SetVersion → serving of the updated versions (each
    ``metrics.jsonl`` record carries the version it replaced), egress and pulled bytes ÷ S, first pulls."""
    serving = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        vs = json.loads(line).get("version_serving") or {}
        if vs.get("version", -1) >= 1 and vs.get("served", 0) > 0:
            serving.append(vs)
    versions = rep["steps"] + 1  # version 0 is the initial one

    def med(key: str) -> float:
        v = sorted(x[key] for x in serving)
        return v[len(v) // 2] if v else float("nan")

    return {"serving_first_s": med("first_s"), "serving_median_s": med("median_s"), "serving_last_s": med("last_s"),
            "serving_n": f"{sum(x['served'] for x in serving)}/{sum(x['live'] for x in serving)}",
            "egress_per_version_S": rep["weight_trainer_bytes_served"] / versions / s_bytes,
            "pulled_per_inst_version_S": rep["weight_pulled_bytes"] / (n * versions) / s_bytes,
            "trainer_share": rep["weight_trainer_bytes_served"] / max(1, rep["weight_pulled_bytes"]),
            "full_pull_s": rep["weight_full_pull_seconds_mean"]}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


class Sampler(threading.Thread):
    """Scrapes the run's manager endpoint and samples the worker processes until ``stop`` is set."""

    def __init__(self, out: Path, proc: subprocess.Popen, vanish_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.out, self.proc, self.stop = out, proc, threading.Event()
        self.vanish_s, self.vanished_at = vanish_s, None
        self.last: dict[str, float] = {}
        self.text = ""
        self.scrape_bytes = self.scrape_ms_max = 0.0
        self.scrape_ms: list[float] = []
        self.worker_rss_max = self.trainer_rss_max = 0

    def _url(self) -> str | None:
        try:
            target = json.loads((self.out / "prometheus/rlboost-manager.json").read_text())[0]["targets"][0]
            return f"http://{target}/metrics"
        except (OSError, ValueError, IndexError, KeyError):
            return None

    def run(self) -> None:
        while not self.stop.is_set():
            url = self._url()
            if url:
                try:
                    t0 = time.perf_counter()
                    body = urllib.request.urlopen(url, timeout=2).read()
                    ms = 1e3 * (time.perf_counter() - t0)
                    text = self.text = body.decode()
                    self.scrape_ms.append(ms)
                    if self.vanish_s and self.vanished_at is None and _metric(text, "rlboost_step") >= 2:
                        self._vanish()
                    self.scrape_bytes = max(self.scrape_bytes, len(body))
                    self.last = {"cpu_s": _metric(text, "process_cpu_seconds_total"),
                                 "rss": _metric(text, "process_resident_memory_bytes"),
                                 "tokens": _metric(text, "rlboost_tokens_received_total"),
                                 "msgs": _metric(text, "rlboost_messages_received_total")
                                 + _metric(text, "rlboost_messages_sent_total")}
                    self.last["rss_max"] = max(self.last["rss"], getattr(self, "_rss_max", 0.0))
                    self._rss_max = self.last["rss_max"]
                except OSError:
                    pass
            try:
                root = psutil.Process(self.proc.pid)
                self.trainer_rss_max = max(self.trainer_rss_max, root.memory_info().rss)
                for child in root.children(recursive=True):
                    if "rlboost_hpc.rollout.worker" in " ".join(child.cmdline()):
                        self.worker_rss_max = max(self.worker_rss_max, child.memory_info().rss)
            except psutil.Error:
                pass
            self.stop.wait(0.5)

    def _vanish(self) -> None:
        """SIGSTOP one worker process now (no connection closes), SIGKILL it ``vanish_s`` later."""
        workers = [c for c in psutil.Process(self.proc.pid).children(recursive=True)
                   if "rlboost_hpc.rollout.worker" in " ".join(c.cmdline())]
        if not workers:
            return
        victim = random.Random(0).choice(sorted(workers, key=lambda c: c.pid))
        os.kill(victim.pid, signal.SIGSTOP)
        self.vanished_at = time.monotonic()
        threading.Timer(self.vanish_s, lambda: _kill(victim.pid)).start()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def silences(text: str) -> dict:
    """The manager's silence histogram from a scrape: count, and the bucket bounds of the p99 and the longest."""
    buckets = [(float(le) if le != "+Inf" else math.inf, float(v)) for le, v in re.findall(
        r'^rlboost_instance_silence_seconds_bucket{le="([^"]+)",run="[^"]*"} ([0-9.e+]+)$', text, re.M)]
    buckets.sort()
    count = buckets[-1][1] if buckets else 0.0
    p99 = next((le for le, v in buckets if v >= 0.99 * count), math.nan) if count else 0.0
    longest = next((le for le, v in buckets if v >= count), math.nan) if count else 0.0
    return {"silences": int(count), "silence_p99_le": p99, "silence_max_le": longest}


def one_point(n: int, steps: int, per_process: int, extra: list[str], out: Path, vanish_s: float = 0.0,
              s_gb: float = 0.0) -> dict:
    """One ``rlboost-hpc run`` with N emulated instances (and, when ``s_gb`` > 0, the emulated trainer at that S);
    its row of figures (module docstring)."""
    if s_gb:
        extra = weight_settings(s_gb) + extra
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"),
            "--out", str(out), "--no-progress"]
    for o in settings(n, steps, per_process) + extra:
        args += ["--set", o]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    sampler = Sampler(out, proc, vanish_s)
    sampler.start()
    _, err = proc.communicate()
    sampler.stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"N={n}: the run exited {proc.returncode}:\n{err[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    last = sampler.last
    tokens = last.get("tokens", float("nan"))
    k = hosted(n, per_process)
    scr = sorted(sampler.scrape_ms)
    return {
        "N": n, "K": k, "wall_s": time.monotonic() - t0, "steps": rep["steps"], "tokens": tokens,
        "mgr_cpu_s": last.get("cpu_s", float("nan")),
        "mgr_cpu_per_Mtok": last.get("cpu_s", float("nan")) / tokens * 1e6,
        "mgr_cpu_per_step": last.get("cpu_s", float("nan")) / rep["steps"],
        "msgs_per_tok": last.get("msgs", float("nan")) / tokens,
        "mgr_rss_MiB": last.get("rss_max", float("nan")) / 2**20,
        "worker_rss_MiB_per_inst": sampler.worker_rss_max / k / 2**20,
        "scrape_KiB": sampler.scrape_bytes / 1024, "scrape_ms_p50": scr[len(scr) // 2] if scr else float("nan"),
        "scrape_ms_max": scr[-1] if scr else float("nan"),
        "journal_B_per_step": (out / "manager-journal.jsonl").stat().st_size / rep["steps"],
        "events_B_per_step": (out / "events.jsonl").stat().st_size / rep["steps"],
        "preemptions": rep["preemptions"], "migrated": rep["responses_migrated"],
        "suspected": rep["instances_suspected"], "late_x": late_label(rep.get("emulated_late_ratio")),
        "lost/dup/off": f"{rep['responses_lost']}/{rep['responses_duplicated']}/{rep['tokens_trained_off_version']}",
        "silence_rule": "off" if any("dispatch_silence_s" in o for o in extra) else "on",
        "to_vanished": int(_metric(sampler.text, "rlboost_responses_assigned_to_vanished_total")),
        "step_s": rep["train_wall_s"] / rep["steps"],
        "S_GB": s_gb, "trainer_rss_GB": sampler.trainer_rss_max / 1e9,
        "mgr_rss_GB": last.get("rss_max", float("nan")) / 1e9,
        "worker_rss_GB_per_inst": sampler.worker_rss_max / k / 1e9,
        **silences(sampler.text),
        **(weight_figures(out, rep, n, int(s_gb * 1e9)) if s_gb else {}),
    }


#: Peak resident memory per S measured at S = 1 GB (this benchmark, N = 4 and 8), with margin: an instance holds one
#: version (a delta pull rewrites it in place) plus its process's share of ~0.3 GB; the trainer's process holds the
#: backend's weights, the weight server's two kept versions and the one being published, plus ~0.7 GB.
HOLDER_S_PER_INSTANCE, TRAINER_S = 1.35, 4.8


def weight_dimension(a: argparse.Namespace, tmp: Path) -> None:
    """Every (S, N) of ``--weight-gb`` × ``--pullers``; one table, with each S's raw loopback copy."""
    rows, avail_gb = [], psutil.virtual_memory().available / 1e9
    for s_gb in a.weight_gb:
        copy_s = loopback_copy_s(int(s_gb * 1e9))
        for n in a.pullers:
            need_gb = s_gb * (HOLDER_S_PER_INSTANCE * n + TRAINER_S) + 1.0
            if need_gb > 0.9 * avail_gb:
                print(f"S={s_gb} GB, N={n}: skipped, needs ≈ {need_gb:.0f} GB of the {avail_gb:.0f} GB available",
                      file=sys.stderr, flush=True)
                continue
            r = one_point(n, a.steps, a.per_process, a.set, tmp / f"s{s_gb}-n{n}", s_gb=s_gb)
            r["loopback_copy_s"], r["full_pull_per_copy"] = copy_s, r["full_pull_s"] / copy_s
            rows.append(r)
            print(f"S={s_gb} GB, N={n}: done in {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    cols = [("S_GB", "{}"), ("N", "{}"), ("steps", "{}"), ("step_s", "{:.2f}"), ("serving_first_s", "{:.2f}"),
            ("serving_median_s", "{:.2f}"), ("serving_last_s", "{:.2f}"), ("serving_n", "{}"),
            ("egress_per_version_S", "{:.3f}"), ("pulled_per_inst_version_S", "{:.3f}"),
            ("trainer_share", "{:.2f}"), ("loopback_copy_s", "{:.2f}"), ("full_pull_s", "{:.2f}"),
            ("full_pull_per_copy", "{:.1f}"),
            ("trainer_rss_GB", "{:.2f}"), ("mgr_rss_GB", "{:.3f}"), ("worker_rss_GB_per_inst", "{:.2f}"),
            ("lost/dup/off", "{}")]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(f.format(r[c]) for c, f in cols) + " |")
    for n in a.pullers:
        pts = [r for r in rows if r["N"] == n]
        if len(pts) >= 2:
            lo, hi = pts[0], pts[-1]
            print(f"\ngrowth exponent in S at N = {n} (S = {lo['S_GB']} → {hi['S_GB']} GB; 1 = linear):")
            for c in ("serving_last_s", "full_pull_s", "trainer_rss_GB", "worker_rss_GB_per_inst", "step_s"):
                if lo[c] > 0 and hi[c] > 0:
                    print(f"  {c:26} {math.log(hi[c] / lo[c]) / math.log(hi['S_GB'] / lo['S_GB']):+.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16, 64], help="instance counts N")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--per-process", type=int, default=16, help="emulated instances per worker process")
    ap.add_argument("--vanish", type=float, default=0.0, metavar="S",
                    help="SIGSTOP one worker process at step 2, SIGKILL it S seconds later (0: never)")
    ap.add_argument("--silence", action="store_true", help="each N also with manager.dispatch_silence_s = 1e9")
    ap.add_argument("--weight-gb", type=float, nargs="+", default=[], metavar="S",
                    help="weight sizes S (GB) with the emulated trainer, each with every --pullers N (instead of --n)")
    ap.add_argument("--pullers", type=int, nargs="+", default=[8, 16], help="instance counts N of the S dimension")
    ap.add_argument("--set", action="append", default=[], help="more config overrides (key=value)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    if a.weight_gb:
        return weight_dimension(a, tmp)
    rows = []
    arms = [[], ["manager.dispatch_silence_s=1e9"]] if a.silence else [[]]
    for n in a.n:
        for j, arm in enumerate(arms):
            rows.append(one_point(n, a.steps, a.per_process, a.set + arm, tmp / f"n{n}-{j}", a.vanish))
            print(f"N={n}: done in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    cols = [("N", "{}"), ("K", "{}"), ("steps", "{}"), ("tokens", "{:,.0f}"), ("mgr_cpu_s", "{:.2f}"),
            ("mgr_cpu_per_Mtok", "{:.1f}"), ("mgr_cpu_per_step", "{:.3f}"), ("msgs_per_tok", "{:.3f}"),
            ("mgr_rss_MiB", "{:.0f}"),
            ("worker_rss_MiB_per_inst", "{:.1f}"), ("scrape_KiB", "{:.1f}"), ("scrape_ms_p50", "{:.1f}"),
            ("scrape_ms_max", "{:.1f}"), ("journal_B_per_step", "{:.0f}"), ("events_B_per_step", "{:.0f}"),
            ("preemptions", "{}"), ("migrated", "{}"), ("suspected", "{}"), ("lost/dup/off", "{}"), ("late_x", "{}")]
    live = [("N", "{}"), ("silence_rule", "{}"), ("step_s", "{:.2f}"), ("silences", "{}"),
            ("silence_p99_le", "{}"), ("silence_max_le", "{}"), ("suspected", "{}"), ("to_vanished", "{}"),
            ("lost/dup/off", "{}"), ("late_x", "{}")]
    for table in (cols, live):
        print("| " + " | ".join(c for c, _ in table) + " |")
        print("|" + " --- |" * len(table))
        for r in rows:
            print("| " + " | ".join(f.format(r[c]) for c, f in table) + " |")
        print()
    rows = [r for r in rows if r["silence_rule"] == "on"]
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        print(f"\ngrowth exponent in N (log-log slope, N = {lo['N']} → {hi['N']}; 0 = flat, 1 = linear):")
        for c in ("mgr_cpu_per_Mtok", "mgr_cpu_per_step", "msgs_per_tok", "mgr_rss_MiB", "worker_rss_MiB_per_inst",
                  "scrape_KiB",
                  "scrape_ms_p50", "journal_B_per_step", "events_B_per_step"):
            if lo[c] > 0 and hi[c] > 0:
                print(f"  {c:26} {math.log(hi[c] / lo[c]) / math.log(hi['N'] / lo['N']):+.2f}")
        ratio = hi["mgr_cpu_per_Mtok"] / lo["mgr_cpu_per_Mtok"]
        print(f"\nmanager CPU per token, N = {hi['N']} ÷ N = {lo['N']}: {ratio:.2f}×")


if __name__ == "__main__":
    main()
