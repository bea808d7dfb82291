"""rlboost-hpc: RLBoost (adaptive rollout offload onto preemptible capacity) for Slurm clusters."""
__version__ = "0.1.0"
