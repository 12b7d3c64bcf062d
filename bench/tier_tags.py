"""What authenticating disk-tier slots costs: the HMAC-SHA256 tag of a slot against the CRC-32 it replaced, side by
side in one process, alternating rounds.

Why: the disk tier checked each slot with a CRC-32 kept in memory, which anyone who can write the file defeats by
setting four bytes; it now checks an HMAC-SHA256 under a key drawn for the run (engine/kv/tiers.py). Both are
computed once per slot written and once per slot loaded, so the figure that matters is the time per block against
the time of the load itself (a ``preadv`` of the slot, also measured here, from the page cache).

    python bench/tier_tags.py [--rounds 5] [--blocks 64] [--block-kib 720]

``--block-kib``: bytes per block; 720 KiB is the 135M shape's float32 block of 16 tokens (30 layers x K and V x 16 x
3 heads x 64 dims x 4 bytes).
"""
from __future__ import annotations

import argparse
import hmac
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kv.tiers import DiskTier  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=720)
    args = ap.parse_args()
    size = args.block_kib * 1024
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.blocks)]
    key = os.urandom(32)
    with tempfile.TemporaryDirectory() as tmp:
        tier = DiskTier(args.blocks, size, str(Path(tmp) / "tier.bin"))
        for slot, data in enumerate(blocks):
            tier.write(slot, data, 1000 + slot)
            tier.put(slot, 1000 + slot, None, 0)
        out = np.empty(size, np.uint8)

        def crc():
            for data in blocks:
                zlib.crc32(data)

        def tag():
            for slot, data in enumerate(blocks):
                mac = hmac.new(key, slot.to_bytes(16, "little"), "sha256")
                mac.update(data)
                mac.digest()

        def load():  # what a load of each slot costs now: preadv and the tag's check
            for slot in range(args.blocks):
                assert tier.read_into(slot, out)

        times: dict[str, list[float]] = {"crc32": [], "hmac": [], "load": []}
        for _ in range(args.rounds):
            for name, fn in (("crc32", crc), ("hmac", tag), ("load", load)):
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) / args.blocks * 1e3)
        tier.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.blocks} blocks of {args.block_kib} KiB, {args.rounds} alternating rounds, ms per block, median "
          f"(round range):")
    for name in times:
        print(f"  {name:6s} {med[name]:.3f} ({min(times[name]):.3f}-{max(times[name]):.3f})")
    print(f"HMAC-SHA256 / CRC-32: {med['hmac'] / med['crc32']:.2f}x; a disk-tier load (read + tag check): "
          f"{med['load']:.3f} ms per block, of which the tag {med['hmac'] / med['load']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
