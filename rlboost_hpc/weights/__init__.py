"""Pull-based weight transfer: versioned, chunked, checksummed host buffers served by a holder
(:class:`WeightServer`) and fetched by rollout instances over parallel streams (:class:`WeightPuller`).

See :mod:`rlboost_hpc.weights.store` (the versions a holder keeps), :mod:`rlboost_hpc.weights.server` (the
sockets over them) and :mod:`rlboost_hpc.weights.puller` for the invariants (immutable strictly increasing
versions, all-or-nothing verified pulls, deadlines on every phase, a holder that never blocks on a puller).
"""
from rlboost_hpc.weights.pull_phases import PulledWeights
from rlboost_hpc.weights.puller import WeightPuller, WeightTransferError
from rlboost_hpc.weights.server import WeightServer

__all__ = ["PulledWeights", "WeightPuller", "WeightServer", "WeightTransferError"]
