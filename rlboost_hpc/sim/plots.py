"""Plots of simulator output (matplotlib, written to a file; the Agg backend, no display needed)."""
from __future__ import annotations

from pathlib import Path

from rlboost_hpc.sim.simulator import RunResult
from rlboost_hpc.sim.table import TARGETS

MAIN_SYSTEMS = ("colocated", "verl_2x", "disaggregated", "rlboost", "rlboost_no_seeding", "rlboost_fixed_seed",
                "rlboost_recompute", "rlboost_round_robin")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: RunResult, path: str | Path) -> Path:
    """Per-step timeline: step time and throughput; T_seed, pool size and cap; trainer/remote idle waits."""
    plt = _plt()
    tl = result.timeline
    x = [s["t_start"] / 60.0 for s in tl]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax[0].plot(x, [s["step_s"] for s in tl], "o-", label="step time (s)")
    ax[0].set_ylabel("seconds")
    a2 = ax[0].twinx()
    a2.plot(x, [s["throughput"] / 1000 for s in tl], "s--", color="tab:green", label="k tokens/s")
    a2.set_ylabel("k tokens/s")
    ax[0].legend(loc="upper left")
    a2.legend(loc="upper right")
    ax[0].set_title(f"{result.model} {result.system} on {result.availability}: "
                    f"{result.throughput:.0f} tok/s, {result.tokens_per_dollar:.0f} tok/$")
    ax[1].plot(x, [s["t_seed_s"] for s in tl], "o-", label="T_seed (s)")
    ax[1].set_ylabel("T_seed (s)")
    b2 = ax[1].twinx()
    b2.step(x, [s["n_start"] for s in tl], where="post", color="tab:orange", label="instances at start")
    b2.step(x, [s["cap_next"] if s["cap_next"] is not None else float("nan") for s in tl], where="post",
            color="tab:red", linestyle=":", label="N_prem cap (next)")
    b2.set_ylabel("instances")
    ax[1].legend(loc="upper left")
    b2.legend(loc="upper right")
    ax[2].plot(x, [s["t_wait_train_s"] for s in tl], "o-", label="trainer wait")
    ax[2].plot(x, [s["t_wait_remote_s"] for s in tl], "s-", label="remote wait")
    ax[2].plot(x, [s["t_train_s"] for s in tl], "^-", label="train compute")
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("minutes since start")
    ax[2].legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_table(table: dict, path: str | Path) -> Path:
    """Bars of throughput and cost-efficiency ratios vs co-located per model; paper targets as markers."""
    plt = _plt()
    models = [m for m in table if m != "meta"]
    fig, ax = plt.subplots(1, 2, figsize=(12, 5.2))
    width = 0.8 / len(MAIN_SYSTEMS)
    for k, key in enumerate(("throughput_ratio_vs_colocated", "cost_efficiency_ratio_vs_colocated")):
        for i, sname in enumerate(MAIN_SYSTEMS):
            vals = [table[m].get(sname, {}).get(key, float("nan")) for m in models]
            ax[k].bar([j + i * width for j in range(len(models))], vals, width, label=sname)
        tkey = "throughput_ratio" if k == 0 else "cost_efficiency_ratio"
        ti = MAIN_SYSTEMS.index("rlboost")
        ax[k].plot([j + ti * width for j in range(len(models))], [TARGETS[m][tkey] for m in models], "k*",
                   markersize=12, label="paper (RLBoost)")
        ax[k].axhline(1.0, color="gray", lw=0.8)
        ax[k].set_xticks([j + 0.4 - width / 2 for j in range(len(models))])
        ax[k].set_xticklabels([f"Qwen3-{m.upper()}" for m in models])
        ax[k].set_title("throughput vs co-located" if k == 0 else "tokens per dollar vs co-located")
    handles, labels = ax[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
