"""FeatCal itself: token-weighted statistics, the closed-form solvers, one block, the
whole calibration loop, hidden-state streams, persisted states, head calibration and
the hyperparameters. Readable on its own, like the authors' two files."""
