"""Shared by the simulator tests."""
from __future__ import annotations

from sloserve.sim.cost_model import StepComposition


def record_compositions(engine) -> list[StepComposition]:
    """Wrap ``engine.scheduler.schedule`` so that every non-empty step's composition is appended
    to the returned list (filled as the engine steps)."""
    comps: list[StepComposition] = []
    schedule = engine.scheduler.schedule

    def spy(now=0.0):
        out = schedule(now)
        if not out.is_empty:
            comps.append(StepComposition.of(out))
        return out
    engine.scheduler.schedule = spy
    return comps
