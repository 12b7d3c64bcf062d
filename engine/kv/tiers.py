"""Lower tiers of the KV cache: host memory and a disk file, holding full hashed blocks the device pool evicted.

Why: the prefix cache drops an evicted block's K/V for good, so a conversation that returns after its blocks left
the device recomputes its whole prefix. Servers (vLLM's offloading connector, SGLang's HiCache, LMCache) keep such
blocks in CPU memory and on disk and load them back on a prefix hit; this module is that, for the engine.

Bookkeeping and bytes only, numpy and the standard library (no torch): a tier is a set of slots, each FREE or
holding one block's K/V bytes under its prefix hash, in least-recently-used order. The engine hands it a block's
bytes (read from the device pool just before the pool hands that block to someone else) and copies the bytes of a
hit back into a device block itself; the KV-cache manager decides what moves and records every move as a block
event (OFFLOADED, LOADED, DROPPED).

The flow is vLLM's offloading one: device -> host -> disk -> dropped. A block the device evicts goes to the host
tier (most recently used there); the host tier's least recently used block moves on to the disk tier; the disk
tier's least recently used block is dropped. A hash lives at most once per tier; a block loaded back stays in its
tier (a copy, not a move), so evicting it from the device again costs no copy.

Every change can be undone: while a transaction is open (:meth:`TierStore.begin`), each slot's bookkeeping is saved
before its first change, and the bytes of a slot that held a block at the checkpoint are saved before they are
overwritten; :meth:`TierStore.rollback` puts both back. So a failed step leaves every tier exactly as it was.

The disk tier writes one file (plain ``os.pwrite`` / ``os.pread`` at slot offsets after a header of its own) and
keeps, in memory, an HMAC-SHA256 of each slot under a key drawn for this run, over the slot's index, the block's
cache key and its bytes, checked on every read: a slot whose bytes do not match (damaged file, failed write, a read
error, another writer forging or swapping slots) is never loaded; the caller drops it and recomputes those tokens.
A checksum would not do: whoever can write the file can fix a CRC-32 with four bytes; without the key no one can
make a tag. It calls ``fsync`` every :data:`FSYNC_EVERY` writes and when closed. A failed write (disk full, I/O
error) drops the block being written: logged, never raised, so a full disk never stops the engine.

The file is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600). An existing path is reused only when it is a
regular file of this user's, with no access for group or others, one link, and the tier header at its start (a tier
file of an earlier run); anything else (a symlink, someone else's file, a checkpoint, a recording) is refused with
one line saying why, and never truncated. An ``flock`` keeps two processes off one tier file; within one process
the newer engine takes it over from the older (the window's restart builds the new engine while the old runs), and
the older tier then drops what it would have written and recomputes what it would have read.
"""
from __future__ import annotations

import abc
import errno
import fcntl
import hmac
import logging
import os
import shutil
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvstream.events import EventKind
from kvstream.rules import group_key, raw_hash
from kvstream.views import NO_HASH, BlockState, TierView

from ..errors import EngineError

log = logging.getLogger(__name__)

STAGING_KEEP_BYTES = 256 << 20  # staging arrays kept for reuse between transactions (see TierStore.staging): a
#                                 fresh array of a conversation's blocks costs a page fault per 4 KiB on first touch,
#                                 more than the copy itself; larger ones are allocated and freed each time
FSYNC_EVERY = 256  # disk-tier writes between two fsyncs (and one at close): the file is a cache of this process,
#                    read back only through checksums, so a crash loses nothing that matters; fsync bounds how much
#                    dirty data the kernel holds for it
TIER_NAMES = ("host", "disk")  # top to bottom
TIER_MAGIC = b"PAGED-KV-TIER\x00\x01\x00"  # the disk tier file's first 16 bytes: only a file starting so is reused
HEADER_BYTES = 4096  # the header's room in the file: slots start page-aligned after it
_HEADER = struct.Struct("<16sQQ")  # magic, slots, bytes per slot
_SLOT = struct.Struct("<QQ")  # what a slot's tag covers besides its bytes: its index and the block's cache key


@dataclass(frozen=True)
class TierHit:
    """A prefix block found in a lower tier (an entry of ``KVCacheManager.prefix_hits`` besides device ids)."""

    tier: str  # "host" | "disk"
    slot: int  # slot in that tier
    block_hash: int  # the block's cache key: its prefix hash, mixed with its KV cache group past group 0
    group: int = 0  # the KV cache group the block belongs to (kvstream.rules.group_key)


@dataclass(frozen=True)
class TierLoad:
    """Blocks one admission took from a lower tier, for the engine to write into the device pool (take_loads)."""

    blocks: list[int]  # device blocks, freshly taken
    data: np.ndarray  # uint8 [len(blocks), bytes per block]: what goes into them
    kept_blocks: Any = ()  # those of ``blocks`` the taking evicted and offloaded (a grouped pool lists them group
    #                        by group, not in the order taken) ...
    kept: np.ndarray | None = None  # ... and the bytes they held, row i for kept_blocks[i]: the rollback copy


class Tier(abc.ABC):
    """One tier's slots: FREE or CACHED, each CACHED slot holding one hashed block's K/V bytes.

    Subclasses store the bytes (:class:`HostTier`, :class:`DiskTier`); this class keeps the per-slot arrays (the
    ones a :class:`TierView` shows), the hash -> slot map, the release (LRU) order and the undo records. Which block
    makes room is the eviction policy's choice (engine.kv.policies, as for the device pool: the tier offers a policy
    what the pool offers it, slots for blocks); LRU unless told otherwise."""

    name = ""

    def __init__(self, num_blocks: int, bytes_per_block: int):
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.state = np.zeros(num_blocks, np.int8)  # BlockState: FREE or CACHED
        self.block_hash = np.zeros(num_blocks, np.uint64)  # cache key held (kvstream.rules.group_key); NO_HASH: free
        self.group = np.zeros(num_blocks, np.int8)  # KV cache group of the block held (0 where free)
        self.last_access = np.zeros(num_blocks, np.int64)  # step of the last write or read
        self.queued_at = np.arange(num_blocks, dtype=np.int64)  # LRU stamp (free slots: the order they are taken)
        self._stamp = num_blocks
        self.records: dict[int, Any] = {}  # hash -> HashedBlock (its tokens and parent, for events and loads)
        self.pinned: set[int] = set()  # slots an admission is loading from: never chosen to make room
        self.version = 0  # bumped by every change (views are rebuilt only when it moved)
        self._saved: dict[int, tuple] | None = None  # slot -> bookkeeping at the checkpoint (open transaction)
        self._saved_bytes: dict[int, np.ndarray] = {}  # slot -> bytes at the checkpoint, saved before overwritten
        self._dropped: dict[int, Any] = {}  # hash -> record of blocks dropped in the open transaction (policies)
        self._policy_saved: tuple | None = None  # the policy's state at the checkpoint, taken at the first change
        self._rebuild()
        from .policies.lru import LRUPolicy
        self.use_policy(LRUPolicy())

    def use_policy(self, policy) -> None:
        """Let ``policy`` (an engine.kv.policies.EvictionPolicy) choose which block makes room."""
        self.policy = policy
        policy.bind(self)

    # ---- derived ----------------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        order = np.argsort(self.queued_at, kind="stable")
        state = self.state[order]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order[state == BlockState.FREE].tolist())
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(order[state == BlockState.CACHED].tolist())
        held = np.flatnonzero(self.state == BlockState.CACHED)
        self.hash_to_slot: dict[int, int] = dict(zip(self.block_hash[held].tolist(), held.tolist()))

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    # what an eviction policy reads of a pool (engine.kv.policies.base), a tier's slots standing for blocks
    num_cached_blocks = num_cached

    def cached_queue(self):
        return self._lru

    @property
    def hashed(self) -> dict:
        return self.records

    @property
    def hash_to_block(self) -> dict:
        return self.hash_to_slot

    def dropped_record(self, block_hash: int):
        return self._dropped.get(block_hash)

    def lookup(self, block_hash: int) -> int | None:
        return self.hash_to_slot.get(block_hash)

    # ---- changes ----------------------------------------------------------------------------------------------
    def _save(self, slot: int) -> None:
        """Remember the slot as it was at the checkpoint, before its first change in the open transaction."""
        if self._saved is not None and slot not in self._saved:
            h = int(self.block_hash[slot])
            self._saved[slot] = (int(self.state[slot]), h, int(self.last_access[slot]), int(self.queued_at[slot]),
                                 self.records.get(h) if h != NO_HASH else None, int(self.group[slot]))
            if self._policy_saved is None:  # the policy as it was, copied once per transaction that changes the tier
                self._policy_saved = self.policy.state()
        self.version += 1

    def _restamp(self, slot: int) -> None:
        self.queued_at[slot] = self._stamp
        self._stamp += 1

    def touch(self, slot: int, clock: int) -> None:
        """The block in ``slot`` was used (loaded back, or evicted from the device again): most recently used."""
        self._save(slot)
        self.last_access[slot] = clock
        self._restamp(slot)
        self._lru.move_to_end(slot)
        self.policy.revived(slot)  # a use, and it stays evictable: the policy counts the use, then ranks it again
        self.policy.cached(slot)

    def free_slot(self) -> int | None:
        """A FREE slot, if any (without taking it)."""
        return next(iter(self._free), None)

    def victim(self) -> int | None:
        """The CACHED slot the policy gives up, never a pinned one (None: every one is pinned)."""
        if not self._lru or all(slot in self.pinned for slot in self._lru):
            return None
        return self.policy.victim(self.pinned)

    def put(self, slot: int, block_hash: int, record, clock: int, group: int = 0) -> None:
        """``slot`` (FREE, its bytes just written) now holds ``block_hash`` (a cache key) of KV cache ``group``,
        most recently used."""
        self._save(slot)
        self._free.pop(slot)
        self.block_hash[slot] = block_hash
        self.group[slot] = group
        self.last_access[slot] = clock
        self._restamp(slot)
        self.hash_to_slot[block_hash] = slot
        self.records[block_hash] = record
        self.policy.stored(slot)  # stored as a pool's block is: before it is evictable
        self.state[slot] = BlockState.CACHED
        self._lru[slot] = None
        self.policy.cached(slot)

    def drop(self, slot: int, clock: int) -> None:
        """``slot`` lets go of its block (its bytes stay until overwritten, but nothing names them)."""
        self._save(slot)
        h = int(self.block_hash[slot])
        self._dropped[h] = self.records.get(h)
        self.policy.dropped(slot, h)  # while the slot still holds it: a policy may look at its state
        self._lru.pop(slot)
        del self.hash_to_slot[h]
        self.records.pop(h, None)
        self.state[slot] = BlockState.FREE
        self.block_hash[slot] = NO_HASH
        self.group[slot] = 0
        self.last_access[slot] = clock
        self._restamp(slot)
        self._free[slot] = None

    def write(self, slot: int, data: np.ndarray, block_hash: int | None = None) -> None:
        """Store ``data`` (uint8, bytes_per_block), the bytes of the block with cache key ``block_hash``, in
        ``slot``, saving the checkpoint's bytes first. (A disk slot written without its key gets no tag: it is never
        read back.)"""
        saved = self._saved.get(slot) if self._saved is not None else None
        held_at_checkpoint = (saved[0] if saved is not None else int(self.state[slot])) == BlockState.CACHED
        if self._saved is not None and held_at_checkpoint and slot not in self._saved_bytes:
            old = self._read_raw(slot)
            if old is not None:
                self._saved_bytes[slot] = old
        self._write_raw(slot, data, block_hash)

    def read(self, slot: int) -> np.ndarray | None:
        """The bytes in ``slot`` (a copy), or None when they cannot be trusted (see :class:`DiskTier`)."""
        return self._read_raw(slot)

    def read_into(self, slot: int, out: np.ndarray) -> bool:
        """Copy the bytes in ``slot`` into ``out`` (uint8, bytes_per_block, e.g. one row of a load's staging
        array: one copy, no array per block); False when they cannot be trusted."""
        data = self.read(slot)
        if data is None:
            return False
        out[:] = data
        return True

    # ---- bytes (subclasses) -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _write_raw(self, slot: int, data: np.ndarray, block_hash: int | None = None) -> None:
        """Store ``data`` in ``slot`` (host memory or the disk file); ``block_hash``: the cache key it will be held
        under (None: bytes put back by a rollback, whose tag is restored with its bookkeeping)."""

    @abc.abstractmethod
    def _read_raw(self, slot: int) -> np.ndarray | None:
        """The bytes in ``slot``, or None when they cannot be trusted."""

    def close(self) -> None:
        pass

    # ---- transactions -----------------------------------------------------------------------------------------
    def begin(self) -> None:
        self._saved, self._saved_bytes, self._dropped, self._policy_saved = {}, {}, {}, None

    def end(self) -> None:
        self._saved, self._saved_bytes, self._dropped, self._policy_saved = None, {}, {}, None

    def rollback(self) -> None:
        saved, saved_bytes = self._saved or {}, self._saved_bytes
        self._saved = None  # the writes below put bytes back; they must not be saved again
        for slot, data in saved_bytes.items():
            try:
                self._write_raw(slot, data)
            except OSError as exc:  # the checksum of the restored bookkeeping no longer matches: never loaded
                log.warning("%s tier: could not put back slot %d after a rollback (%s); it will be recomputed",
                            self.name, slot, exc)
        for slot, (state, h, last, queued, record, group) in saved.items():
            self.state[slot], self.block_hash[slot], self.group[slot] = state, h, group
            self.last_access[slot], self.queued_at[slot] = last, queued
            if record is not None:
                self.records[h] = record
        self._restore_checksums(saved)
        if saved:  # records of blocks that came in since the checkpoint go with them
            held = set(self.block_hash[self.state == BlockState.CACHED].tolist())
            self.records = {h: r for h, r in self.records.items() if h in held}
        self._saved_bytes = {}
        self.version += 1
        self._rebuild()
        if self._policy_saved is not None:
            self.policy.restore(self._policy_saved)
        self._policy_saved, self._dropped = None, {}

    def _restore_checksums(self, saved: dict) -> None:
        pass

    # ---- views ------------------------------------------------------------------------------------------------
    def view(self) -> TierView:
        """An immutable copy of the slots (the window's grid of this tier)."""
        def frozen(a):
            a = a.copy()
            a.setflags(write=False)
            return a
        return TierView(num_blocks=self.num_blocks, state=frozen(self.state), block_hash=frozen(self.block_hash),
                        last_access=frozen(self.last_access))

    def check_invariants(self) -> None:
        free, lru = set(self._free), set(self._lru)
        assert not free & lru and len(free) + len(lru) == self.num_blocks, f"{self.name}: queues disagree"
        assert lru == set(np.flatnonzero(self.state == BlockState.CACHED).tolist()), f"{self.name}: LRU != CACHED"
        assert (self.block_hash[self.state == BlockState.FREE] == NO_HASH).all(), f"{self.name}: free slot hashed"
        assert (self.group[self.state == BlockState.FREE] == 0).all(), f"{self.name}: free slot in a group"
        held = np.flatnonzero(self.state == BlockState.CACHED)
        assert self.hash_to_slot == dict(zip(self.block_hash[held].tolist(), held.tolist())), \
            f"{self.name}: hash map disagrees with the slots"
        assert set(self.records) == set(self.hash_to_slot), f"{self.name}: records disagree with the slots"
        from .pool import hash_block_tokens
        for slot in held.tolist():  # each key is its content's hash in the slot's group (kvstream.rules.group_key)
            key, record = int(self.block_hash[slot]), self.records[int(self.block_hash[slot])]
            assert key == group_key(hash_block_tokens(record.parent_hash, record.token_ids), int(self.group[slot])), \
                f"{self.name}: slot {slot}'s key is not its content's in group {int(self.group[slot])}"
        self.policy.check_invariants()


class HostTier(Tier):
    """Slots in host memory: one preallocated uint8 array [slots, bytes per block]."""

    name = "host"

    def __init__(self, num_blocks: int, bytes_per_block: int):
        try:
            self.data = np.zeros((num_blocks, bytes_per_block), np.uint8)
        except (MemoryError, ValueError) as exc:
            raise EngineError(f"cannot allocate the host tier of {num_blocks:,} blocks: {exc}") from None
        super().__init__(num_blocks, bytes_per_block)
        from ..heap import Populator
        # its first pages faulted in off the steps (engine.heap.Populator); started once the whole store is made
        self.populator = Populator(self.data, start=False)

    def close(self) -> None:
        self.populator.stop()
        self.data = np.zeros((0, self.bytes_per_block), np.uint8)  # the tier is off: its memory goes now

    def _write_raw(self, slot: int, data: np.ndarray, block_hash: int | None = None) -> None:
        self.data[slot] = data

    def _read_raw(self, slot: int) -> np.ndarray | None:
        return self.data[slot].copy()

    def read_into(self, slot: int, out: np.ndarray) -> bool:
        np.copyto(out, self.data[slot])
        return True


class DiskTierFileError(EngineError):
    """A disk tier path the tier will not write: the reason, in one line."""


_open_files: dict[tuple[int, int], "weakref.ref[DiskTier]"] = {}  # (device, inode) -> the tier of this process
#                                                                    using that file (see DiskTier.take_over)
_open_files_lock = threading.Lock()


def _same_file(path: str, other) -> bool:
    try:
        return os.path.samefile(path, other)
    except (OSError, ValueError, TypeError):
        return os.path.realpath(path) == os.path.realpath(os.fspath(other))


def open_tier_file(path: str, protected=()) -> tuple[int, bool]:
    """The file descriptor of the disk tier file at ``path`` and whether it was made new; DiskTierFileError saying
    why a path is refused. Made new and exclusively where nothing is there; an existing path is reused only when it
    is a tier file of this user's (see the module's docstring), since truncating it is what the tier does next.
    ``protected``: files the tier must never be (the model's), named in the refusal."""
    for other in protected:
        if _same_file(path, other):
            raise DiskTierFileError(f"disk_tier_path {path} is the model's own file {os.fspath(other)}; the disk "
                                    "tier would overwrite it: give the path of a new file")
    base = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # non-blocking: a FIFO must not hang the open
    try:
        return os.open(path, base | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        pass
    except OSError as exc:
        raise DiskTierFileError(f"cannot create the disk tier file {path}: {exc.strerror or exc}") from None
    try:
        fd = os.open(path, base)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DiskTierFileError(f"disk_tier_path {path} is a symbolic link; the disk tier never writes through "
                                    "one: give the path of a new file") from None
        raise DiskTierFileError(f"cannot open the disk tier file {path}: {exc.strerror or exc}") from None
    try:
        _check_reusable(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def _check_reusable(fd: int, path: str) -> None:
    """Refuse an existing file unless it is a tier file of this user's that nobody else may touch."""
    info = os.fstat(fd)
    refuse = "; the disk tier reuses only a tier file of its own: remove it or give the path of a new file"
    if not stat.S_ISREG(info.st_mode):
        raise DiskTierFileError(f"disk_tier_path {path} exists and is not a regular file{refuse}")
    if info.st_uid != os.geteuid():
        raise DiskTierFileError(f"disk_tier_path {path} belongs to another user (uid {info.st_uid}){refuse}")
    if info.st_mode & 0o077:
        raise DiskTierFileError(f"disk_tier_path {path} may be read or written by others (mode "
                                f"{stat.S_IMODE(info.st_mode):04o}){refuse}")
    if info.st_nlink != 1:
        raise DiskTierFileError(f"disk_tier_path {path} has {info.st_nlink} hard links{refuse}")
    try:
        head = os.pread(fd, len(TIER_MAGIC), 0)
    except OSError as exc:
        raise DiskTierFileError(f"cannot read the disk tier file {path}: {exc.strerror or exc}") from None
    if head != TIER_MAGIC:
        raise DiskTierFileError(f"disk_tier_path {path} exists and is not a disk tier file (it does not start with "
                                f"the tier header){refuse}")


class DiskTier(Tier):
    """Slots in one file at ``path``: a header, then slot i at offset HEADER_BYTES + i * bytes_per_block, with an
    HMAC of each slot kept in memory."""

    name = "disk"

    def __init__(self, num_blocks: int, bytes_per_block: int, path: str, protected=()):
        size = HEADER_BYTES + num_blocks * bytes_per_block
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise EngineError(f"disk_tier_path {path} is a folder; give a file name")
        if not os.path.isdir(folder):
            raise EngineError(f"disk_tier_path {path}: the folder {folder} does not exist")
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        existing = os.path.getsize(path) if os.path.isfile(path) and not os.path.islink(path) else 0
        if free is not None and size > free + existing:
            raise EngineError(f"the disk tier of {num_blocks:,} blocks needs {size / 2**30:.2f} GiB "
                              f"({bytes_per_block / 2**10:.0f} KiB per block) but {folder} has only "
                              f"{free / 2**30:.2f} GiB free; use at most {(free + existing) // bytes_per_block:,} blocks")
        self.fd, created = open_tier_file(path, protected)
        try:
            self._lock(path)
            os.set_blocking(self.fd, True)
            os.ftruncate(self.fd, 0)  # what an earlier run left is never read: its key is gone
            os.ftruncate(self.fd, size)  # sparse: blocks take disk space as they are written
            os.pwrite(self.fd, _HEADER.pack(TIER_MAGIC, num_blocks, bytes_per_block), 0)
        except BaseException as exc:
            self._release()
            if created:
                os.unlink(path)
            if isinstance(exc, OSError):
                raise EngineError(f"cannot size the disk tier file {path} to {size:,} bytes: "
                                  f"{exc.strerror or exc}") from None
            raise
        self.path = path
        self._key = os.urandom(32)  # this run's: a tag made by anyone else (or an earlier run) never matches
        self.tags: list[bytes | None] = [None] * num_blocks  # each slot's tag over (slot, cache key, bytes)
        self._tags_saved: dict[int, bytes | None] = {}
        self._writes_since_sync = 0
        self.num_corrupt = 0  # reads refused because the bytes did not match their tag (or could not be read)
        self.handed_over = False  # a newer engine of this process took the file over (see take_over)
        super().__init__(num_blocks, bytes_per_block)
        with _open_files_lock:
            _open_files[self._file_id] = weakref.ref(self)

    def _lock(self, path: str) -> None:
        """Hold the file for this tier: another process's engine is refused; an older tier of this process gives
        it up (the window's restart)."""
        info = os.fstat(self.fd)
        self._file_id = (info.st_dev, info.st_ino)
        with _open_files_lock:
            ref = _open_files.pop(self._file_id, None)
        older = ref() if ref is not None else None
        if older is not None:
            older.take_over()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DiskTierFileError(f"disk_tier_path {path} is in use by another engine's disk tier; give "
                                        "each engine a file of its own") from None
            raise

    def _release(self) -> None:
        os.close(self.fd)
        self.fd = -1

    def take_over(self) -> None:
        """A newer tier of this process uses the file from now on: this one lets go of its lock, and from now on
        reads nothing (its blocks are recomputed) and writes nothing (they are dropped)."""
        self.handed_over = True
        if self.fd >= 0:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except OSError:
                pass
        log.warning("disk tier: %s is taken over by a newer engine; this one stops using it", self.path)

    def offset(self, slot: int) -> int:
        """Where ``slot``'s bytes start in the file."""
        return HEADER_BYTES + slot * self.bytes_per_block

    def _tag(self, slot: int, block_hash: int, data) -> bytes:
        mac = hmac.new(self._key, _SLOT.pack(slot, block_hash & 0xFFFFFFFFFFFFFFFF), "sha256")
        mac.update(data)
        return mac.digest()

    def _write_raw(self, slot: int, data: np.ndarray, block_hash: int | None = None) -> None:
        if self.handed_over:
            raise OSError(errno.EBADF, "the disk tier file was taken over by a newer engine")
        buf = memoryview(np.ascontiguousarray(data, np.uint8)).cast("B")
        if self._saved is not None and slot not in self._tags_saved:
            self._tags_saved[slot] = self.tags[slot]
        self.tags[slot] = None  # until the write is whole, nothing it holds is trusted
        offset = self.offset(slot)
        written = os.pwrite(self.fd, buf, offset)
        while written < len(buf):  # a short write: go on where it stopped (0 bytes written is a full disk)
            more = os.pwrite(self.fd, buf[written:], offset + written)
            if more <= 0:
                raise OSError(28, "No space left on device (short write)")
            written += more
        if block_hash is not None:
            self.tags[slot] = self._tag(slot, block_hash, buf)
        self._writes_since_sync += 1
        if self._writes_since_sync >= FSYNC_EVERY:
            self.sync()

    def _read_raw(self, slot: int) -> np.ndarray | None:
        try:
            raw = os.pread(self.fd, self.bytes_per_block, self.offset(slot))
        except OSError as exc:
            log.warning("disk tier: reading slot %d failed (%s)", slot, exc)
            return None
        return np.frombuffer(raw, np.uint8).copy() if len(raw) == self.bytes_per_block else None

    def read(self, slot: int) -> np.ndarray | None:
        data = np.empty(self.bytes_per_block, np.uint8)
        return data if self.read_into(slot, data) else None

    def read_into(self, slot: int, out: np.ndarray) -> bool:
        """One ``preadv`` straight into ``out`` (no bytes object in between), then the tag."""
        n = -1
        if not self.handed_over:
            try:
                n = os.preadv(self.fd, [memoryview(out).cast("B")], self.offset(slot))
            except OSError as exc:
                log.warning("disk tier: reading slot %d failed (%s)", slot, exc)
        expected = self.tags[slot]
        if n != self.bytes_per_block or expected is None or not hmac.compare_digest(
                self._tag(slot, int(self.block_hash[slot]), memoryview(out).cast("B")), expected):
            self.num_corrupt += 1
            log.warning("disk tier: slot %d of %s failed its checksum (its tag); its tokens will be recomputed",
                        slot, self.path)
            return False
        return True

    def begin(self) -> None:
        super().begin()
        self._tags_saved = {}

    def end(self) -> None:
        super().end()
        self._tags_saved = {}

    def _restore_checksums(self, saved: dict) -> None:
        for slot, tag in self._tags_saved.items():
            self.tags[slot] = tag
        self._tags_saved = {}

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            log.warning("disk tier: fsync of %s failed (%s)", self.path, exc)
        self._writes_since_sync = 0

    def close(self) -> None:
        if self.fd >= 0:
            with _open_files_lock:
                ref = _open_files.get(self._file_id)
                if ref is not None and ref() is self:
                    del _open_files[self._file_id]
            self.sync()
            self._release()


Emit = Callable[..., None]  # KVCacheManager.emit(kind, conversation_id, **fields)


class TierStore:
    """The lower tiers that are on, top (host) to bottom (disk), and the moves between them.

    The only caller is :class:`engine.kv.manager.KVCacheManager`, which passes its ``emit`` so that every
    move is a block event in order with the device pool's own."""

    def __init__(self, host_blocks: int, disk_blocks: int, disk_path: str | None, bytes_per_block: int,
                 staging_blocks: int = 0, policy_factory=None, protected=()):
        """``policy_factory``: makes each tier's eviction policy (LRU without one).
        ``staging_blocks``: the most blocks one admission may load (or evict); two staging arrays of that many
        are allocated and touched now, as servers allocate their offload buffers at start, so that the first
        returning conversation does not pay the page faults (bounded by :data:`STAGING_KEEP_BYTES`).
        ``protected``: files the disk tier's path must not be (the model's)."""
        self.order: list[Tier] = []
        if host_blocks:
            self.order.append(HostTier(host_blocks, bytes_per_block))
        if disk_blocks:
            try:
                self.order.append(DiskTier(disk_blocks, bytes_per_block, disk_path, protected))
            except BaseException:
                for tier in self.order:  # the host tier made before it
                    tier.close()
                raise
        self.tiers = {t.name: t for t in self.order}
        for tier in self.order if policy_factory is not None else ():  # the device pool's policy, one per tier
            tier.use_policy(policy_factory())
        self.bytes_per_block = bytes_per_block
        self._staging_free: list[np.ndarray] = []  # staging arrays not lent out (reused: their pages are touched)
        self._staging_lent: list[np.ndarray] = []  # lent out until the transaction ends (end / rollback)
        self._staging_used = 0  # bytes of the last lent array handed out so far (the next lending goes on there)
        per = min(staging_blocks, STAGING_KEEP_BYTES // 2 // max(bytes_per_block, 1)) * bytes_per_block
        self.num_staging_made = 0  # staging arrays allocated (made at the start or, when those are lent, later)
        for _ in range(2 if per else 0):  # one for a load's bytes, one for what its evictions offload
            self.num_staging_made += 1
            buf = np.empty(per, np.uint8)
            buf.fill(0)  # touch the pages now
            self._staging_free.append(buf)
        self.num_offloaded = self.num_loaded = self.num_dropped = 0  # blocks moved (for metrics and benches)
        self._counters_saved: tuple | None = None
        for tier in self.order:  # every part made: the host tier's pages may start faulting in
            if isinstance(tier, HostTier):
                tier.populator.start()

    # ---- queries ----------------------------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> TierHit | None:
        """The highest tier holding ``block_hash`` (a cache key)."""
        for tier in self.order:
            slot = tier.lookup(block_hash)
            if slot is not None:
                return TierHit(tier.name, slot, block_hash, int(tier.group[slot]))
        return None

    def read(self, hit: TierHit) -> np.ndarray | None:
        """The bytes of a hit (a copy), or None when they failed their checksum."""
        return self.tiers[hit.tier].read(hit.slot)

    def read_into(self, hit: TierHit, out: np.ndarray) -> bool:
        """The bytes of a hit copied into ``out``; False when they failed their checksum."""
        return self.tiers[hit.tier].read_into(hit.slot, out)

    def staging(self, n: int) -> np.ndarray:
        """A uint8 [n, bytes_per_block] array for the bytes of one offload or load, lent until the transaction
        ends (the engine keeps an offload's copy as the rollback copy of the blocks it evicted). Reused across
        transactions: writing fresh pages costs more than the copy. Its contents are whatever was there.

        A lending goes on in the last array lent while it has room: a returning conversation's admission lends
        once for its loads and once for each eviction it makes (two, when it takes blocks for its loads and then
        for the rest), and those fit the two arrays made at the start instead of faulting a third in."""
        need = n * self.bytes_per_block
        if self._staging_lent and self._staging_lent[-1].size - self._staging_used >= need:
            buf, used = self._staging_lent[-1], self._staging_used
            self._staging_used = used + need
            return buf[used:used + need].reshape(n, self.bytes_per_block)
        for i, buf in enumerate(self._staging_free):
            if buf.size >= need:
                del self._staging_free[i]
                break
        else:
            buf = np.empty(need, np.uint8)
            self.num_staging_made += 1
        self._staging_lent.append(buf)
        self._staging_used = need
        return buf[:need].reshape(n, self.bytes_per_block)

    def _release_staging(self) -> None:
        """The transaction is over: nothing reads the lent arrays any more; keep the largest for reuse."""
        if not self._staging_lent:
            return
        kept, total = [], 0
        for buf in sorted(self._staging_free + self._staging_lent, key=lambda b: -b.size):
            if total + buf.size <= STAGING_KEEP_BYTES:
                kept.append(buf)
                total += buf.size
        self._staging_free, self._staging_lent, self._staging_used = kept, [], 0

    def holds_on_top(self, block_hash: int) -> bool:
        """Whether the top tier already holds ``block_hash`` (an offload of it then copies nothing)."""
        return bool(self.order) and self.order[0].lookup(block_hash) is not None

    def record(self, hit: TierHit):
        return self.tiers[hit.tier].records[hit.block_hash]

    def views(self) -> dict[str, TierView]:
        return {t.name: t.view() for t in self.order}

    # ---- moves ------------------------------------------------------------------------------------------------
    def offload(self, block_hash: int, record, read: Callable[[], np.ndarray], device_block: int, clock: int,
                emit: Emit, conversation_id: int = -1, group: int = 0) -> None:
        """A device block of KV cache ``group`` holding ``block_hash`` (its cache key) is about to be reused: keep
        its bytes (``read()``) in the top tier. A tier that already holds the key only marks it used (no copy).
        Events name the plain prefix hash and the group, as the device pool's own do."""
        if self.order:
            self._store(0, block_hash, record, read, device_block, "", clock, emit, conversation_id, group)

    def _store(self, index: int, block_hash: int, record, read: Callable[[], np.ndarray], device_block: int | None,
               source: str, clock: int, emit: Emit, cid: int, group: int = 0) -> bool:
        """Put a block into tier ``index``, making room first; False when it could not be kept there."""
        tier = self.order[index]
        slot = tier.lookup(block_hash)
        if slot is not None:
            tier.touch(slot, clock)
            return True
        slot = self._make_room(index, clock, emit, cid)
        if slot is None:
            return False
        data = read()
        if data is None:  # the bytes moving down failed their tag on the way (only a disk tier's can): dropped
            return False
        try:
            tier.write(slot, data, block_hash)
        except OSError as exc:  # only a disk tier writes to a device that can fail: drop the block, go on
            log.warning("%s tier: writing a block failed (%s); the block is dropped", tier.name, exc)
            return False
        tier.put(slot, block_hash, record, clock, group)
        self.num_offloaded += 1
        emit(EventKind.OFFLOADED, cid, tier=tier.name, block_hashes=(raw_hash(block_hash, group),), tier_slots=(slot,),
             block_ids=() if device_block is None else (device_block,), reason=source,
             parent_hash=record.parent_hash, token_ids=tuple(record.token_ids), group=group)
        return True

    def _make_room(self, index: int, clock: int, emit: Emit, cid: int) -> int | None:
        """A FREE slot of tier ``index``: a free one, or its least recently used block's, which moves on to the
        tier below (or is dropped at the bottom)."""
        tier = self.order[index]
        slot = tier.free_slot()
        if slot is not None:
            return slot
        slot = tier.victim()
        if slot is None:
            return None
        h, group = int(tier.block_hash[slot]), int(tier.group[slot])
        record = tier.records[h]
        moved = False
        if index + 1 < len(self.order):
            moved = self._store(index + 1, h, record, lambda: tier.read(slot), None, tier.name, clock, emit, cid,
                                group)
        tier.drop(slot, clock)
        self.num_dropped += 0 if moved else 1
        emit(EventKind.DROPPED, cid, tier=tier.name, block_hashes=(raw_hash(h, group),), tier_slots=(slot,),
             reason=self.order[index + 1].name if moved else "", group=group)
        return slot

    def loaded(self, hit: TierHit, device_block: int, clock: int, emit: Emit, cid: int) -> None:
        """A hit's bytes went into ``device_block``: the tier keeps its copy, now most recently used."""
        self.tiers[hit.tier].touch(hit.slot, clock)
        self.num_loaded += 1
        emit(EventKind.LOADED, cid, tier=hit.tier, block_hashes=(raw_hash(hit.block_hash, hit.group),),
             tier_slots=(hit.slot,), block_ids=(device_block,), group=hit.group)

    def drop_corrupt(self, hit: TierHit, clock: int, emit: Emit, cid: int) -> None:
        """A hit whose bytes failed their checksum: forget it (its tokens are recomputed)."""
        self.tiers[hit.tier].drop(hit.slot, clock)
        self.num_dropped += 1
        emit(EventKind.DROPPED, cid, tier=hit.tier, block_hashes=(raw_hash(hit.block_hash, hit.group),),
             tier_slots=(hit.slot,), group=hit.group)

    def clear(self, clock: int, emit: Emit) -> None:
        """Drop every block of every tier (a reset of the prefix cache)."""
        for tier in self.order:
            slots = list(tier._lru)
            if not slots:
                continue
            by_group: dict[int, list[int]] = {}  # one event per KV cache group (an event names one group)
            for s in slots:
                by_group.setdefault(int(tier.group[s]), []).append(s)
            held = {s: (int(tier.block_hash[s]), int(tier.group[s])) for s in slots}
            for s in slots:
                tier.drop(s, clock)
            self.num_dropped += len(slots)
            for group, members in sorted(by_group.items()):
                emit(EventKind.DROPPED, -1, tier=tier.name, block_hashes=tuple(raw_hash(*held[s]) for s in members),
                     tier_slots=tuple(members), group=group)

    def pin(self, hits) -> None:
        for hit in hits:
            self.tiers[hit.tier].pinned.add(hit.slot)

    def unpin(self) -> None:
        for tier in self.order:
            tier.pinned.clear()

    # ---- transactions -----------------------------------------------------------------------------------------
    def begin(self) -> None:
        self._counters_saved = (self.num_offloaded, self.num_loaded, self.num_dropped)
        for tier in self.order:
            tier.begin()

    def end(self) -> None:
        self.unpin()
        self._release_staging()
        for tier in self.order:
            tier.end()

    def rollback(self) -> None:
        self.unpin()
        self._release_staging()
        if self._counters_saved is not None:
            self.num_offloaded, self.num_loaded, self.num_dropped = self._counters_saved
        for tier in self.order:
            tier.rollback()
            tier.end()

    # ---- life -------------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for tier in self.order:
            tier.check_invariants()

    def fingerprint(self) -> tuple:
        """Everything a tier holds, bytes included (tests: equal before and after a failed operation)."""
        out = []
        for tier in self.order:
            held = np.flatnonzero(tier.state == BlockState.CACHED).tolist()
            contents = tuple(bytes(tier._read_raw(s)) for s in held)
            out.append((tier.name, tier.state.tobytes(), tier.block_hash.tobytes(), tier.group.tobytes(),
                        tier.last_access.tobytes(),
                        tuple(int(x) for x in np.argsort(tier.queued_at, kind="stable")), contents,
                        tuple(sorted(tier.records))))
        return tuple(out)

    def close(self) -> None:
        """Close every tier, each even when one before it failed to (the disk tier's sync and close must run)."""
        failure = None
        for tier in self.order:
            try:
                tier.close()
            except Exception as exc:  # noqa: BLE001 - raised below, once every tier was closed
                failure = failure or exc
        if failure is not None:
            raise failure
