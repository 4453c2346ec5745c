"""The engine: one thread per model; a step is schedule, run, post-process, finish."""
