"""Human-facing output of a run: a live progress bar per step, the final summary table, the plot."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rlboost_hpc.observe.run_report import late_label


class Bar:
    """A rich progress bar on stdout: ``{unit} done/total``, a bar, a free-text field and the elapsed time.
    ``enabled=False`` draws nothing; ``transient`` erases it when done (for commands that print a result)."""

    def __init__(self, total: int, unit: str, enabled: bool = True, transient: bool = False) -> None:
        self.enabled = enabled
        self.progress = Progress(TextColumn(unit + " {task.completed}/{task.total}"), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=Console(), disable=not enabled, transient=transient)
        self.task = self.progress.add_task(unit, total=total, info="")

    def __enter__(self) -> "Bar":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def set(self, completed: int, info: str = "", total: int | None = None) -> None:
        self.progress.update(self.task, completed=completed, info=info, total=total)

    def advance(self, info: str = "") -> None:
        self.progress.update(self.task, advance=1, info=info)


class ProgressView(Bar):
    """The run's bar over RL steps showing the last step's reward, throughput, live preemptible instances and how many
    of its trained responses had moved between instances (each response once, however often it moved — the run's
    summary counts the moves themselves: ``responses_migrated``, "migrations")."""

    def __init__(self, steps: int, enabled: bool = True) -> None:
        super().__init__(steps, "step", enabled)

    @staticmethod
    def text(m: dict) -> str:
        """The bar's text for the step record ``m`` (``metrics.jsonl``'s line)."""
        return (f"reward {m['reward_mean']:.2f}  {m['throughput_tokens_per_s']:.0f} tok/s  "
                f"remote {m['live_preemptible']}  responses moved {m['responses_migrated']}/{m['responses']}")

    def update(self, m: dict) -> None:
        self.advance(self.text(m))


SUMMARY_KEYS = [
    ("steps", "RL steps"), ("reward_heldout_before", "held-out reward before"),
    ("reward_heldout_after", "held-out reward after"), ("pass_at_k_heldout_before", "held-out pass@k before"),
    ("pass_at_k_heldout_after", "held-out pass@k after"),
    ("kl_to_reference_nats_per_token", "KL to the reference (nats/token)"),
    ("repetition_rate_before", "repeated 3-grams before"), ("repetition_rate_after", "repeated 3-grams after"),
    ("quality_gate_passed", "quality gate passed (KL, repeated 3-grams)"),
    ("responses_trained", "responses trained"), ("responses_lost", "responses lost"),
    ("responses_duplicated", "responses duplicated"), ("preemptions", "preemptions (warned + killed)"),
    ("kills_without_warning", "  of which without warning"), ("responses_migrated", "migrations (moves of unfinished responses: seeds, preemptions, releases)"),
    ("tokens_migrated", "tokens carried over by migration (seeds + preempted work)"),
    ("tokens_from_preemptible", "tokens generated on preemptible instances"),
    ("tokens_regenerated", "tokens regenerated"), ("tokens_trained_off_version", "tokens trained off-version"),
    ("max_staleness", "max staleness k (0: strict on-policy)"),
    ("tokens_by_staleness", "tokens trained, by versions old"), ("tokens_masked_too_stale", "tokens older than k (masked)"),
    ("truncated_share", "share of responses truncated"), ("weight_pulls", "weight pulls"),
    ("throughput_tokens_per_s", "throughput (tokens/s)"), ("wall_s", "wall time (s)"),
]


def print_summary(report: dict, console: Console | None = None) -> None:
    """Print the run's key numbers as a table."""
    t = Table(title="rlboost-hpc run summary", show_header=False)
    for k, label in SUMMARY_KEYS:
        v = report.get(k)
        if isinstance(v, dict) and k.startswith("pass_at_k"):
            v = ", ".join(f"pass@{n} {x:.3f}" for n, x in v.items()) or "-"
        t.add_row(label, f"{v:.3f}" if isinstance(v, float) else str(v))
    if "emulated_late_ratio" in report:  # a load test: whether its timings are the profile's
        t.add_row("emulated instances: wall ÷ profile time", late_label(report["emulated_late_ratio"]))
    if console is None:
        from rlboost_hpc.clihelp import console as pipe_console

        console = pipe_console()
    console.print(t)


def write_plot(steps: list[dict], live_series: list[tuple[float, int]], path: Path, *, before: float,
               after: float) -> None:
    """Four panels: over time, training reward (with held-out before/after; a user's task: each reward
    function's step mean too), throughput (and, for multi-turn
    trajectories, turns per trajectory) and live instances; by step, where the step's wall time went (seconds per
    phase, stacked, the fixed overhead and, multi-turn, the seconds of tool calls)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlboost_hpc.observe.timeline import Phase

    fig, ax = plt.subplots(4, 1, figsize=(8, 10.5), gridspec_kw={"height_ratios": [1, 1, 1, 1.2]})
    for a in ax[1:3]:
        a.sharex(ax[0])
    t = [m["t_s"] for m in steps]
    ax[0].plot(t, [m["reward_mean"] for m in steps], marker=".", label="train reward (step mean)")
    for name in sorted({k for m in steps for k in m.get("reward_functions", {})}):  # a user's task: per function
        ax[0].plot(t, [m.get("reward_functions", {}).get(name, float("nan")) for m in steps], ".--", lw=1,
                   label=f"rewards/{name}")
    if t:
        ax[0].hlines([before, after], t[0], t[-1], colors=["gray", "green"], linestyles="dashed")
        ax[0].annotate(f"held-out before {before:.2f}", (t[-1], before), fontsize=8, ha="right", va="top")
        ax[0].annotate(f"held-out after {after:.2f}", (t[0], after), fontsize=8, va="bottom")
    ax[0].set_ylabel("reward")
    ax[0].legend(loc="center left")
    ax[1].plot(t, [m["throughput_tokens_per_s"] for m in steps], marker=".")
    ax[1].set_ylabel("tokens/s (step)")
    if live_series:
        ax[2].step([x for x, _ in live_series], [n for _, n in live_series], where="post",
                   label="live preemptible workers (trace)")
    ax[2].plot(t, [m["preemptible_instances_served"] for m in steps], "o", ms=3,
               label="preemptible instances that generated in the step")
    ax[2].set_ylabel("instances")
    ax[2].set_xlabel("seconds since start")
    ax[2].legend(loc="lower left")
    x = [m["step"] for m in steps]
    bottom = [0.0] * len(steps)
    cmap = plt.get_cmap("tab20")
    for k, phase in enumerate(Phase):
        h = [m.get("phase_s", {}).get(phase.value, 0.0) for m in steps]
        if any(h):
            ax[3].bar(x, h, bottom=bottom, color=cmap(k), width=0.8, label=phase.value)
            bottom = [b + v for b, v in zip(bottom, h)]
    if any("fixed_overhead_s" in m for m in steps):
        ax[3].plot(x, [m.get("fixed_overhead_s", 0.0) for m in steps], "k.-", lw=1, label="fixed overhead")
    if any(m.get("environment_s") for m in steps):  # multi-turn: tool calls (in parallel with generation)
        ax[3].plot(x, [m.get("environment_s", 0.0) for m in steps], "r^--", lw=1, ms=4,
                   label="tool calls (s, summed over calls)")
        tw = ax[1].twinx()
        tw.plot(t, [m.get("turns_mean", 1.0) for m in steps], "g.--", lw=1)
        tw.set_ylabel("turns per trajectory", color="g")
    ax[3].set_ylabel("seconds (step)")
    ax[3].set_xlabel("step")
    ax[3].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
