"""A real Prometheus server for the tests that check what a dashboard shows (Debian's ``prometheus``, installed on
first use like the local Slurm cluster's packages; root only).

:class:`Prometheus` scrapes every second the targets of file-based service discovery files — the run directory's
``prometheus/*.json``, as docs/observability.md tells users to point ``file_sd_configs`` at — and answers PromQL through its HTTP
API (:meth:`Prometheus.query`), so a test evaluates the Grafana dashboard's own expressions.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path


def ensure_prometheus() -> str:
    """The ``prometheus`` binary, installed from Debian's packages when missing. Raises RuntimeError when apt fails."""
    found = shutil.which("prometheus")
    if found:
        return found
    p = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"], capture_output=True,
                       text=True, timeout=600, env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if p.returncode != 0 or not shutil.which("prometheus"):
        raise RuntimeError(f"apt-get install prometheus failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return shutil.which("prometheus") or "prometheus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus process scraping ``sd_files`` (a glob) every second; a context manager (stopped on exit)."""

    def __init__(self, workdir: Path, sd_files: str) -> None:
        self.workdir, self.port = Path(workdir), _free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "prometheus.yml").write_text(json.dumps({  # (JSON is YAML)
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rlboost", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "file_sd_configs": [{"files": [sd_files], "refresh_interval": "1s"}]}]}))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        self.log = open(self.workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [ensure_prometheus(), f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).read()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__()
                    raise RuntimeError(f"prometheus did not start: {(self.workdir / 'prometheus.log').read_text()}")
                time.sleep(0.3)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def _get(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now: ``[{"metric": {labels}, "value": [ts, "v"]}, …]``."""
        return self._get("/api/v1/query", query=expr)["result"]

    def targets_up(self) -> dict[str, bool]:
        """``job`` label of every active target → whether its last scrape succeeded."""
        return {t["labels"].get("job", "?"): t["health"] == "up" for t in self._get("/api/v1/targets")["activeTargets"]}
