"""Paged KV-cache explorer: watch and steer a paged KV-cache block pool while real decoding runs.

    python main.py [--model builtin|PATH] [--block-size N] [--num-blocks N] [--device cpu|cuda|auto]
                   [--demo busy|crowd|lesson|none] [--headless] [--json] [--screenshot PATH --quit-after SECONDS]
                   [--geometry WxH] [--record FILE] [--open FILE] [--kv-events ENDPOINT] [--publish ENDPOINT]
                   [--attach ENDPOINT]... [--attach-kv-events ENDPOINT]... [--tokenizer DIR] [--compile-attention]
                   [--dtype float32|bfloat16]

Bad arguments print one clear line and exit with status 2.
"""
from __future__ import annotations

import os
import sys

# The engine thread and the GUI thread share few cores. OpenMP's default spin-waiting makes torch's worker threads
# burn the core the GUI (or any other process) needs, which slowed decode steps 100x under load here; sleeping
# waits cost a little on an idle machine and keep the app smooth on a busy one. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    from explorer.cli import parse_or_exit
    opts = parse_or_exit(argv)
    watching = bool(opts.open or opts.attach or opts.attach_kv_events)
    if opts.headless and watching:  # no local engine: torch need not load
        from explorer.headless import run_headless_cli
        return run_headless_cli(opts, None)
    from engine import EngineConfig, EngineError
    try:
        cfg = EngineConfig(model=opts.model, block_size=opts.block_size, num_blocks=opts.num_blocks,
                           device=opts.device, dtype=opts.dtype, compile_attention=opts.compile_attention,
                           kv_events_endpoint=opts.kv_events, kv_events_replay_endpoint=opts.kv_events_replay,
                           kv_events_topic=opts.kv_events_topic)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.headless:
        from explorer.headless import run_headless_cli
        return run_headless_cli(opts, cfg)
    from explorer.app import run_gui
    return run_gui(opts, cfg)


if __name__ == "__main__":
    sys.exit(main())
