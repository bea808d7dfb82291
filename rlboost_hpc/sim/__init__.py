"""Discrete-event simulator of RLBoost and its baselines at the paper's scale (see ``docs/simulator.md``).

* :mod:`.profiles` — hardware, model, workload, price and network numbers (every one documented).
* :mod:`.workload` — per-step lengths; spot availability from real traces (``load_trace``).
* :mod:`.engine` — fluid continuous-batching engine model.
* :mod:`.simulator` — the event loop and the RL step (:class:`Simulation`, :func:`simulate`), driving
  ``rlboost_hpc.policy``; its parts: :mod:`.event_queue` (event kinds, the heap), :mod:`.remote_pool` (remote
  instances: acquire, boot, pull, preempt, release), :mod:`.routing` (dispatch and balancing), :mod:`.staleness`
  (the steps in flight, bounded staleness).
* :mod:`.systems` — :class:`SystemSpec` and the named systems: co-located verl, verl 2×, disaggregated, RLBoost and
  ablations.
* :mod:`.table`, :mod:`.experiments`, :mod:`.plots`, :mod:`.cli` — the paper's table, smaller experiments,
  plots and ``rlboost-hpc simulate``.
"""
from rlboost_hpc.sim.profiles import MODELS, Profile, profile
from rlboost_hpc.sim.simulator import RunResult, Simulation, simulate
from rlboost_hpc.sim.systems import SYSTEMS, SystemSpec
from rlboost_hpc.sim.workload import Availability, availability, segment

__all__ = ["MODELS", "SYSTEMS", "Availability", "Profile", "RunResult", "Simulation", "SystemSpec", "availability",
           "profile", "segment", "simulate"]
