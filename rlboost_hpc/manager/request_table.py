"""The request table of the rollout manager: what happens to a response once it is dispatched — its token deltas
appended (the hot path: one ``Tokens`` frame carries many), an assistant turn ending in a tool call handed to the
environment and its observation appended (multi-turn trajectories), a finished response counted and passed on to
its GRPO group, a failed or released one requeued at the head of the queue (a migration).

The responses, their groups and the queue are the :class:`~rlboost_hpc.manager.request_book.RequestBook`'s. A
collaborator held by :class:`~rlboost_hpc.manager.core.ManagerCore` as ``core.table`` (the same single writer, pure:
no sockets, time from the core's injected clock); the invariants it keeps are the core's token-level ones: 1
(a delta of a version outside the request's window is rejected and its instance fenced), 2 (deltas from any
instance but the owner are dropped as late), 3 (a delta starts exactly at the response's current length), 5 (a
migrated response resumes within its budget) and 8 (trajectories: every turn and observation kept as token ids).
"""
from __future__ import annotations

import logging

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.restore import adopt
from rlboost_hpc.manager.state import ENV_PEER, Instance, Request, RequestState
from rlboost_hpc.protocol import messages as M

R = RequestState

log = logging.getLogger("rlboost.manager")


class RequestTable:
    """The response-facing handlers of the rollout manager (see the module docstring): a collaborator of ``core`` (a
    :class:`~rlboost_hpc.manager.core.ManagerCore`), which holds the state owners it works on — the fleet, the
    request book, the lineage, the counters — and calls it for the messages of its kind (``_on_<Message>``, found by
    the core's dispatch table). It keeps no state of its own.
    """

    def __init__(self, core) -> None:  # (a ManagerCore: not imported, it imports this module)
        self.core = core

    def requeue(self, rid: str, inst: Instance, why: str) -> None:
        """Take ``rid`` back from ``inst`` and put it at the head of the queue (a migration)."""
        req = self.core.book.get(rid)
        inst.inflight.discard(rid)
        inst.releasing.discard(rid)
        self.core.note_activity(inst)
        if req is None or req.state != R.RUNNING or req.instance != inst.key:
            return
        self.core.book.first_in_line(req)
        req.migrations += 1
        self.core.log_work(W.Migrated(rid))
        self.core.counters.responses_migrated += 1
        if req.n:
            out = self.core.counters.migrations_by_engine["out_of"]
            out[inst.engine] = out.get(inst.engine, 0) + 1
            t = str(req.turn)
            self.core.counters.migrations_by_turn[t] = self.core.counters.migrations_by_turn.get(t, 0) + 1
            # what restarting the interrupted turn / the whole trajectory would regenerate (the benchmark's
            # alternatives to resuming at the token)
            self.core.counters.tokens_in_interrupted_turns += req.n - req.turn_start
            self.core.counters.assistant_tokens_in_interrupted_trajectories += req.n - req.observation_tokens()
        self.core.counters.tokens_migrated += req.n
        log.debug("migrating %s (%d tokens) off %s: %s", rid, req.n, inst.key, why)

    def _on_Tokens(self, peer: bytes, inst: Instance | None, msg: M.Tokens) -> None:
        """Append each delta to its request (the hot path: one frame carries many deltas)."""
        counts = msg.counts
        total = sum(counts)
        self.core.counters.tokens_received += total
        self.core.dropped = dropped = []  # responses whose delta was not applied (the work log's Frame.dropped)
        if inst is None:
            self.core.counters.late_tokens += total
            dropped += msg.rids
            return self.core.registry.unknown(peer, "tokens")
        inst.tokens_received += total
        if inst.kind == "preemptible":
            self.core.counters.tokens_received_preemptible += total
        requests, key, latest = self.core.book.requests, inst.key, self.core.lineage.latest.number
        ids, lps = memoryview(msg.ids), memoryview(msg.logprobs)
        lo = late = 0
        for i, (rid, off, cnt, ver, fin) in enumerate(zip(msg.rids, msg.offsets, counts, msg.versions, msg.finish)):
            hi = lo + 4 * cnt
            req = requests.get(rid)
            if req is not None and req.instance != key and self.core.held:  # (after a restart: held for its instance)
                skip = adopt(self.core, req, inst, off, ids[lo:hi])  # tokens of the delta the work log already holds
                if skip:
                    lo, off, cnt, late = lo + 4 * skip, off + skip, cnt - skip, late + skip
            if req is None or req.instance != key or req.state != R.RUNNING:
                late += cnt
                dropped.append(rid)
            elif not req.version <= ver <= latest:  # (k = 0: ver == req.version == latest)
                self.core.counters.off_version_tokens_rejected += cnt
                self.core.registry.fence(inst, f"sent {cnt} tokens of version {ver} for {rid} of version {req.version}"
                                         + (f"..{latest}" if self.core.settings.max_staleness else ""))
                dropped += msg.rids[i:]
                break
            elif off + cnt > req.max_new_tokens or off + cnt > req.max_trajectory_tokens - req.turn_start:
                # (= past req.turn_budget(), spelt out: a method call per delta costs ~15 % of this loop)
                self.core.registry.fence(inst, f"delta for {rid} at {off}+{cnt} exceeds the budget {req.turn_budget()}")
                dropped += msg.rids[i:]
                break
            elif req.turn_start + off != req.n:  # (offsets count from the turn's start) frames lost with a
                late += cnt  # connection: drop the rest, resume from what arrived once the instance released it
                dropped.append(rid)
                # (Released requeues it; never racing a re-dispatch)
                if rid not in inst.releasing:
                    self.core.counters.deltas_out_of_order += 1
                    inst.releasing.add(rid)
                    self.core.send(inst.peer, M.Release(rids=[rid]))
            else:
                req.ids += ids[lo:hi]
                req.logprobs += lps[lo:hi]
                req.n += cnt
                runs = req.runs
                if runs and runs[-2] == ver:
                    runs[-1] += cnt
                else:
                    runs += (ver, cnt)
                if fin:
                    inst.inflight.discard(rid)
                    inst.releasing.discard(rid)
                    self.core.note_activity(inst)
                    self._turn_done(req, fin)
            lo = hi
        self.core.counters.late_tokens += late
        if msg.resent:  # it sent all it holds: nothing more to adopt from it, nothing unsent (manager/restore.py)
            inst.restored, inst.tokens_received, inst.tokens_generated = False, msg.generated, msg.generated
        self.core.step_account.accepted(key, inst.kind, total - late, self.core.clock())

    def _turn_done(self, req: Request, fin: int) -> None:
        """An assistant turn finished: a tool call — or, in a stateful environment's trajectory, every turn — goes
        to the environment (the trajectory waits, owned by no instance), anything else finishes the response."""
        self.core.counters.turns_completed += 1
        if req.env_row or (fin == M.FINISH_STOP and req.calls_tool()):
            req.move(R.ENVIRONMENT)
            self.core.log_work(W.ToolCall(req.rid))
            self.core.counters.environment_calls += 1
            self.core.send(ENV_PEER, req.env_call())
            return
        self.finish(req, req.end_reason(fin))

    def finish(self, req: Request, reason: str) -> None:
        """``req`` is done for ``reason`` (one of ``M.FINISH_REASONS``; truncations counted by cause)."""
        req.move(R.DONE, finish_reason=reason)
        self.core.log_work(W.Finished(req.rid, reason))
        if req.env_row:  # its environment may still hold it (no room left for the observation)
            self.core.send(ENV_PEER, M.EnvRelease([req.rid]))
        self.core.step_account.response_done(self.core.clock())
        if reason != "stop":
            by_cause = self.core.counters.responses_truncated_by_cause
            by_cause[reason] = by_cause.get(reason, 0) + 1
        self.core.trainer_calls.group_progress(req)

    def _on_EnvResult(self, peer: bytes, inst: Instance | None, msg: M.EnvResult) -> None:
        """The environment's observation for a trajectory's tool call: appended, and the next turn is queued
        first (it is the tail of its step); no room left for it and one more token finishes the trajectory."""
        if peer != ENV_PEER:
            return self.core.registry.unknown(peer, "environment result")
        req = self.core.book.get(msg.rid)
        if req is None or req.state != R.ENVIRONMENT or req.turn != msg.turn:
            self.core.counters.protocol_rejects += 1
            return
        self.core.counters.environment_seconds += msg.tool_s
        self.core.counters.environment_replays += msg.replayed > 0
        if msg.status != "ok":
            if msg.status == "timeout":
                self.core.counters.environment_timeouts += 1
            else:
                self.core.counters.environment_errors += 1
        if req.env_row:
            return self._environment_step(req, msg)
        if req.n + len(msg.obs_ids) // 4 >= req.max_trajectory_tokens or not msg.obs_ids:
            self.finish(req, "trajectory_budget" if msg.obs_ids else "environment_error")
            return
        self.core.counters.observation_tokens += len(msg.obs_ids) // 4
        req.append_observation(msg.obs_ids)
        self.core.log_work(W.Observation(req.rid, msg.obs_ids))
        self.core.book.first_in_line(req)

    def _environment_step(self, req: Request, msg: M.EnvResult) -> None:
        """A stateful environment's answer: its reward kept; ``done``, the last turn, no room for the observation or
        a failed step (``environment_error``) finish the trajectory, else the observation is appended and the next
        turn queued first. A replay that diverged fails the step (the trajectory is never trained on another
        history)."""
        if msg.status == "diverged":
            log.error("%s", msg.error)
            self.core.trainer_calls.fail_step(msg.error)
            return
        error = f"{msg.status}: {msg.error}" if msg.status != "ok" else ""
        req.env_step_done(msg.turn, msg.reward, error)
        k = len(msg.obs_ids) // 4
        end = ("environment_error" if error else "stop" if msg.done else "turn_cap" if req.turn + 1 >= req.max_turns
               else "trajectory_budget" if not k or req.n + k >= req.max_trajectory_tokens else "")
        self.core.log_work(W.Observation(req.rid, b"" if end else msg.obs_ids, msg.reward, error))
        if end:
            self.finish(req, end)
            return
        self.core.counters.observation_tokens += k
        req.append_observation(msg.obs_ids)
        self.core.book.first_in_line(req)

    def _on_RequestFailed(self, peer: bytes, inst: Instance | None, msg: M.RequestFailed) -> None:
        if inst is None:
            return self.core.registry.unknown(peer, "request-failed")
        self.core.counters.request_failures += 1
        req = self.core.book.get(msg.rid)
        log.warning("instance %s failed request %s: %s", inst.key, msg.rid, msg.error)
        if req is not None and req.instance == inst.key and req.state == R.RUNNING:
            self.requeue(msg.rid, inst, "engine failure")
            if req.attempts >= self.core.settings.max_attempts:
                self.core.trainer_calls.fail_step(f"request {msg.rid} failed {req.attempts} times; last error: "
                                                  f"{msg.error}")

    def _on_Released(self, peer: bytes, inst: Instance | None, msg: M.Released) -> None:
        if inst is None:
            return self.core.registry.unknown(peer, "released")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)
        self.core.counters.released_requests += len(msg.rids)
        for rid in msg.rids:
            self.requeue(rid, inst, "released")

