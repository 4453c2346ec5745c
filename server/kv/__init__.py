"""K/V memory: the paged pool and its attention, block bookkeeping, snapshots and the host/disk tiers."""
