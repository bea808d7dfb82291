"""The identity scheme of rollout instances: which job id each instance of a worker process registers under, and
the key the manager knows an instance by.

A worker process of job ``J`` hosts one instance (job id ``J``) or several (``J.0``, ``J.1``, …); each
registers as (job id, attempt) (:class:`~rlboost_hpc.protocol.messages.Register`), and the manager keys it
``<job id>#<attempt>``: a requeued job's new attempt is a new instance, never merged with the old one. The
rollout worker, the agent, the manager and the local cluster (which starts workers and asks the manager about
their instances) all derive identities here, so that they agree.
"""
from __future__ import annotations


def instance_ids(job_id: str, n: int) -> list[str]:
    """Identities of the ``n`` rollout instances one worker process of job ``job_id`` hosts: the job id itself
    for one, ``<job id>.<i>`` (i = 0 … n − 1) for several (the manager's instance key adds ``#<attempt>``)."""
    return [job_id] if n == 1 else [f"{job_id}.{i}" for i in range(n)]


def instance_key(job_id: str, attempt: int) -> str:
    """The manager's key of the instance that registered as (``job_id``, ``attempt``): ``<job id>#<attempt>``."""
    return f"{job_id}#{attempt}"


#: The job id of the first reserved engine (the others are ``reserved.<i>``): the trainer allocation's own engines.
RESERVED_JOB = "reserved"


def reserved_job_id(index: int) -> str:
    """The job id reserved engine ``index`` registers under: ``reserved`` for the first (the manager's key
    ``reserved#<attempt>``), ``reserved.<index>`` for the others."""
    return RESERVED_JOB if index == 0 else f"{RESERVED_JOB}.{index}"


def is_reserved_key(key: str) -> bool:
    """Whether a manager instance key (``<job id>#<attempt>``) is a reserved engine's."""
    jid = key.partition("#")[0]
    return jid == RESERVED_JOB or jid.startswith(RESERVED_JOB + ".")
