"""The tollway CLI, set-up scripts and benchmarks."""
