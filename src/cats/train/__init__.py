"""Training virtual draft models: hidden-state data from the target's own answers, and adapter training."""
