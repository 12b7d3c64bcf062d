"""Paged KV-cache explorer: watch and steer a paged KV-cache block pool while real decoding runs.

    python main.py [--model builtin|smollm2|PATH] [--block-size N] [--num-blocks N] [--device cpu|cuda|auto]
                   [--demo busy|crowd|serve|tiers|window|traffic|lesson|none] [--headless] [--json] [--screenshot PATH --quit-after SECONDS]
                   [--geometry WxH] [--record FILE] [--open FILE] [--kv-events ENDPOINT] [--publish ENDPOINT]
                   [--attach ENDPOINT]... [--attach-kv-events ENDPOINT]... [--tokenizer DIR] [--compile-attention]
                   [--make-keys DIR] [--host-tier-blocks N] [--disk-tier-blocks N] [--disk-tier-path FILE]
                   [--dtype float32|bfloat16] [--metrics-port PORT] [--attach-metrics URL]
                   [--trace FILE [--replay instant|timed] ...] [--export-trace FILE]
    python main.py --fetch-model smollm2      (once: a real chat model into the user's cache)

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
    if opts.make_keys:
        return make_keys(opts.make_keys)
    if opts.sweep is not None:  # a capacity sweep of a trace: figures only, no torch, no window
        from explorer.headless import run_sweep_cli
        return run_sweep_cli(opts)
    if opts.fetch_model:  # fetch and convert a real model into the user's cache, nothing else
        from engine import EngineError, fetch_model
        try:
            fetch_model(opts.fetch_model)
        except EngineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if not opts.headless:  # the window: say what to do when there is no display, before Qt aborts the process
        from explorer.cli import display_problem
        problem = display_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    watching = bool(opts.open or opts.attach or opts.attach_kv_events)
    if not watching:  # the local engine's model (a demo takes the real one once fetched); watchers load no torch
        from explorer.cli import build_parser
        from explorer.feeds.demo import demo_settings
        defaults = build_parser()
        given = {name for name in ("model", "num_blocks", "block_size", "host_tier_blocks")
                 if getattr(opts, name) != defaults.get_default(name)}
        for name, value in demo_settings(opts.demo, given).items():  # what the tiers / window demo needs
            setattr(opts, name, value)
        from explorer.feeds.demo import pick_model
        opts.model, model_note = pick_model(opts.model, opts.demo)
        opts.model_note = model_note  # the window says it while the model loads, and after
        if model_note:
            print(model_note, file=sys.stderr)
    elif opts.model is None:
        opts.model = "builtin"  # the window's engine, should the user start one beside what it watches
    from explorer.cli import source_spec
    spec = source_spec(opts)  # what to watch and where the engine's frames go, as the rooms below take it
    if opts.headless and watching:  # no local engine: torch need not load
        from explorer.headless import run_headless_cli
        return run_headless_cli(opts, None, spec)
    from engine import EngineError
    from explorer.cli import engine_config
    try:
        cfg = engine_config(opts)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.headless:
        from explorer.headless import run_headless_cli
        return run_headless_cli(opts, cfg, spec)
    from explorer.window.app import run_gui
    return run_gui(opts, cfg, spec)


def make_keys(directory: str) -> int:
    """``--make-keys DIR``: a CURVE key directory for ``--publish/--attach ENDPOINT,curve=DIR``; 2 on failure."""
    from kvstream.curve import make_keys as make
    try:
        keys = make(directory)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"made CURVE keys in {keys['directory']}:\n"
          f"  publisher: --publish tcp://*:5560,curve={directory} (needs server.key_secret and authorized/)\n"
          f"  watcher:   --attach tcp://HOST:5560,curve={directory} (needs client.key_secret and server.key)\n"
          f"  vLLM:      PAGED_KV_EXPLORER_CURVE={directory}\n"
          "Copy to each machine only what it needs; keep the *_secret files private.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
