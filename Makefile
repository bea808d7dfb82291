# Local Slurm cluster for the slurm-marked tests (see sbatch/local-cluster/README.md).
.PHONY: slurm-up slurm-down slurm-purge

slurm-up:
	sbatch/local-cluster/up

slurm-down:
	sbatch/local-cluster/down

slurm-purge:
	sbatch/local-cluster/down --purge
