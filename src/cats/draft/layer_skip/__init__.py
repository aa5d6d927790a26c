"""Layer skipping: a draft that is the target with calibrated attention/MLP sublayers skipped (`drafter`), and the
search for which sublayers to skip, cached per model and sparsity (`calibration`)."""
