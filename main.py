"""Paged KV-cache explorer: watch and steer a paged KV-cache block pool while real decoding runs.

    python main.py [--model builtin|PATH] [--block-size N] [--num-blocks N] [--device cpu|cuda|auto]
                   [--demo busy|crowd|lesson|none] [--screenshot PATH --quit-after SECONDS] [--headless]
                   [--compile-attention]

Bad arguments print one clear line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

# The engine thread and the GUI thread share few cores. OpenMP's default spin-waiting makes torch's worker threads
# burn the core the GUI (or any other process) needs, which slowed decode steps 100x under load here; sleeping
# waits cost a little on an idle machine and keep the app smooth on a busy one. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Paged KV-cache explorer")
    parser.add_argument("--model", default="builtin", help="'builtin' or a local checkpoint directory")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per block (default 16)")
    parser.add_argument("--num-blocks", type=int, default=128, help="physical blocks in the pool (default 128)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--demo", default="none", choices=("busy", "crowd", "lesson", "none"),
                        help="busy: a few conversations sharing blocks; crowd: many, for large pools; lesson")
    parser.add_argument("--screenshot", metavar="PATH", help="save a PNG of the main window, then exit")
    parser.add_argument("--quit-after", type=float, metavar="SECONDS", help="close the app after this long")
    parser.add_argument("--headless", action="store_true", help="run the engine without a window, print progress")
    parser.add_argument("--compile-attention", action="store_true",
                        help="decode attention through the torch.compile'd kernel: faster for long contexts and big "
                             "batches; each new batch/context size bucket compiles once (seconds)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.config import EngineConfig
    from engine.errors import EngineError
    try:
        cfg = EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                           device=args.device, compile_attention=args.compile_attention)
        if args.quit_after is not None and args.quit_after < 0:
            raise EngineError("--quit-after must not be negative")
        if args.headless:
            from engine import Engine
            from explorer.demo import DEMOS
            from explorer.headless import run_headless
            engine = Engine(cfg, progress=None)
            if args.demo in DEMOS:
                DEMOS[args.demo](engine)
            elif args.demo == "lesson":
                raise EngineError("the lesson needs the window; drop --headless")
            run_headless(engine)
            return 0
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from explorer.app import run_gui
    return run_gui(cfg, args.demo, args.screenshot, args.quit_after)


if __name__ == "__main__":
    sys.exit(main())
