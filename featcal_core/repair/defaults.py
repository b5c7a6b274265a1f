"""The repair baselines' default settings, importable without torch (the CLI's --help shows them).

RegMean: `REGMEAN_ALPHA`; Representation Surgery: `SURGERY_*`; AdaMerging: `ADAMERGING_*`.
"""

from __future__ import annotations

#: RegMean's scale of the Grams' off-diagonal entries
REGMEAN_ALPHA = 0.6

#: Representation Surgery: rank of the module, Adam steps, learning rate, rows per step
SURGERY_RANK = 16
SURGERY_STEPS = 1000
SURGERY_LR = 1e-3
SURGERY_BATCH = 16

#: AdaMerging: Adam steps, learning rate, initial merge coefficient, rows per task and step
ADAMERGING_STEPS = 500
ADAMERGING_LR = 1e-3
ADAMERGING_INIT = 0.3
ADAMERGING_BATCH = 16
