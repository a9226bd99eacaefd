"""Discrete-event cluster simulator driving the same ``nbtrain.core`` scheduler."""

from nbtrain.sim.compare import ALL_POLICIES, format_table, run_policies
from nbtrain.sim.gang import GANG_POLICIES, SIZING_POLICIES, simulate_gang
from nbtrain.sim.greedy import simulate_greedy
from nbtrain.sim.ledger import SimResult
from nbtrain.sim.speedups import with_speedups
from nbtrain.sim.trace import TraceJob, generate, load_csv, save_csv

__all__ = [
    "ALL_POLICIES",
    "GANG_POLICIES",
    "SIZING_POLICIES",
    "SimResult",
    "TraceJob",
    "format_table",
    "generate",
    "load_csv",
    "run_policies",
    "save_csv",
    "simulate_gang",
    "simulate_greedy",
    "with_speedups",
]
