"""Small helpers shared by the tests."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

#: Units in the last place (of the reference's largest magnitude) by which two fp32 computations of the same values
#: may differ when their reduction order differs: another kernel (ours vs transformers'), thread count or batch
#: blocking. Measured: up to 7 ulps of 19-nat logits (1.5e-5); a fixed 1e-5 failed at random on a loaded machine.
#: A real defect — a wrong RoPE, a missing norm, a stale cache slot — moves logits by whole units.
FP32_ULPS = 64


def fp32_atol(ref) -> float:
    """The absolute tolerance between two fp32 computations of ``ref`` (a tensor) by different kernels:
    :data:`FP32_ULPS` ulps of ``max(1, max |ref|)``."""
    import torch

    return FP32_ULPS * torch.finfo(torch.float32).eps * max(1.0, ref.detach().abs().max().item())


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``; the previous count is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wait_for(pred, timeout: float, what: str, interval: float = 0.25, state: Callable[[], str] | None = None):
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout`` seconds pass (AssertionError,
    with ``state()`` appended: what is needed to diagnose the wait)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{state()}" if state else ""))
        time.sleep(interval)


def wait_progressing(pred, progress: Callable[[], object], stall_s: float, what: str,
                     state: Callable[[], str] | None = None, interval: float = 0.5):
    """Poll ``pred`` until it returns something truthy (returned). Bounded by progress, not by a total: fail
    (AssertionError with ``state()``) only when ``progress()`` (e.g. the steps completed) has not changed for
    ``stall_s`` seconds — a slow machine is waited for, a stuck run is not."""
    last, since = progress(), time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        now_p = progress()
        if now_p != last:
            last, since = now_p, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"no progress for {stall_s} s (still at {last!r}) waiting for {what}"
                                 + (f"\n{state()}" if state else ""))
        time.sleep(interval)


def tail(path: Path, n: int = 20) -> str:
    """The last ``n`` lines of a text file (``<missing>`` when it does not exist), for failure messages."""
    p = Path(path)
    if not p.exists():
        return f"--- {p}: <missing>"
    return f"--- {p} (last {n} lines):\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:])


def collect_until(eng, req, k: int):
    """Run ``req`` on engine ``eng`` until ≥ k tokens came back (or it finished), abort it, and return
    ``(ids, logprobs, finish_reason or None)``: every token the engine produced, including those handed back by
    ``abort`` (the Engine contract: engines that produce tokens asynchronously return them there)."""
    eng.add(req)
    ids: list[int] = []
    lps: list[float] = []
    while True:
        for e in eng.step():
            assert e.rid == req.rid and len(e.token_ids) == len(e.logprobs)
            ids += e.token_ids
            lps += e.logprobs
            if e.finished:
                return ids, lps, e.finish_reason
        if len(ids) >= k:
            ev = eng.abort(req.rid)
            if ev is not None:
                assert len(ev.token_ids) == len(ev.logprobs)
                ids += ev.token_ids
                lps += ev.logprobs
                if ev.finished:
                    return ids, lps, ev.finish_reason
            assert eng.num_active == 0
            return ids, lps, None


def load_hf_dir(d):
    """(architecture, fp32 full state dict) of a model directory, read as the run reads them."""
    from rlboost_hpc.models.arch import arch_from_hf
    from rlboost_hpc.models.hf_dir import read_state_dict

    arch = arch_from_hf(d)
    return arch, read_state_dict(d, arch)


#: The Megatron verification scenarios (``python tests/megatron_scenarios.py SCENARIO``; test support).
SCENARIOS = str(Path(__file__).resolve().parent / "megatron_scenarios.py")


class FlipBit:
    """A weight server ``_payload_hook`` that flips one bit of chunk ``index``'s frame — the first time it is sent
    (``always=False``) or every time; ``hits`` counts the frames it altered."""

    def __init__(self, index: int, always: bool = False, byte: int = 0) -> None:
        self.index, self.always, self.byte, self.hits = index, always, byte, 0

    def __call__(self, version: int, index: int, frame):
        if index != self.index or (self.hits and not self.always):
            return frame
        self.hits += 1
        b = bytearray(frame)
        b[self.byte] ^= 0x80
        return bytes(b)


def close_all(clients=(), procs=(), servers=()) -> None:
    """End a test's trainer side: close its manager clients, kill its manager processes (``multiprocessing``) and
    close its weight servers — whatever an assertion left running."""
    for c in clients:
        c.close()
    for p in procs:
        p.kill()
        p.join(5)
    for s in servers:
        s.close()


def preempting_cluster(tmp_path) -> list[str]:
    """``--set`` overrides of a local cluster of two workers replaying a trace that preempts one of them early (warned,
    held until it holds partial responses) and starts another (the trace is written under ``tmp_path``)."""
    trace = Path(tmp_path) / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n1000,remove,a\n1500,add,c\n")
    return [f"cluster.trace='{trace}'", "cluster.time_scale=1.0", "cluster.replay_s=120", "cluster.window_start_s=0",
            "cluster.max_workers=2", "cluster.min_changes=0", "cluster.min_removals=0", "cluster.min_starts=0",
            "cluster.preempt_when_busy=true", "policy.cap=false"]


def preempted_run(model_dir, tmp_path, *, max_new_tokens: int = 96, eval_samples: int = 2) -> list[str]:
    """``--set`` overrides of a 3-step GSM8K run of ``model_dir`` on :func:`preempting_cluster`: what the tests of
    Hugging Face checkpoints run."""
    return [f"model.path='{model_dir}'", "task.name=gsm8k", "trainer.steps=3", "task.train_prompts=24",
            "task.heldout_prompts=4", f"trainer.eval_samples={eval_samples}", "rollout.prompts_per_step=8",
            f"rollout.max_new_tokens={max_new_tokens}", "weights.dtype=float32", *preempting_cluster(tmp_path)]
