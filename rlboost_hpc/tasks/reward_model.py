"""A reward model or an LLM judge behind HTTP, called from the reward processes (``task.rewards.model``).

Two kinds of endpoint:

* ``score`` — a raw scoring route that scores a whole group in one request: ``POST url`` with the JSON body its
  server reads (``body``): ``openrlhf`` — ``{"prompts": [...], "completions": [...], "query": [prompt + completion,
  ...], "labels": [gold or null, ...]}`` (what OpenRLHF's ``--remote_rm_url`` servers, ``/get_reward``, read);
  ``sglang`` — ``{"text": [prompt + completion, ...]}`` (SGLang's ``/classify`` of a reward model served with
  ``--is-embedding``). The answer is ``{"rewards": [...]}``, ``{"scores": [...]}``, a bare list of numbers, or
  SGLang's classify shape (a list of ``{"embedding": [score, ...]}``).
* ``judge`` — an OpenAI-compatible chat endpoint (``url`` is its ``/v1/chat/completions``) used as an LLM judge: one
  request per completion with ``prompt_template`` filled from ``{prompt}``, ``{completion}`` and the row's columns,
  ``temperature`` 0; the judge's verdict is the *last* match of ``score_pattern`` in its reply (its first group is the
  number, an exponent included: ``1e-1`` is 0.1), on the declared scale ``[score_min, score_max]`` mapped to
  ``[0, 1]``.

Trust (nothing from outside is believed): a request goes only to ``url`` — a redirect is not followed (the API key
and the rewards would come from a host nobody configured) and is a failed call naming where it pointed; a value
outside the declared scale (a judge's ``85`` on a 0–1 scale, a route's ``1e9``), a non-finite one or a reply with no
verdict is a failed call, counted against the reward model, never a reward.

Invariants: at most ``concurrency`` requests in flight per group; every request has a deadline of ``timeout_s``; a
connection error, a deadline, HTTP 429 or 5xx is retried ``retries`` times with exponential backoff and full jitter;
any other HTTP status, an unparsable answer or retries exhausted raise :class:`RewardModelError` (the reward pool
counts it against the reward model, as it counts a failing reward function). The API key comes from the environment
variable ``api_key_env`` (``Authorization: Bearer …``), never from the config; it is read in the process that calls.
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from rlboost_hpc.config_task import RewardModelCfg

__all__ = ["RewardModelClient", "RewardModelError"]

_BACKOFF_S = 0.2


class RewardModelError(RuntimeError):
    """A reward-model request failed for good (retries exhausted, a client error, an unparsable answer)."""


def _prompt_text(prompt: Any) -> str:
    if prompt.messages is not None:
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt.messages)
    return prompt.text


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse every redirect: the request (and its ``Authorization``) goes to the configured URL only."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise RewardModelError(f"{req.full_url} redirected (HTTP {code}) to {newurl}: not followed — the API key "
                               "and the rewards go to and come from the configured task.rewards.model.url only")


_OPENER = urllib.request.build_opener(_NoRedirect)


def _scores_of(answer: Any, n: int) -> list[float]:
    if isinstance(answer, dict):
        for k in ("rewards", "scores", "score", "reward"):
            if k in answer:
                answer = answer[k]
                break
    if isinstance(answer, list) and answer and isinstance(answer[0], dict) and "embedding" in answer[0]:
        answer = [a["embedding"][0] for a in answer]  # SGLang's classify route
    if not isinstance(answer, list) or len(answer) != n:
        raise RewardModelError(f"the scoring route answered {str(answer)[:120]!r}, not {n} scores")
    return list(answer)


@dataclass(frozen=True)
class RewardModelClient:
    """The client of one endpoint (see the module docstring), configured by ``cfg`` (``task.rewards.model``: the one
    home of its fields and defaults). Picklable: each reward process builds its own connections."""

    cfg: RewardModelCfg

    @property
    def url(self) -> str:
        return self.cfg.url

    def call_budget_s(self) -> float:
        """The longest one group's scoring can take (every request's tries and backoffs, serialised by the
        concurrency bound): the reward pool's deadline for it."""
        waves = 1 if self.cfg.kind == "score" else 8  # a group larger than 8 × concurrency waits longer; bounded here
        return waves * (self.cfg.retries + 1) * (self.cfg.timeout_s + _BACKOFF_S * 2 ** self.cfg.retries) + 1.0

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise RewardModelError(f"the environment variable {self.cfg.api_key_env} "
                                       "(task.rewards.model.api_key_env) is not set")
            h["Authorization"] = f"Bearer {key}"
        return h

    def _post(self, body: dict) -> Any:
        """POST ``body`` with retries (see the module docstring); the decoded JSON answer."""
        data, headers = json.dumps(body).encode(), self._headers()
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(random.uniform(0, _BACKOFF_S * 2 ** attempt))  # exponential backoff, full jitter
            req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with _OPENER.open(req, timeout=self.cfg.timeout_s) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                if e.code != 429 and e.code < 500:
                    raise RewardModelError(f"{self.url} answered HTTP {e.code}: {e.read()[:200]!r}") from None
                last = f"HTTP {e.code}"
            except (socket.timeout, TimeoutError):
                last = f"no answer within {self.cfg.timeout_s:g} s"
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                last = f"connection failed ({getattr(e, 'reason', e)})"
            except json.JSONDecodeError:
                raise RewardModelError(f"{self.url} answered something that is not JSON") from None
        raise RewardModelError(f"{self.url}: {last} after {self.cfg.retries + 1} tries")

    def _judge_one(self, prompt: Any, completion: str) -> float:
        fields = {k: v for k, v in prompt.meta.items() if isinstance(k, str)}
        content = self.cfg.prompt_template.format_map({**fields, "prompt": _prompt_text(prompt),
                                                       "completion": completion})
        answer = self._post({"model": self.cfg.model, "messages": [{"role": "user", "content": content}],
                             "temperature": 0, "max_tokens": self.cfg.max_tokens})
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardModelError(f"{self.url} answered no choices[0].message.content: {str(answer)[:120]!r}") from None
        found = list(re.finditer(self.cfg.score_pattern, text or ""))
        if not found:
            raise RewardModelError(f"the judge's reply has no score matching {self.cfg.score_pattern!r}: "
                                   f"{text[:120]!r}")
        verdict = self._in_scale(found[-1].group(1), "the judge's verdict")  # the last: the judge's own
        return (verdict - self.cfg.score_min) / (self.cfg.score_max - self.cfg.score_min)

    def _in_scale(self, value: Any, what: str) -> float:
        """``value`` as a float within the declared ``[score_min, score_max]``, else :class:`RewardModelError`."""
        lo, hi = self.cfg.score_min, self.cfg.score_max
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise RewardModelError(f"{what} {str(value)[:40]!r} is not a number") from None
        if not (lo <= v <= hi):  # (NaN fails too)
            raise RewardModelError(f"{what} {v:g} is outside the declared scale [{lo:g}, {hi:g}] "
                                   "(task.rewards.model.score_min / score_max): a failed call, not a reward")
        return v

    def score(self, prompt: Any, completions: Sequence[str]) -> list[float]:
        """Scores of ``completions`` of ``prompt`` (a :class:`~rlboost_hpc.tasks.base.Prompt`), in order.

        Raises:
            RewardModelError: see the module docstring.
        """
        if self.cfg.kind == "score":
            p = _prompt_text(prompt)
            gold = prompt.meta.get("answer", prompt.meta.get("ground_truth"))
            query = [p + c for c in completions]
            body = {"text": query} if self.cfg.body == "sglang" else {
                "prompts": [p] * len(completions), "completions": list(completions), "query": query,
                "labels": [gold] * len(completions)}
            if self.cfg.model and self.cfg.body == "openrlhf":
                body["model"] = self.cfg.model
            scores = _scores_of(self._post(body), len(completions))
            return [self._in_scale(v, "the scoring route's score") for v in scores]
        with ThreadPoolExecutor(max_workers=max(1, min(self.cfg.concurrency, len(completions)))) as pool:
            return list(pool.map(lambda c: self._judge_one(prompt, c), completions))
