"""Every number the planner decides with, in one place: search ranges, PLD grids, tolerances, caps.

None of them changes a guarantee: every noise multiplier a plan returns is an exact evaluation of
its accountant at that multiplier, whatever grid found it or however near the search stopped.
They set what a search explores and how long it takes.
"""

from __future__ import annotations

# The range a noise multiplier is searched in, for every accountant but cyclic Poisson's PLD.
SIGMA_RANGE = (1e-3, 1e4)
# Cyclic Poisson's PLD grows as the effective noise multiplier (sigma / column norm) falls: one
# evaluation takes about 1.5 s at 0.5, 9 s at 0.2 and 45 s at 0.1 (600 compositions, one core).
# So a search starts near a guess and goes no lower than POISSON_FLOOR column norms (the plan),
# or than the lower end of POISSON_SIGMA_RANGE (the choice's bands).
POISSON_FLOOR = 0.25
POISSON_SIGMA_RANGE = (1e-2, 1e4)

# PLD grids. The pessimistic discretization rounds privacy losses up, so every grid gives an upper
# bound; a coarser one is looser and faster. The plan prices on poisson()'s default grid (1e-4).
# The comparison's rows are priced on PLD_DISCRETIZATION: its epsilons exceed the plan grid's by
# about 2e-4 relative at epsilon 3 (sigma about 1e-4 higher), and each evaluation is about 8x
# faster (a million examples: 0.2 s instead of 1.6 s for Poisson DP-SGD). Bands are *ranked* on
# CHOICE_DISCRETIZATION, another 6x faster: its sigmas are 0.02% (many bands) to 3% (DP-SGD over
# 15,000 steps) higher, well below the gaps between the candidates that compete.
PLD_DISCRETIZATION = 1e-3
CHOICE_DISCRETIZATION = 1e-2

# Stopping rules of the searches: a noise multiplier within RTOL of the smallest that meets the
# budget, or an epsilon within EPSILON_RTOL of the target (calibrate_capped's defaults, with which
# the amplified bounds are calibrated); the coarse ranking stops at CHOICE_RTOL on either.
RTOL = 1e-4
EPSILON_RTOL = 1e-3
CHOICE_RTOL = 1e-3

# The noise state a candidate may keep, in floats per model parameter: the BLT's own cap
# (max_buffers). The band rule alone would take BandMF to hundreds of bands on large data sets
# (256 at 60,000 examples, epsilon 8), hundreds of copies of the model for a few percent less noise.
MAX_STATE_ROWS = 10

# Process-wide caches of pure results (choices, calibrated noise multipliers), bounded.
CHOICES_LIMIT = 64
CALIBRATED_LIMIT = 256
