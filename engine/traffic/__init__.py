"""Where conversations come from besides the user: public request traces, their replay through the engine, and
capacity sweeps (hit rate against pool size and eviction policy). Nothing here imports torch until an engine is
made, so a sweep starts in a fraction of a second."""
