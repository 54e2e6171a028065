"""Tools that run the engine to measure it: ``sloserve roofline --measure``
(:mod:`~sloserve.tools.roofline_measure`) and the step-composition timers the roofline, the
simulator's profile and the benchmarks share (:mod:`~sloserve.tools.step_profile`).

They sit above the engine and the roofline arithmetic; nothing below them imports them.
"""
