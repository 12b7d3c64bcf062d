"""Follow the KV-event streams of one or several serving instances and keep a content index of each.

Per endpoint: a SUB socket for the live stream and, if the publisher has one, a DEALER socket to its replay ROUTER
(a REQ socket would do for one request only: vLLM streams many replies to each). When the live socket first
connects, the follower asks for everything from sequence 0 (not before: a watcher started before its server would
otherwise be answered by nobody, give up, and miss what the server published before its first live batch reached
us); a first replay that does not answer is asked again a few times (the server may still be binding it). Afterwards
the sequence numbers tell it when something went missing, and it asks for exactly that. What no replay can give back
(older than the publisher's buffer, or no replay socket) is counted as lost, and the window says so. A live sequence
number lower than one already applied, with different contents, means the publisher restarted: the index starts
over.

Nothing a publisher sends can crash the follower: malformed messages are counted and skipped (any exception while
handling one, too, with the last error kept); an odd event is dropped and counted, the rest of its batch kept. A
batch numbered far beyond the next one expected (``MAX_JUMP``) is not believed on its own: it is set aside and
counted, and only a run of consecutive batches from there (``FUTURE_CONFIRM``) makes the follower treat the stream
as a new one (the index starts over), so one forged or corrupt sequence number can neither freeze the view nor count
billions of batches lost. ZMQ reconnects by itself; a reconnect triggers a catch-up replay. One thread owns every
socket; the GUI polls :meth:`status` and reads the indexes (which are thread-safe).
"""
from __future__ import annotations

import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstream.curve import CurveError, apply_client
from kvstream.kv_events.codec import END_SEQ, KVEventDecodeError, KVEventError, decode_batch_report, parse_frames, \
    seq_bytes
from kvstream.endpoints import EndpointError
from kvstream.kv_events.endpoint import KVEventEndpoint, checked_endpoint, parse_endpoint_spec, usable
from kvstream.kv_events.index import KVCacheIndex

CONNECTING = "connecting"  # never connected yet
RECONNECTING = "reconnecting"  # was connected, lost the connection; ZMQ is retrying
CATCHING_UP = "catching up"  # waiting for a replay to fill a gap (or the initial catch-up)
LIVE = "live"  # connected, and a message came within silent_after_s
SILENT = "silent"  # connected, but nothing came for silent_after_s (an idle server is silent too)
FAILED = "failed"  # the address could not be used at all (last_error says why); nothing is retried


@dataclass(frozen=True)
class EndpointStatus:
    """How following one endpoint is going, as the window shows it."""

    label: str  # the instance's label (KVEventEndpoint.label)
    state: str  # CONNECTING | RECONNECTING | CATCHING_UP | LIVE | SILENT | FAILED
    connected: bool  # the SUB socket is connected now
    silent_for_s: float | None  # seconds since the last message (since connecting, if none yet); None unconnected
    last_seq: int | None  # sequence number of the last applied batch
    num_batches: int  # batches applied
    num_replayed: int  # batches that came through the replay socket (catch-up and gap fills)
    num_lost: int  # batches nobody could give back: older than the replay buffer, or no replay socket
    num_malformed: int  # messages counted and skipped because they could not be read
    num_unknown_events: int  # events of a type this reader does not know, skipped
    num_restarts: int  # times the publisher restarted (sequence went back) and the index started over
    num_disconnects: int  # times the connection dropped
    replay_answering: bool | None  # the replay socket answered its last request; None: none or not asked yet
    last_error: str | None  # the last problem, in words
    num_odd_events: int = 0  # events dropped from their batch because they could not be read (the rest kept)
    num_future: int = 0  # batches numbered implausibly far ahead, set aside and not believed

    @property
    def text(self) -> str:
        """One line: state first, then what went wrong, e.g. "live · seq 41 · lost 3 batches"."""
        if self.state == FAILED:
            return f"failed: {self.last_error}"
        if self.state == SILENT and self.silent_for_s is not None:
            parts = [f"silent for {self.silent_for_s:.0f} s"]
        else:
            parts = [self.state]
        if self.last_seq is not None:
            parts.append(f"seq {self.last_seq}")
        if self.num_lost:
            parts.append(f"lost {self.num_lost} batch{'es' if self.num_lost != 1 else ''}")
        if self.num_malformed:
            parts.append(f"{self.num_malformed} malformed message{'s' if self.num_malformed != 1 else ''} skipped")
        if self.num_odd_events:
            parts.append(f"{self.num_odd_events} odd event{'s' if self.num_odd_events != 1 else ''} skipped")
        if self.num_future:
            parts.append(f"{self.num_future} batch{'es' if self.num_future != 1 else ''} from the future ignored")
        if self.num_restarts:
            parts.append(f"publisher restarted {self.num_restarts}x")
        if self.replay_answering is False:
            parts.append("replay socket not answering")
        return " · ".join(parts)


class _Follower:
    """One endpoint: its sockets, where its sequence stands, and the batches waiting for a gap to close."""

    RECENT = 20_000  # applied (seq, payload hash) kept to tell a duplicate from a restarted publisher (a live
    #                  duplicate is never older than the live backlog a replay overtook)
    MAX_PENDING = 100_000  # live batches held while a gap is open; past that the gap is declared lost
    MAX_RETRIES = 3  # replays asked for one gap before it is declared lost
    FIRST_REPLAY_TRIES = 3  # times the first replay is asked before the replay socket is called not answering
    MAX_JUMP = 1 << 20  # a batch this far past the next expected one is not believed on its own (a busy server
    #                     publishes about 50 batches a second: this is hours; a real jump that big is a new stream)
    FUTURE_CONFIRM = 3  # consecutive far-ahead batches that make it a new stream

    def __init__(self, ctx: zmq.Context, endpoint: KVEventEndpoint, index: KVCacheIndex,
                 replay_timeout_s: float) -> None:
        self.ep, self.index, self.ctx, self.replay_timeout_s = endpoint, index, ctx, replay_timeout_s
        self.sub = self.monitor = self.dealer = None
        self.sockets_changed = True  # the poller must be rebuilt
        self.next_seq: int | None = 0 if endpoint.replay_endpoint else None  # next batch to apply
        self.pending: dict[int, bytes] = {}  # seq -> payload received ahead of next_seq
        self.recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash(payload) of recently applied batches
        self.replay_start: int | None = None  # start seq of the replay in flight; None when none
        self.replay_deadline = 0.0
        self.replay_first: int | None = None  # first seq the replay in flight returned
        self.retries = 0
        self.probe: int | None = None  # seq the replay in flight must return unchanged (after a reconnect)
        self.replay_again = False  # a restart came during a replay: replay from 0 when it ends
        self.connected = self.ever_connected = False
        self.connected_at = self.last_message = None
        self.num_replayed = self.num_lost = self.num_malformed = self.num_unknown = 0
        self.num_restarts = self.num_disconnects = 0
        self.num_odd_events = self.num_future = 0
        self.first_replay_tries = 0
        self.future: OrderedDict[int, bytes] = OrderedDict()  # far-ahead batches set aside (bounded)
        self.replay_answering: bool | None = None
        self.last_error: str | None = None

    # ----- sockets -----
    def open(self) -> None:
        try:
            usable(self.ep)
        except EndpointError as exc:  # said for this endpoint; the others are followed
            self.last_error = f"cannot connect to {self.ep.endpoint} (replay {self.ep.replay_endpoint}): {exc}"
            return
        try:
            self.sub = self.ctx.socket(zmq.SUB)
            for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 100_000), (zmq.RECONNECT_IVL, 100),
                               (zmq.RECONNECT_IVL_MAX, 2000)):
                self.sub.setsockopt(opt, value)
            self.sub.setsockopt(zmq.SUBSCRIBE, self.ep.topic.encode())
            if self.ep.curve:
                apply_client(self.sub, self.ep.curve)
            self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self.sub.connect(self.ep.endpoint)
            if self.ep.replay_endpoint:
                self._new_dealer()  # the first replay is asked when the live socket connects (on_monitor)
        except (zmq.ZMQError, CurveError) as exc:
            self.last_error = f"cannot connect to {self.ep.endpoint} (replay {self.ep.replay_endpoint}): {exc}"
            self.close()

    def _new_dealer(self) -> None:
        if self.dealer is not None:
            self.dealer.close(linger=0)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer; never drop part
        if self.ep.curve:
            apply_client(self.dealer, self.ep.curve)
        self.dealer.connect(self.ep.replay_endpoint)
        self.sockets_changed = True

    def close(self) -> None:
        if self.sub is not None:
            try:
                self.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self.monitor, self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.monitor = self.dealer = None
        self.sockets_changed = True

    # ----- what arrives -----
    def on_monitor(self) -> None:
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            reconnect = self.ever_connected
            self.connected = self.ever_connected = True
            self.connected_at = time.monotonic()
            if not reconnect and self.dealer is not None and self.replay_start is None:
                # First contact: whatever the server published before our subscription landed (all of it, for a
                # watcher started before its server) is only in its replay buffer.
                self._request_replay(self.next_seq if self.next_seq is not None else 0)
            elif reconnect and self.dealer is not None and self.replay_start is None and self.next_seq:
                # Catch up on what passed while disconnected, starting one back: the same publisher returns the
                # batch we applied last, unchanged; a restarted one returns another batch there, or nothing.
                self.probe = self.next_seq - 1
                self._request_replay(self.probe)
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            self.connected = False
            self.num_disconnects += 1

    def on_live(self, frames: list[bytes]) -> None:
        self.last_message = time.monotonic()
        try:
            _topic, seq, payload = parse_frames(frames)
        except KVEventDecodeError as exc:
            self._malformed(exc)
            return
        self._offer(seq, payload, live=True)

    def on_replay(self, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":
            frames = frames[1:]  # the envelope delimiter our request carried
        if self.replay_start is None:
            return  # a late answer to a request given up on
        if len(frames) == 3 and frames[1] == END_SEQ:
            self._replay_done()
            return
        try:
            _topic, seq, payload = parse_frames(frames)
        except KVEventDecodeError as exc:
            self._malformed(exc)
            return
        if self.replay_first is None:
            self.replay_first = seq
        if self.next_seq is not None and seq < self.next_seq:
            if seq in self.recent and self.recent[seq] != hash(payload):
                self._restart()  # the publisher now has another batch under a number we applied
            return
        self.num_replayed += 1
        self._offer(seq, payload, live=False)

    def tick(self, now: float) -> None:
        """Give up a replay that did not answer in time: what it should have filled is lost. The first replay is
        asked again a few times first (the server may be starting: its replay socket not bound yet)."""
        if self.replay_start is not None and now > self.replay_deadline and self.replay_answering is None \
                and self.first_replay_tries + 1 < self.FIRST_REPLAY_TRIES:
            self.first_replay_tries += 1
            start = self.replay_start
            self.last_error = (f"replay socket {self.ep.replay_endpoint} did not answer in {self.replay_timeout_s} s "
                               f"(try {self.first_replay_tries} of {self.FIRST_REPLAY_TRIES}); asking again")
            self._new_dealer()
            self._request_replay(start)
            return
        if self.replay_start is not None and now > self.replay_deadline:
            self.replay_answering = False
            self.last_error = f"replay socket {self.ep.replay_endpoint} did not answer in {self.replay_timeout_s} s"
            self.replay_start, self.probe, self.replay_again = None, None, False
            self._new_dealer()  # drop the queued request: a late answer must not arrive as if it were new
            self._give_up_gap()

    # ----- sequence bookkeeping -----
    def _offer(self, seq: int, payload: bytes, live: bool) -> None:
        if self.next_seq is None:  # no replay socket: the stream starts wherever we joined it
            if seq > self.MAX_JUMP:  # not believed as the count of batches before: say it, count nothing
                self.last_error = f"joined at seq {seq} (no replay socket); what came before is unknown"
            else:
                self.num_lost += seq
                if seq:
                    self.last_error = f"joined at seq {seq}; the {seq} batches before are unknown (no replay socket)"
            self.next_seq = seq
        if seq > self.next_seq + self.MAX_JUMP:
            self._from_the_future(seq, payload)
            return
        self.future.clear()  # the stream goes on where we expect it: what was set aside was not it
        if seq < self.next_seq:
            if live and self.recent.get(seq) != hash(payload):
                self._restart(seq, payload)  # not what we applied under that number: a new publisher
            return  # a duplicate (replay and live overlap)
        if seq > self.next_seq:
            self.pending[seq] = payload
            if len(self.pending) > self.MAX_PENDING:
                self._give_up_gap()
            elif self.replay_start is None:
                if self.dealer is not None:
                    self._request_replay(self.next_seq)
                else:
                    self._give_up_gap()
            return
        self._apply(seq, payload)
        self._drain()

    def _from_the_future(self, seq: int, payload: bytes) -> None:
        """A batch numbered implausibly far ahead: set it aside; a run of FUTURE_CONFIRM consecutive ones is a new
        stream (the publisher's numbering moved on for good), anything less was noise."""
        self.future[seq] = payload
        while len(self.future) > self.FUTURE_CONFIRM:
            self.future.popitem(last=False)
        start = seq
        while start - 1 in self.future:
            start -= 1
        if seq - start + 1 < self.FUTURE_CONFIRM:
            self.num_future += 1
            self.last_error = (f"ignored a batch numbered {seq}, far beyond the next expected ({self.next_seq}); "
                               f"not believed unless the stream goes on from there")
            return
        run = [(s, self.future[s]) for s in range(start, seq + 1)]
        self.num_future -= len(run) - 1  # they were the stream after all
        self.future.clear()
        self.num_restarts += 1
        self.last_error = f"the stream jumped from seq {self.next_seq} to {start}; the index starts over from there"
        self.index.reset()
        self.pending.clear()
        self.recent.clear()
        self.retries, self.probe = 0, None
        self.next_seq = start
        for s, p in run:
            self._apply(s, p)

    def _request_replay(self, start: int) -> None:
        self.dealer.send_multipart((b"", seq_bytes(start)))  # [delimiter, seq]: what vLLM's ROUTER expects
        self.replay_start, self.replay_first = start, None
        self.replay_deadline = time.monotonic() + self.replay_timeout_s

    def _replay_done(self) -> None:
        first, self.replay_start = self.replay_first, None
        self.replay_answering = True
        probe, self.probe = self.probe, None
        if self.replay_again:
            self.replay_again = False
            self._request_replay(0)
            return
        self.first_replay_tries = 0
        if probe is not None and (first is None or first > probe):
            self._restart()  # the batch we applied last is not there: a new publisher with a shorter history
            return
        if not self.pending or min(self.pending) <= self.next_seq:
            self._drain()
            self.retries = 0
            return
        if first is not None and first > self.next_seq:
            # The buffer starts after what we need: the rest is gone for good.
            self.last_error = f"batches {self.next_seq}..{first - 1} are older than the replay buffer"
            self._give_up_gap()
            return
        self.retries += 1  # the missing batches were published after the replay was answered: ask again
        if self.retries <= self.MAX_RETRIES:
            self._request_replay(self.next_seq)
        else:
            self._give_up_gap()

    def _give_up_gap(self) -> None:
        self.retries = 0
        if not self.pending:
            return
        first = min(self.pending)
        if first > self.next_seq:
            self.num_lost += first - self.next_seq
            self.next_seq = first
        self._drain()

    def _drain(self) -> None:
        for seq in [s for s in self.pending if s < self.next_seq]:
            del self.pending[seq]
        while self.next_seq in self.pending:
            self._apply(self.next_seq, self.pending.pop(self.next_seq))

    def _restart(self, seq: int | None = None, payload: bytes | None = None) -> None:
        """The publisher restarted: forget its old history and follow the new one from its start (``seq`` and
        ``payload``: the live batch that told us, kept to be applied in order)."""
        self.num_restarts += 1
        self.last_error = "the publisher restarted (its sequence numbers began again); the index starts over"
        self.index.reset()
        self.pending.clear()
        self.recent.clear()
        self.retries = 0
        self.probe = None
        if self.dealer is not None:
            self.next_seq = 0
            if seq is not None:
                self.pending[seq] = payload
            if self.replay_start is None:
                self._request_replay(0)
            else:
                self.replay_again = True  # one reply at a time: ask once the one in flight has ended
        else:
            self.next_seq = None
            if seq is not None:
                self._offer(seq, payload, live=True)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.recent[seq] = hash(payload)
        if len(self.recent) > self.RECENT:
            self.recent.popitem(last=False)
        try:
            report = decode_batch_report(payload)
        except KVEventDecodeError as exc:
            self._malformed(exc)
            return
        self.num_unknown += report.unknown
        if report.odd:
            self.num_odd_events += len(report.odd)
            self.last_error = f"odd event skipped, the rest of batch {seq} kept: {report.odd[-1]}"
        self.index.apply_batch(report.batch, seq)

    def _malformed(self, exc: BaseException) -> None:
        self.num_malformed += 1
        what = str(exc) if isinstance(exc, KVEventDecodeError) else f"{type(exc).__name__}: {exc}"
        self.last_error = f"malformed message skipped: {what[:300]}"

    def status(self, now: float, silent_after_s: float) -> EndpointStatus:
        since = self.last_message if self.last_message is not None else self.connected_at
        silent_for = None if since is None or not self.connected else now - since
        if self.sub is None:
            state = FAILED
        elif not self.connected:
            state = RECONNECTING if self.ever_connected else CONNECTING
        elif self.replay_start is not None:
            state = CATCHING_UP
        elif silent_for is not None and silent_for >= silent_after_s:
            state = SILENT
        else:
            state = LIVE
        return EndpointStatus(
            label=self.ep.label, state=state, connected=self.connected, silent_for_s=silent_for,
            last_seq=self.index.last_seq, num_batches=self.index.num_batches, num_replayed=self.num_replayed,
            num_lost=self.num_lost, num_malformed=self.num_malformed, num_unknown_events=self.num_unknown,
            num_restarts=self.num_restarts, num_disconnects=self.num_disconnects,
            replay_answering=self.replay_answering, last_error=self.last_error,
            num_odd_events=self.num_odd_events, num_future=self.num_future)


class KVEventSubscriber:
    """Follows one or several KV-event endpoints on a thread of its own, one :class:`KVCacheIndex` each.

    Why one thread for all: ZMQ sockets belong to one thread, and one poll over every socket is cheaper than a
    thread per endpoint; the GUI never touches a socket, it reads :attr:`indexes` and :meth:`status`."""

    POLL_MS = 50  # longest wait in the loop (bounds how stale status() is and how fast stop() returns)

    def __init__(self, endpoints: Sequence[KVEventEndpoint | str], *, silent_after_s: float = 5.0,
                 replay_timeout_s: float = 3.0) -> None:
        if isinstance(endpoints, (str, KVEventEndpoint)):
            endpoints = [endpoints]
        resolved: list[KVEventEndpoint] = []
        for ep in endpoints:
            if isinstance(ep, str):
                resolved.extend(parse_endpoint_spec(ep))
            elif isinstance(ep, KVEventEndpoint):
                resolved.append(checked_endpoint(ep))
            else:
                raise KVEventError(f"an endpoint must be a KVEventEndpoint or a spec string, not {ep!r}")
        if not resolved:
            raise KVEventError("give at least one KV-event endpoint to follow")
        for name, value in (("silent_after_s", silent_after_s), ("replay_timeout_s", replay_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise KVEventError(f"{name} must be a positive number of seconds, not {value!r}")
        self.endpoints = tuple(resolved)  # what is followed, in order
        self.indexes = tuple(KVCacheIndex(ep.label) for ep in resolved)  # one content index per endpoint
        self.silent_after_s = float(silent_after_s)
        self.replay_timeout_s = float(replay_timeout_s)
        self.failure: str | None = None  # traceback if the thread died (it should not); the window shows it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status = tuple(EndpointStatus(ep.label, CONNECTING, False, None, None, 0, 0, 0, 0, 0, 0, 0, None, None)
                             for ep in resolved)

    def start(self) -> KVEventSubscriber:
        """Start following (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close every socket; the indexes keep what they hold."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """The thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> tuple[EndpointStatus, ...]:
        """Each endpoint's status, at most POLL_MS old."""
        return self._status

    def _run(self) -> None:
        ctx = zmq.Context()
        followers = [_Follower(ctx, ep, index, self.replay_timeout_s) for ep, index in zip(self.endpoints,
                                                                                          self.indexes)]
        poller = zmq.Poller()
        try:
            for f in followers:
                f.open()
            while not self._stop.is_set():
                if any(f.sockets_changed for f in followers):
                    poller = zmq.Poller()
                    for f in followers:
                        for sock in (f.sub, f.monitor, f.dealer):
                            if sock is not None:
                                poller.register(sock, zmq.POLLIN)
                        f.sockets_changed = False
                ready = dict(poller.poll(self.POLL_MS))
                for f in followers:
                    self._serve(f, ready)
                now = time.monotonic()
                self._status = tuple(f.status(now, self.silent_after_s) for f in followers)
        except Exception:  # a bug, not bad input (that is handled per message): report it, do not vanish
            self.failure = traceback.format_exc()
        finally:
            for f in followers:
                f.close()
            ctx.term()

    @staticmethod
    def _serve(f: _Follower, ready: dict) -> None:
        if f.monitor is not None and f.monitor in ready:
            while f.monitor.poll(0):
                try:
                    f.on_monitor()
                except Exception as exc:  # noqa: BLE001
                    f.last_error = f"connection event not understood: {type(exc).__name__}: {exc}"
        for sock, handle in ((f.dealer, f.on_replay), (f.sub, f.on_live)):
            if sock is None or sock not in ready:
                continue
            for _ in range(10_000):  # bounded, so one busy endpoint cannot starve the others
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    handle(frames)
                except Exception as exc:  # noqa: BLE001 -- whatever a message does, the watcher goes on
                    f._malformed(exc)
        try:
            f.tick(time.monotonic())
        except Exception as exc:  # noqa: BLE001
            f._malformed(exc)
