"""Recordings: the pool stream on disk, one flushed frame at a time, so that a killed process leaves a file that opens.

Why this layout: a recording is written while the engine runs and may be cut off at any byte (the app is killed,
the disk fills). Every frame is length-prefixed and checksummed, and written and flushed as it comes, so a reader
knows exactly where the last complete frame ends and tells a cut-off file (opened up to that frame, and said so)
from a corrupt one (a clear error). The payloads are the pool stream's messages unchanged::

    magic         8 bytes   b"\\x89KVPOOL\\n"
    header        u32 length, u32 CRC-32, msgpack RecordingHeader   (little-endian)
    frame *       u32 length, u32 CRC-32, pool-stream message       (the first one a keyframe)

``open_recording`` indexes the file (events in memory, payloads left on disk and read when a frame is decoded), so
a recording may be far bigger than the history's memory budget.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import msgspec

from .history import History
from .poolstream import FORMAT_VERSION, Frame, Header, StreamDecoder, StreamError, check_frame, frame_of, read_head
from .views import PoolSnapshot

MAGIC = b"\x89KVPOOL\n"  # first bytes of every recording (non-ASCII first byte and a newline catch text-mode damage)
_PREFIX = struct.Struct("<II")  # length, CRC-32 of what follows
MAX_FRAME_BYTES = 1 << 30  # a frame longer than this is corruption, not a pool
WRITER = "paged-kv-explorer"


class RecordingError(StreamError):
    """A recording that cannot be written or read: foreign, corrupt, empty, from a newer format, or a bad path."""


class RecordingTruncated(RecordingError):
    """A recording that ends inside a frame (the writer was killed or the disk filled): raised by
    :func:`read_frames` and :func:`read_snapshots` after the last complete frame, so a script cannot take a
    cut-off file for a whole one (``truncated_ok=True`` stops quietly instead)."""

    def __init__(self, message: str, frames: int):
        super().__init__(message)
        self.frames = frames  # complete frames read before the cut


class RecordingFull(RecordingError):
    """Writing a recording failed because the disk (or the user's quota) is full."""


class RecordingHeader(msgspec.Struct, frozen=True):
    """What the file says about itself, before any frame."""

    format_version: int  # the pool stream's FORMAT_VERSION the frames use
    created: float  # Unix time the recording started
    writer: str  # program that wrote it
    pool: Header  # the first frame's pool header (source, blocks, block size, model, device, ...)


class _VersionPeek(msgspec.Struct):
    format_version: Any = None  # read first, leniently, so that a newer file is reported as newer


class _KeyHeader(msgspec.Struct, tag_field="kind", tag="keyframe"):
    header: Header  # the pool header of a keyframe body (the rest of the body is skipped)


_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(RecordingHeader)
_PEEK_DECODER = msgspec.msgpack.Decoder(_VersionPeek)
_KEY_HEADER_DECODER = msgspec.msgpack.Decoder(_KeyHeader)


# ---- writing -----------------------------------------------------------------------------------------------------
class Recorder:
    """A sink that writes every frame to ``path`` as it comes (written and flushed per frame).

    The first frame must be a keyframe: a recorder that joins a running stream is given ``start`` (the encoder's
    ``keyframe()``) first. Errors are RecordingErrors; after one the recorder writes nothing more."""

    def __init__(self, path: str | os.PathLike, *, start: Frame | None = None):
        self.path = os.fspath(path)  # where the recording goes (replaced if it exists)
        self.frames_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._last: Frame | None = None
        self._closed = False
        try:
            self._file = open(self.path, "wb")
        except OSError as exc:
            raise RecordingError(f"cannot write a recording to {self.path}: {exc.strerror or exc}") from None
        self._finalizer = weakref.finalize(self, self._file.close)
        if start is not None:
            self.write(start)

    def write(self, frame: Frame) -> None:
        check_frame(frame, "a Recorder writes")
        with self._lock:
            if self._closed:
                raise RecordingError(f"the recording {self.path} is closed")
            last = self._last
            if last is None:
                if not frame.keyframe:
                    raise RecordingError("a recording must start with a keyframe: give a recorder that joins a "
                                         "running stream the encoder's keyframe() first")
                header = self._header(frame)
            else:
                header = None
                if frame.stream_id != last.stream_id:
                    raise RecordingError("the stream changed (its source restarted): start a new recording")
                if frame.seq <= last.seq or (not frame.keyframe and frame.seq != last.seq + 1):
                    raise RecordingError(f"frame {frame.seq} does not follow frame {last.seq} of this recording")
            try:
                if header is not None:
                    self._file.write(MAGIC)
                    self._file.write(_PREFIX.pack(len(header), zlib.crc32(header)))
                    self._file.write(header)
                self._file.write(_PREFIX.pack(len(frame.payload), zlib.crc32(frame.payload)))
                self._file.write(frame.payload)
                self._file.flush()
            except OSError as exc:
                self._closed = True
                try:
                    self._file.close()
                except OSError:  # the buffered rest cannot be written either
                    pass
                if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                    raise RecordingFull(f"the disk is full: the recording {self.path} stopped after "
                                        f"{self.frames_written} frames") from None
                raise RecordingError(f"writing the recording {self.path} failed: {exc.strerror or exc}") from None
            self._last = frame
            self.frames_written += 1
            self.bytes_written += _PREFIX.size + len(frame.payload) + (
                0 if header is None else len(MAGIC) + _PREFIX.size + len(header))

    @staticmethod
    def _header(frame: Frame) -> bytes:
        try:
            pool = _KEY_HEADER_DECODER.decode(read_head(frame.payload).body).header
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RecordingError(f"the first frame is not a pool-stream keyframe: {exc}") from None
        return _HEADER_ENCODER.encode(RecordingHeader(FORMAT_VERSION, time.time(), WRITER, pool))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordingInfo:
    """What opening a recording found."""

    path: str  # the file
    header: RecordingHeader  # what the file says about itself
    num_frames: int  # complete frames
    num_bytes: int  # bytes of the file up to the end of the last complete frame
    file_bytes: int  # size of the file when it was opened
    truncated: bool  # the file ends inside a frame (the writer was killed): the frames before it opened
    note: str  # in words, for the window ("" when nothing is wrong)

    def error(self, message: str) -> "RecordingError":
        """An error about this recording (the History raises it without importing this module: no circle)."""
        return RecordingError(f"{self.path}: {message}")


class _Reader:
    """Reads payloads of an opened recording back from disk (one lock: the GUI and a trimming thread may ask)."""

    def __init__(self, path: str, file):
        self.path = path
        self._file = file
        self._lock = threading.Lock()

    def read(self, offset: int, length: int, crc: int) -> bytes:
        with self._lock:
            if self._file.closed:
                raise RecordingError(f"the recording {self.path} has been closed")
            self._file.seek(offset)
            data = self._file.read(length)
        if len(data) != length or zlib.crc32(data) != crc:
            raise RecordingError(f"the recording {self.path} changed on disk since it was opened")
        return data

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _DiskFrame:
    """A frame of an opened recording: envelope in memory, payload read from the file when it is decoded."""

    __slots__ = ("seq", "step_id", "keyframe", "events", "stream_id", "bridged", "_reader", "_offset", "_length",
                 "_crc")

    def __init__(self, head, reader: _Reader, offset: int, length: int, crc: int):
        self.seq, self.step_id, self.keyframe = head.seq, head.step_id, head.keyframe
        self.events, self.stream_id, self.bridged = head.events, head.stream_id, bool(head.bridge)
        self._reader, self._offset, self._length, self._crc = reader, offset, length, crc

    @property
    def payload(self) -> bytes:
        return self._reader.read(self._offset, self._length, self._crc)

    @property
    def nbytes(self) -> int:
        return self._length


def _open_regular(path: str):
    """``path`` opened for reading, if it is a regular file; RecordingError otherwise. Opened without blocking, so
    that a FIFO (or a device) is refused instead of waiting forever for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise RecordingError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecordingError(f"cannot open {path}: not a regular file (a pipe, a device or a folder is not a "
                                 "recording)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    return data if data is not None else b""


def _open_header(path: str, f, size: int) -> tuple[RecordingHeader, int]:
    """The file header and the offset of the first frame; RecordingError for a file that is not a recording."""
    if size == 0:
        raise RecordingError(f"{path} is empty: nothing was recorded (the recording app stopped before the first "
                             "frame)")
    magic = _read_exact(f, len(MAGIC))
    if magic != MAGIC[:len(magic)] or (len(magic) == len(MAGIC) and magic != MAGIC):
        raise RecordingError(f"{path} is not a pool-stream recording (it starts with {magic[:8]!r}, not {MAGIC!r})")
    prefix = _read_exact(f, _PREFIX.size)
    if len(magic) < len(MAGIC) or len(prefix) < _PREFIX.size:
        raise RecordingError(f"{path} ends inside its header ({size} bytes): it was cut off before the first frame")
    length, crc = _PREFIX.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise RecordingError(f"{path} has a corrupt header (it claims {length} bytes)")
    raw = _read_exact(f, min(length, max(0, size - len(MAGIC) - _PREFIX.size)))  # never more than the file holds
    if len(raw) < length:
        raise RecordingError(f"{path} ends inside its header ({size} bytes): it was cut off before the first frame")
    if zlib.crc32(raw) != crc:
        raise RecordingError(f"{path} has a corrupt header (checksum mismatch)")
    try:
        version = _PEEK_DECODER.decode(raw).format_version
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise RecordingError(f"{path} has a corrupt header (not a recording header)") from None
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise RecordingError(f"{path} was written in pool-stream format {version}, newer than this program reads "
                             f"(up to {FORMAT_VERSION}); update the explorer to open it")
    try:
        header = _HEADER_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordingError(f"{path} has a corrupt header ({exc})") from None
    return header, len(MAGIC) + _PREFIX.size + length


def _scan(path: str, f, size: int, offset: int) -> Iterator[tuple[int, int, int, bytes | None, str]]:
    """(offset, length, crc, payload or None, note): each complete frame, then (..., None, why it stopped) if the
    file ends inside one. RecordingError for a corrupt frame."""
    index = 0
    while offset < size:
        prefix = _read_exact(f, _PREFIX.size)
        if len(prefix) < _PREFIX.size:
            yield offset, 0, 0, None, f"the file ends inside the length of frame {index} (byte {offset} of {size})"
            return
        length, crc = _PREFIX.unpack(prefix)
        if length > MAX_FRAME_BYTES:
            raise RecordingError(f"{path}: frame {index} at byte {offset} is corrupt (it claims {length} bytes)")
        payload = _read_exact(f, min(length, size - offset - _PREFIX.size))  # never more than the file holds
        if len(payload) < length:
            if _frame_follows(f, offset + _PREFIX.size, size):  # not a cut: the length field itself is damaged
                raise RecordingError(f"{path}: frame {index} at byte {offset} is corrupt (its length field claims "
                                     f"{length} bytes, past the end of the file, yet complete frames follow it)")
            yield offset, length, crc, None, (f"the file ends inside frame {index} (byte {offset + _PREFIX.size + len(payload)} "
                                              f"of {offset + _PREFIX.size + length})")
            return
        if zlib.crc32(payload) != crc:
            raise RecordingError(f"{path}: frame {index} at byte {offset} is corrupt (checksum mismatch)")
        yield offset + _PREFIX.size, length, crc, payload, ""
        offset += _PREFIX.size + length
        index += 1


_FRAME_START = b"kvpool"  # a pool-stream message starts with an array header, then this string (after its 0xa6)


def _frame_follows(f, start: int, size: int) -> bool:
    """Whether a complete frame (length, CRC and payload that match, a pool-stream message) starts anywhere in the
    file from ``start`` on: what tells a damaged length field from a file cut off inside its last frame (whose
    remaining bytes hold no complete frame). Only asked once, where the file seems to end early."""
    chunk, pos = 4 << 20, start
    while pos < size:
        f.seek(pos)
        data = f.read(chunk + 16)
        at = data.find(_FRAME_START)
        while at != -1:
            frame_at = pos + at - 2 - _PREFIX.size  # the message starts 2 bytes before the string; its prefix before
            if frame_at >= start:
                f.seek(frame_at)
                prefix = f.read(_PREFIX.size)
                if len(prefix) == _PREFIX.size:
                    length, crc = _PREFIX.unpack(prefix)
                    if frame_at + _PREFIX.size + length <= size and length <= MAX_FRAME_BYTES:
                        if zlib.crc32(f.read(length)) == crc:
                            return True
            at = data.find(_FRAME_START, at + 1)
        pos += chunk
    return False


def open_recording(path: str | os.PathLike) -> History:
    """A read-only History of the recording at ``path`` (its ``recording`` attribute says what was found).

    RecordingError, with a message for the user, for a missing, empty, foreign, corrupt or newer-format file; a
    file cut off inside a frame opens up to its last complete frame, with ``recording.truncated`` set."""
    path = os.fspath(path)
    f = _open_regular(path)
    try:
        size = os.fstat(f.fileno()).st_size
        header, offset = _open_header(path, f, size)
        reader = _Reader(path, f)
        history = History()
        frames, note, end, last = 0, "", offset, None
        for at, length, crc, payload, why in _scan(path, f, size, offset):
            if payload is None:
                note = why
                break
            try:
                head = read_head(payload)
            except StreamError as exc:
                raise RecordingError(f"{path}: frame {frames} at byte {at} is corrupt: {exc}") from None
            if last is None:
                _check_first(path, header, head)
            if last is not None and (head.stream_id != last.stream_id or head.seq <= last.seq or head.step_id <
                                     last.step_id or (not head.keyframe and head.seq != last.seq + 1)):
                raise RecordingError(f"{path}: frame {frames} at byte {at} does not follow the frame before it "
                                     "(corrupt recording)")
            frame = _DiskFrame(head, reader, at, length, crc)
            history._append(frame)
            last, frames, end = frame, frames + 1, at + length
        if frames == 0:
            raise RecordingError(f"{path} holds no complete frame ({note or 'it has only a header'}): nothing was "
                                 "recorded before it was cut off")
    except BaseException:
        f.close()
        raise
    truncated = bool(note)
    text = (f"{os.path.basename(path)} was cut off ({note}); opened its {frames} complete frames" if truncated else "")
    history.read_only = True
    history.recording = RecordingInfo(path, header, frames, end, size, truncated, text)
    history._closer = weakref.finalize(history, reader.close)
    return history


def read_frames(path: str | os.PathLike, *, truncated_ok: bool = False) -> Iterator[Frame]:
    """Every complete frame of a recording, in order (for scripts). A corrupt frame raises RecordingError naming
    it; a file cut off inside a frame raises :class:`RecordingTruncated` after the last complete one, unless
    ``truncated_ok`` (then it stops quietly)."""
    path = os.fspath(path)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        header, offset = _open_header(path, f, size)
        index = 0
        for at, _length, _crc, payload, why in _scan(path, f, size, offset):
            if payload is None:
                if truncated_ok:
                    return
                raise RecordingTruncated(f"{path} was cut off ({why}) after {index} complete frames", index)
            try:
                head = read_head(payload)
            except StreamError as exc:
                raise RecordingError(f"{path}: frame {index} at byte {at} is corrupt: {exc}") from None
            if index == 0:
                _check_first(path, header, head)
            index += 1
            yield frame_of(head, payload)


def read_snapshots(path: str | os.PathLike, *, truncated_ok: bool = False) \
        -> Iterator[tuple[int, PoolSnapshot, tuple]]:
    """(seq, snapshot, events) of every complete frame of a recording, decoded and checked in order (for
    scripts). A frame that is corrupt or describes a pool that cannot exist raises RecordingError naming it; a
    cut-off file raises :class:`RecordingTruncated` after the last complete frame, unless ``truncated_ok``."""
    decoder = StreamDecoder()
    for index, frame in enumerate(read_frames(path, truncated_ok=truncated_ok)):
        try:
            snapshot, events, seq = decoder.feed(frame.payload)
        except StreamError as exc:
            raise RecordingError(f"{os.fspath(path)}: frame {index} (seq {frame.seq}) is corrupt: {exc}") from None
        yield seq, snapshot, events


def check_recording(path: str | os.PathLike) -> RecordingInfo:
    """Decode and check every frame of the recording at ``path`` (headless ``--open``): RecordingError naming the
    first corrupt frame or impossible pool; what was found otherwise (``truncated`` for a cut-off file)."""
    path = os.fspath(path)
    frames = 0
    truncated, note = False, ""
    try:
        for frames, _ in enumerate(read_snapshots(path), 1):
            pass
    except RecordingTruncated as exc:
        truncated, note, frames = True, str(exc), exc.frames
        if frames == 0:
            raise RecordingError(f"{path} holds no complete frame ({exc}): nothing was recorded before it was cut "
                                 "off") from None
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        header, _ = _open_header(path, f, size)
    return RecordingInfo(path, header, frames, size, size, truncated, note)


def _check_first(path: str, header: RecordingHeader, head) -> None:
    """The file header must agree with the first frame: a keyframe with the same pool header."""
    if not head.keyframe:
        raise RecordingError(f"{path}: the first frame is not a keyframe (corrupt recording)")
    try:
        pool = _KEY_HEADER_DECODER.decode(head.body).header
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordingError(f"{path}: frame 0 is corrupt: {exc}") from None
    if pool != header.pool:
        raise RecordingError(f"{path}: the file header describes another pool than its first frame ("
                             f"{header.pool.num_blocks} blocks of {header.pool.block_size} slots against "
                             f"{pool.num_blocks} of {pool.block_size}): corrupt recording")
