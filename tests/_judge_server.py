"""A small real HTTP reward server for tests (issue 48): an OpenAI-compatible LLM judge and a raw scoring route.

``python tests/_judge_server.py [--fail-first N] [--key-env VAR]`` binds 127.0.0.1 on a free port, prints
``PORT <n>`` and serves until killed:

* ``POST /v1/chat/completions`` — the judge: the reply is ``Score: 1`` when the text after the last ``Answer:`` in the
  user message contains a double quote (the stories demo's reward), else ``Score: 0``;
* ``POST /score`` — the scoring route: ``{"rewards": [...]}``, 1.0 per completion holding a double quote;
* ``GET /stats`` — requests served and refused, and the requests that carried an ``Authorization`` header, as JSON.

With ``--key-env VAR`` every POST must carry ``Authorization: Bearer $VAR`` (else 401); with ``--fail-first N`` the
first N POSTs answer 503 (the client's retries must absorb them). A hostile or broken server (issue 57):
``--redirect-to URL`` answers every POST with ``302 Location: URL`` + the path (urllib's default would follow it
as a GET, the ``Authorization`` header with it); ``--reply TEXT`` is the judge's reply
whatever it grades; ``--scores JSON`` is the scoring route's answer whatever it scores.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"served": 0, "refused": 0, "failed_on_purpose": 0, "authorized_requests": 0}
LOCK = threading.Lock()


def _reward(text: str) -> float:
    return 1.0 if '"' in text else 0.0


class Handler(BaseHTTPRequestHandler):
    fail_first = 0
    key: str | None = None
    redirect_to = ""
    reply: str | None = None
    scores: list | None = None

    def log_message(self, *a) -> None:  # quiet
        pass

    def _json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        with LOCK:
            STATE["authorized_requests"] += "Authorization" in self.headers
        self._json(200, STATE)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with LOCK:
            STATE["authorized_requests"] += "Authorization" in self.headers
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        with LOCK:
            if STATE["failed_on_purpose"] < self.fail_first:
                STATE["failed_on_purpose"] += 1
                return self._json(503, {"error": "warming up"})
            if self.key is not None and self.headers.get("Authorization") != f"Bearer {self.key}":
                STATE["refused"] += 1
                return self._json(401, {"error": "bad key"})
            STATE["served"] += 1
        if self.path == "/score":
            if self.scores is not None:
                return self._json(200, {"rewards": self.scores})
            return self._json(200, {"rewards": [_reward(c) for c in body["completions"]]})
        if self.path == "/v1/chat/completions":
            content = body["messages"][-1]["content"]
            answer = content.rsplit("Answer:", 1)[-1].rsplit("Reply with", 1)[0]
            reply = self.reply if self.reply is not None else f"Score: {int(_reward(answer))}"
            return self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
        self._json(404, {"error": self.path})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--key-env", default=None)
    p.add_argument("--redirect-to", default="")
    p.add_argument("--reply", default=None)
    p.add_argument("--scores", default=None)
    a = p.parse_args()
    Handler.redirect_to, Handler.reply = a.redirect_to, a.reply
    Handler.scores = json.loads(a.scores) if a.scores else None
    Handler.fail_first = a.fail_first
    Handler.key = os.environ[a.key_env] if a.key_env else None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
