"""``python -m megatron_bridge.launch``: run a program under ``torchrun`` with the Megatron backend's layout.

Usage::

    python -m megatron_bridge.launch [--nproc-per-node N] [--tp T] [--pp P] [--spmd]
        [--nnodes K --node-rank R --master-addr HOST --master-port PORT]
        (-m MODULE | SCRIPT) [ARGS...]

Examples::

    # 2 processes, TP=2, the ordinary RL run on rank 0 (the others serve the Megatron backend):
    python -m megatron_bridge.launch --nproc-per-node 2 -m rlboost_hpc.cli run --set trainer.backend=megatron \\
        --set trainer.megatron.tp=2
    # in an sbatch script, one task per node:
    srun python -m megatron_bridge.launch --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \\
        --master-addr "$MASTER_ADDR" --master-port 29500 --nproc-per-node 8 -m rlboost_hpc.cli run \\
        --set trainer.megatron.tp=8 ...

Modes:
- *leader* (default): global rank 0 runs the program; every other rank runs
  :func:`megatron_bridge.driver.follow`, executing the collective calls that rank 0's ``MegatronBackend``
  broadcasts. So single-process programs (the RL loop, the manager, the weight server) run unchanged.
- ``--spmd``: every rank runs the program (Megatron-LM style); the program makes the same calls on all ranks.

The launcher re-executes itself under ``python -m torch.distributed.run`` (``--standalone`` on one node
unless ``--master-port`` is given: a free rendezvous port, so concurrent jobs never collide), sets
``MEGATRON_BRIDGE_DRIVER`` for the workers, initialises the process groups once per worker with the layout
(``--tp`` / ``--pp``; for an ``rlboost_hpc.cli run`` program, its config's ``trainer.megatron`` — one home),
and releases the followers when rank 0's program returns or calls ``sys.exit`` (its exit status becomes the
job's). If rank 0's program raises, or any rank fails, that process exits at once and torchrun stops the
others and exits non-zero (a follower may be inside a collective rank 0 will never join).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

WORKER_ENV = "MEGATRON_BRIDGE_WORKER"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_bridge.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help=(
        "tensor-parallel size (default: trainer.megatron.tp of an rlboost_hpc.cli run program's config, else 1)"))
    p.add_argument("--pp", type=int, default=None, help=(
        "pipeline-parallel size (default: trainer.megatron.pp of an rlboost_hpc.cli run program's config, else 1)"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--spmd", action="store_true", help="run the program on every rank (default: rank 0 only)")
    p.add_argument("-m", dest="module", default=None, help="run a module as the program (then its ARGS)")
    return p


def _split(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(launcher options, module or None, program argv): everything after ``-m MODULE`` or the first
    non-option token (the script) belongs to the program."""
    with_value = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--tp", "--pp",
                  "--seed"}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            if i + 1 >= len(argv):
                raise SystemExit("megatron_bridge.launch: -m needs a module name")
            return argv[:i], argv[i + 1], argv[i + 2 :]
        if a in with_value:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return argv[:i], None, argv[i:]
    return argv, None, []


def _run_layout(module: str | None, program: list[str]) -> tuple[int, int] | None:
    """``trainer.megatron``'s (tp, pp) when the program is ``rlboost_hpc.cli run`` (read from its ``--config`` and
    ``--set`` as the run will read them), else None. Raises ConfigError (exit 2) on a bad config."""
    if module != "rlboost_hpc.cli" or program[:1] != ["run"]:
        return None
    from rlboost_hpc.config import load_config

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    args, _ = p.parse_known_args(program[1:])
    m = load_config(args.config, args.set).trainer.megatron
    return m.tp, m.pp


def _resolve_layout(a: argparse.Namespace) -> None:
    """Fill ``a.tp`` / ``a.pp``: the run config's layout (the flags, when given, must agree), else 1.

    Raises:
        ConfigError: the flags contradict the run's ``trainer.megatron`` (exit 2, naming both).
    """
    from rlboost_hpc.config import ConfigError

    run = _run_layout(a.module, list(a.program))
    if run is not None:
        flags = (a.tp if a.tp is not None else run[0], a.pp if a.pp is not None else run[1])
        if flags != run:
            raise ConfigError(f"megatron_bridge.launch --tp {flags[0]} --pp {flags[1]} disagrees with the run's "
                              f"trainer.megatron (tp = {run[0]}, pp = {run[1]}): set the layout in one place")
        a.tp, a.pp = run
    a.tp, a.pp = a.tp or 1, a.pp or 1


def _torchrun_argv(a: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.nproc_per_node}"]
    if a.nnodes == 1 and a.master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={a.nnodes}", f"--node-rank={a.node_rank}",
                 f"--master-addr={a.master_addr or '127.0.0.1'}", f"--master-port={a.master_port or 29500}"]
    argv += ["-m", "megatron_bridge.launch", f"--tp={a.tp}", f"--pp={a.pp}", f"--seed={a.seed}"]
    if a.spmd:
        argv.append("--spmd")
    if a.module:
        argv += ["-m", a.module]
    return argv + list(a.program)


def _run_program(a: argparse.Namespace) -> None:
    if a.module:
        sys.argv = [a.module, *a.program]
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    else:
        if not a.program:
            raise SystemExit("megatron_bridge.launch: no program given (-m MODULE or SCRIPT)")
        sys.argv = list(a.program)
        sys.path.insert(0, os.path.dirname(os.path.abspath(a.program[0])))  # as ``python SCRIPT`` does
        runpy.run_path(a.program[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    opts, module, program = _split(list(sys.argv[1:] if argv is None else argv))
    a = _parser().parse_args(opts)
    a.module, a.program = module, program
    if not a.module and not a.program:
        _parser().error("give -m MODULE or SCRIPT")
    if os.environ.get(WORKER_ENV) != "1" and "LOCAL_RANK" not in os.environ:
        from rlboost_hpc.errors import BadInput

        try:
            _resolve_layout(a)  # once, before torchrun: the workers get explicit --tp / --pp
        except BadInput as e:
            print(f"megatron_bridge.launch: {e}", file=sys.stderr)
            return 2
        os.environ[WORKER_ENV] = "1"
        cmd = _torchrun_argv(a)
        os.execv(cmd[0], cmd)
    a.tp, a.pp = a.tp or 1, a.pp or 1  # a worker started by hand (LOCAL_RANK set) without the flags
    os.environ["MEGATRON_BRIDGE_DRIVER"] = "spmd" if a.spmd else "leader"
    import torch.distributed as dist

    from megatron_bridge import driver, parallel

    parallel.initialize(a.tp, a.pp, seed=a.seed)
    rank = dist.get_rank()
    code = 0
    if a.spmd or rank == 0:
        try:
            _run_program(a)
        except SystemExit as e:  # the program's own exit status (e.g. the CLI's 1 or 2)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001
            # The followers may be inside a collective this rank will never join: do not try to release
            # them; exit at once and let torchrun stop the job.
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if not a.spmd:
            driver.shutdown_followers()
    else:
        driver.follow()
    try:
        dist.barrier(group=parallel.control_group())
    except Exception:  # noqa: BLE001 - a peer already failed; torchrun reports it
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
