"""Advance reservations, as ``scontrol show reservation -o`` reports them: the :class:`Reservation` record and its
parser.

This module owns what the scavenger knows of Slurm's advance reservations — a reservation's name, its start and end
(epoch seconds) and the nodes it holds — and is the place for reservation handling next to the other Slurm records
(:mod:`scavenger.slurm_records`): which nodes a reservation keeps from new work, and when. The client fetches the
rows (``SlurmClient.reservations``); the harvester keeps off the nodes of a reservation that is active or begins
within its horizon.
"""
from __future__ import annotations

from dataclasses import dataclass

from scavenger.slurm_fields import expand_hostlist, iso_time_of


@dataclass(frozen=True)
class Reservation:
    """One advance reservation (``scontrol show reservation -o``): its name, start and end (epoch s) and the node
    names it holds."""

    name: str
    start: float | None
    end: float | None
    nodes: frozenset[str]


def parse_reservations(text: str) -> list[Reservation]:
    """Rows of ``scontrol show reservation -o`` (one ``Key=Value`` line per reservation; "No reservations in the
    system" → ``[]``). Lines without a ``ReservationName`` are skipped."""
    out = []
    for line in text.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "ReservationName" not in f:
            continue
        nodes = f.get("Nodes", "")
        out.append(Reservation(f["ReservationName"], iso_time_of(f.get("StartTime", "")),
                               iso_time_of(f.get("EndTime", "")),
                               frozenset(expand_hostlist(nodes)) if nodes and nodes != "(null)" else frozenset()))
    return out
