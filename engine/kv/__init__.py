"""Where KV lives: the block pool, its one manager, eviction policies, tiers, the physical tensor, relocation."""
