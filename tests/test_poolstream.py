"""The pool stream: encoder -> decoder and History rebuild exactly the engine's snapshots; bad input is refused
with a clear message and changes nothing."""
from __future__ import annotations

import dataclasses
import random
import threading
from types import MappingProxyType

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import poolstream as ps
from kvstream.poolstream import decode as ps_decode
from kvstream.poolstream import schema as ps_schema
from kvstream.events import BlockEvent, EventKind
from kvstream.history import History
from kvstream.poolstream import (FORMAT_VERSION, Frame, StreamDecoder, StreamEncoder, StreamError, encode_keyframe,
                                 read_head)
from kvstream.views import ConversationInfo, EngineMetrics, FinishReason, MemoryStats, PoolSnapshot, Status
from tests.poolstream_helpers import (assert_same_snapshot, assert_scrubs_forward_through_bridges,
                                      count_keyframe_decodes, encode_all, workload, workload_updates)


# ---- round trips against the real engine -------------------------------------------------------------------------
def test_workload_exercises_every_kind_of_change():
    snaps = workload()
    last = snaps[-1][0].metrics
    assert last.num_preemptions > 0 and last.num_cow_copies > 0 and last.num_evictions > 0
    kinds = {e.kind for _, events in snaps for e in events}
    if kinds:  # the engine emits block events
        assert {EventKind.RELOCATED, EventKind.SHARED, EventKind.STORED, EventKind.COPIED_ON_WRITE,
                EventKind.PREEMPTED, EventKind.CONVERSATION_CONTINUED} <= kinds
    assert any(len(set(s.conversations[i].prompt_token_ids[:8] for i in range(len(s.conversations)))) <
               len(s.conversations) for s, _ in snaps if len(s.conversations) > 1), "no shared prefixes"


@pytest.mark.parametrize("interval", [1, 7, 256])
def test_decoder_rebuilds_every_engine_snapshot(interval):
    snaps = workload()
    enc, frames = encode_all(workload_updates(), keyframe_interval=interval, stream_id=7)  # with change records
    plain = encode_all(snaps, keyframe_interval=interval, stream_id=7)[1]  # without: everything compared
    assert [f.payload for f in frames] == [f.payload for f in plain]  # the records change no byte
    dec = StreamDecoder()
    for i, ((want, events), frame) in enumerate(zip(snaps, frames)):
        got, got_events, seq = dec.feed(frame.payload)
        assert seq == i == frame.seq
        assert got_events == events == frame.events
        assert_same_snapshot(want, got, f"frame {i}")
    assert sum(f.keyframe for f in frames) == (len(frames) + interval - 1) // interval
    if interval > 1:  # deltas are small: most of a frame is what changed
        deltas = [len(f.payload) for f in frames if not f.keyframe]
        keys = [len(f.payload) for f in frames if f.keyframe]
        assert np.median(deltas) < np.median(keys) / 2


def test_output_prefix_records_hold_through_the_workload_and_cover_decode_steps():
    """The engine's change record names, for each conversation whose outputs only grew, the tuple they start with
    (ChangeRecord.output_prefixes): every one is true across forks, replies, ends, preemption and relocation,
    and nearly every conversation that grew in a frame has one, naming the previous frame's own tuple (so the
    encoder's identity check hits)."""
    updates = workload_updates()
    grew = promised = named_previous = 0
    for (prev, _, _), (snap, _, changes) in zip(updates, updates[1:]):
        for cid, prefix in changes.output_prefixes.items():
            conv = snap.conversation(cid)
            assert conv is not None and conv.output_token_ids[:len(prefix)] == prefix, f"step {snap.step_id}: {cid}"
        for conv in snap.conversations:
            old = prev.conversation(conv.conversation_id)
            if old is None or old is conv or old.prompt_token_ids != conv.prompt_token_ids:
                continue
            if len(conv.output_token_ids) > len(old.output_token_ids):
                grew += 1
                prefix = changes.output_prefixes.get(conv.conversation_id)
                promised += prefix is not None
                named_previous += prefix is old.output_token_ids
    assert grew > 300 and promised >= 0.9 * grew and named_previous >= 0.9 * grew, (grew, promised, named_previous)


class _CountingTuple(tuple):
    """A tuple that counts the leading slices taken of it (``t[:n]``: the encoder's token-by-token prefix check;
    not ``t[n:]``, the new tokens it takes either way)."""
    slices = 0

    def __getitem__(self, i):
        if isinstance(i, slice) and not i.start and i.stop is not None:
            _CountingTuple.slices += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("promise", [True, False])
def test_encoder_takes_a_recorded_prefix_instead_of_comparing_tokens(promise):
    """With the producer's change record the encoder takes a grown conversation's old outputs as they are, by
    identity, without slicing the new ones to compare them; without it, it compares. The frame decodes to the same
    snapshot, in the same bytes, either way."""
    from kvstream.views import ChangeRecord
    updates = workload_updates()
    prev, snap, changes = next((p, s, c) for (p, _, _), (s, _, c) in zip(updates, updates[1:])
                               if sum(p.conversation(cid) is not None and ps_schema._stable(p.conversation(cid)) ==
                                      ps_schema._stable(s.conversation(cid)) for cid in c.output_prefixes) >= 2)
    # the conversations that only grew (nothing else of theirs changed) and are recorded: theirs count slices
    promised = {cid for cid in changes.output_prefixes
                if ps_schema._stable(prev.conversation(cid)) == ps_schema._stable(snap.conversation(cid))}
    convs = tuple(dataclasses.replace(c, output_token_ids=_CountingTuple(c.output_token_ids))
                  if c.conversation_id in promised else c for c in snap.conversations)
    grown = dataclasses.replace(snap, conversations=convs)
    record = ChangeRecord(output_prefixes=MappingProxyType(dict(changes.output_prefixes))) if promise else None
    enc, dec = StreamEncoder(), StreamDecoder()
    dec.feed(enc.encode(prev).payload)
    _CountingTuple.slices = 0
    frame = enc.encode(grown, (), record)
    got, _, _ = dec.feed(frame.payload)
    sliced = _CountingTuple.slices
    assert len(promised) >= 2 and ((sliced == 0) if promise else (sliced >= len(promised)))
    assert_same_snapshot(snap, got)
    plain = StreamEncoder(stream_id=enc.stream_id)
    plain.encode(prev)
    assert plain.encode(snap).payload == frame.payload  # the record spares comparisons; the bytes are the same


@pytest.mark.parametrize("promise", [True, False])
def test_encoder_compares_only_the_blocks_the_producer_may_have_changed(promise):
    """Given the producer's record of the blocks that may have changed since the frame before
    (ChangeRecord.block_masks), the encoder compares those blocks only. To show that the record is what it
    reads, the test changes a block outside it (which the engine never does: test_engine_core checks its record
    covers every change): with the record, that change is not carried; without it, every block is compared and it
    is. Every change inside the record is carried either way."""
    from kvstream.views import ChangeRecord, block_masks, frozen_array
    updates = workload_updates()
    prev, snap, changes = next((p, s, c) for (p, _, _), (s, _, c) in zip(updates, updates[1:])
                               if c.block_masks is not None and c.base is p
                               and 0 < c.block_masks["num_filled"].sum() < s.num_blocks
                               and (s.num_filled != p.num_filled).any()
                               and (~c.block_masks["num_filled"] & (s.state == 1) & (s.num_filled > 0)).any())
    mask = changes.block_masks["num_filled"]
    outside = int(np.flatnonzero(~mask & (snap.state == 1) & (snap.num_filled > 0))[0])  # a possible change
    filled = snap.num_filled.copy()
    filled[outside] -= 1
    forged = dataclasses.replace(snap, num_filled=frozen_array(filled))
    record = ChangeRecord(prev, block_masks(forged, prev, mask)) if promise else None
    enc, dec = StreamEncoder(), StreamDecoder()
    dec.feed(enc.encode(prev).payload)
    got, _, _ = dec.feed(enc.encode(forged, (), record).payload)
    want = snap.num_filled if promise else filled
    assert np.array_equal(got.num_filled, want)
    assert np.array_equal(got.num_filled[mask], snap.num_filled[mask])  # the real changes, carried either way
    with pytest.raises(ValueError, match="bool masks over the pool"):
        block_masks(forged, prev, mask[:-1])
    with pytest.raises(ValueError, match="no per-block array named filled"):
        block_masks(forged, prev, mask, filled=mask)


def test_a_rolled_back_step_leaves_no_stale_record(tmp_path):
    """A step that appends some conversations' tokens and then fails is rolled back (the token lists cut back);
    what the engine's change record says afterwards is still true, and the encoded frames still rebuild every
    snapshot."""
    from engine import Engine, EngineConfig
    from tests.helpers import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint(tmp_path)
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=64))
    for i in range(4):
        eng.add_conversation(prompt_token_ids=[3 + i, 9, 27, 5 + i], max_new_tokens=30, temperature=0.9, seed=i)
    enc, dec = StreamEncoder(), StreamDecoder()
    frames = 0

    def frame():
        nonlocal frames
        snap = eng.snapshot()
        changes = eng.change_record(snap)
        for cid, prefix in changes.output_prefixes.items():
            assert snap.conversation(cid).output_token_ids[:len(prefix)] == prefix
        got, _, _ = dec.feed(enc.encode(snap, eng.take_events(), changes).payload)
        assert_same_snapshot(snap, got, f"step {snap.step_id}")
        frames += 1

    frame()
    for step in range(12):
        eng.step()
        frame()
        if step in (3, 7):
            calls, real = [], eng._append

            def append_then_fail(seq, token):
                real(seq, token)  # really appended to the token list
                calls.append(seq.seq_id)
                if len(calls) == 2:
                    raise RuntimeError("injected fault after two appends")

            eng._append = append_then_fail
            with pytest.raises(RuntimeError, match="injected"):
                eng.step()
            del eng._append
            assert len(calls) == 2
            frame()
    assert frames == 15 and any(eng.change_record(eng.snapshot()).output_prefixes.values())


def test_history_random_access_equals_engine_at_every_frame():
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=32)
    history = History()
    for f in frames:
        history.write(f)
    assert (history.first_seq, history.last_seq, len(history)) == (0, len(frames) - 1, len(frames))
    order = list(range(len(frames)))
    random.Random(1).shuffle(order)
    for seq in order + list(range(len(frames) - 1, -1, -1)):  # random jumps, then scrubbing backwards
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")
    # back and forth, as a hand on the timeline goes: decoders resumed from checkpoints share conversation rows
    # with them, and both must go on as if alone (a checkpoint used again after a copy of it moved on)
    history.drop_cache()
    seq, rng = len(frames) - 1, random.Random(2)
    for _ in range(300):
        seq = min(max(seq + rng.choice((-9, -5, -3, -1, -1, 1, 2, 4, 7)), 0), len(frames) - 1)
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq} (back and forth)")
    assert history.events() == [(f.seq, e) for f in frames for e in f.events]
    assert history.frame_info(5) == (frames[5].step_id, frames[5].events)
    for step in {s.step_id for s, _ in snaps}:
        seq = history.seq_of_step(step)
        assert snaps[seq][0].step_id == step and (seq + 1 == len(snaps) or snaps[seq + 1][0].step_id > step)
    assert history.seq_of_step(10 ** 9) is None



def test_history_walk_reads_through_in_order_without_moving_the_scrub_cache():
    """walk(seqs) gives every kept frame asked for, exactly as the engine had it, skipping any number of frames
    between two (across keyframes too) and frames not kept, and leaves snapshot_at's decode cache alone."""
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=16)
    history = History()
    for f in frames:
        history.write(f)
    history.snapshot_at(len(frames) // 2)
    cache = history._decoder
    wanted = sorted(set(random.Random(3).sample(range(len(frames)), 40)) | {0, len(frames) - 1})
    got = list(history.walk(wanted + [len(frames) + 5]))  # the last one is not kept: skipped
    assert [seq for seq, _ in got] == wanted
    for seq, snap in got:
        assert_same_snapshot(snaps[seq][0], snap, f"frame {seq}")
    assert history._decoder is cache and cache.seq == len(frames) // 2
    assert [seq for seq, _ in history.walk(range(3, len(frames), 7))] == list(range(3, len(frames), 7))

def _strip_bridge(payload: bytes) -> bytes:
    """The message as an encoder without bridges wrote it (the envelope's first 8 elements)."""
    items = msgspec.msgpack.decode(payload)
    return msgspec.msgpack.encode(items[:8])


def test_periodic_keyframes_bridge_from_the_frame_before_and_a_decoder_going_on_takes_the_bridge(monkeypatch):
    """A keyframe the encoder sends because of its interval also carries the delta from the frame before; a
    decoder at that frame applies the delta instead of rebuilding the whole state, and ends up with exactly the
    keyframe's state. The first keyframe has nothing to bridge from."""
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=7)
    heads = [read_head(f.payload) for f in frames]
    assert not heads[0].bridge
    assert all(bool(h.bridge) == h.keyframe for h in heads[1:])
    rebuilt = []
    real = ps_decode._keyframe_state
    monkeypatch.setattr(ps_decode, "_keyframe_state", lambda head, body: rebuilt.append(head.seq) or real(head, body))
    dec = StreamDecoder()
    for (want, _), f in zip(snaps, frames):
        assert_same_snapshot(want, dec.feed(f.payload)[0], f"frame {f.seq}")
    assert rebuilt == [0]  # 1 of the keyframes decoded as such, every later one through its bridge
    for f in frames[7::7]:  # on its own (a jump there), the keyframe is decoded whole, to the same state
        assert_same_snapshot(snaps[f.seq][0], StreamDecoder().feed(f.payload)[0], f"keyframe {f.seq}")
    assert rebuilt[1:] == [f.seq for f in frames[7::7]]


def test_readers_without_bridges_and_broken_bridges_still_read_the_keyframe():
    """Bridges are a trailing envelope element: a message without one (an older writer) reads the same, and a
    bridge that does not apply (damaged, or from another stream) is passed over for the keyframe itself."""
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=9)
    plain, broken = StreamDecoder(), StreamDecoder()
    bad_bridge = ps_schema._ENCODER.encode(ps.Delta(0, tables_removed=[10 ** 9]))  # removes a table that is not there
    for (want, _), f in zip(snaps, frames):
        assert_same_snapshot(want, plain.feed(_strip_bridge(f.payload))[0], f"frame {f.seq}, no bridge")
        payload = f.payload
        if f.keyframe and f.seq:
            items = msgspec.msgpack.decode(payload)
            payload = msgspec.msgpack.encode(items[:8]) if f.seq % 2 else \
                msgspec.msgpack.encode(items[:8] + [msgspec.msgpack.decode(bad_bridge)])
        assert_same_snapshot(want, broken.feed(payload)[0], f"frame {f.seq}, broken bridge")
    assert not read_head(_strip_bridge(frames[9].payload)).bridge


def test_history_scrubs_forward_through_bridged_keyframes_without_decoding_them(monkeypatch):
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=8)
    history = History()
    history.write_many(frames)
    rebuilt = count_keyframe_decodes(monkeypatch)
    assert_scrubs_forward_through_bridges(history, snaps, rebuilt)
    # a jump far ahead decodes the keyframe before it (cheaper than 64+ deltas); walk goes through bridges too
    history.snapshot_at(3)
    history.snapshot_at(len(frames) - 1)
    assert rebuilt[-1] == frames[-1].seq - frames[-1].seq % 8
    rebuilt.clear()
    got = list(history.walk(range(0, len(frames), 3)))
    assert rebuilt == [0] and [s for s, _ in got] == list(range(0, len(frames), 3))
    for seq, snap in got:
        assert_same_snapshot(snaps[seq][0], snap, f"walk, frame {seq}")


def test_a_step_back_after_a_long_jump_decodes_a_few_frames_not_the_whole_run(monkeypatch):
    """A long decode keeps checkpoints on its way (every _FORWARD_EVERY frames), so stepping back after a jump to the
    end of a long run of deltas decodes from the checkpoint just before, not from the keyframe again; every frame
    still equals the engine's."""
    from kvstream import history as history_module
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=10 ** 6)  # one run of deltas after a single keyframe
    assert len(frames) > 4 * history_module._FORWARD_EVERY
    history = History()
    history.write_many(frames)
    applied = []
    real = StreamDecoder.apply
    monkeypatch.setattr(StreamDecoder, "apply", lambda self, head: applied.append(head.seq) or real(self, head))
    last = len(frames) - 1
    assert_same_snapshot(snaps[last][0], history.snapshot_at(last), "the jump")
    assert len(applied) == len(frames)
    for seq in range(last - 1, last - 2 * history_module._FORWARD_EVERY - 2, -1):  # scrubbing back from there
        applied.clear()
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}, stepping back")
        assert len(applied) <= history_module._FORWARD_EVERY, (seq, applied)


@pytest.mark.skipif(ps_decode._UNTRACK is None, reason="CPython's collector only: another Python tracks tuples its own way")
def test_rebuilt_token_and_block_id_tuples_stay_out_of_the_young_collection():
    """The id tuples a history's snapshots and checkpoints hold are not tracked by the cycle collector (the young
    collection that walked 2.4 million of them took 50-60 ms inside a jump); the snapshots still equal the engine's,
    and checkpoints still go on independently."""
    import gc
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=10 ** 6)
    history = History()
    history.write_many(frames)
    seqs = [len(frames) - 1, len(frames) // 2, len(frames) - 3, 5]  # a long jump with checkpoints, then back
    long_ids = []  # the tuples of at least _UNTRACK_FROM ids (shorter ones are left to the collector)
    for seq in seqs:
        snap = history.snapshot_at(seq)
        assert_same_snapshot(snaps[seq][0], snap, f"frame {seq}")
        ids = [t for c in snap.conversations for t in (c.prompt_token_ids, c.output_token_ids, c.block_table)]
        long_ids += [t for t in ids + list(snap.block_tables.values()) if len(t) >= ps_decode._UNTRACK_FROM]
    for checkpoint in history._checkpoints.values():
        long_ids += [v for vals in checkpoint._state.convs.values() for v in vals
                     if type(v) is tuple and len(v) >= ps_decode._UNTRACK_FROM and type(v[0]) is int]
    tracked = [t for t in long_ids if gc.is_tracked(t)]
    assert len(long_ids) > 50 and not tracked, f"{len(tracked)} of {len(long_ids)} id tuples still tracked"
    gc.collect()
    for seq in seqs:  # nothing held by the checkpoints was lost to the collector
        if seq == 5:
            history.drop_cache()
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}, again")


def test_decode_steps_applied_together_equal_one_at_a_time():
    """A decoder fast-forwarding (no snapshot between frames) keeps decode steps pending and applies them to the
    conversations in one go; whatever comes between (patches of those conversations, drops, copies taken midway
    and then moved on separately) the snapshot it builds equals the engine's."""
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=10 ** 6, keyframe_after_bytes=10 ** 9)  # one keyframe
    heads = [read_head(f.payload, events=False) for f in frames]
    rng = random.Random(5)
    dec = StreamDecoder()
    dec.apply(heads[0])
    seq, copies = 0, []
    while seq < len(frames) - 1:
        for _ in range(rng.randint(1, 12)):  # a run of frames without a snapshot
            if seq == len(frames) - 1:
                break
            seq += 1
            dec.apply(heads[seq])
            if rng.random() < 0.1:
                copies.append((seq, dec.copy()))
        assert_same_snapshot(snaps[seq][0], dec.snapshot(), f"frame {seq}")
    assert len(copies) > 3
    for at, copy in copies[::3]:  # each copy goes on alone from where it was taken
        stop = min(len(frames) - 1, at + 9)
        for s in range(at + 1, stop + 1):
            copy.apply(heads[s])
        assert_same_snapshot(snaps[stop][0], copy.snapshot(), f"copy from {at}, frame {stop}")
    assert_same_snapshot(snaps[-1][0], dec.snapshot())
    for every in (50, len(frames)):  # long runs: patches, preemptions and drops of conversations with steps pending
        dec = StreamDecoder()
        for seq, head in enumerate(heads):
            dec.apply(head)
            if seq % every == every - 1 or seq == len(frames) - 1:
                assert_same_snapshot(snaps[seq][0], dec.snapshot(), f"frame {seq}, built every {every}")


def test_history_block_events_tell_each_blocks_story_as_all_events_do():
    """History.block_events (frames found through the block index, relocations and resets) gives every block the
    same story as the whole event list, at every frame asked, across relocations and a trimmed history."""
    from explorer.model.block_history import block_events
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=32)
    kinds = {e.kind for f in frames for e in f.events}
    assert EventKind.RELOCATED in kinds and EventKind.COPIED_ON_WRITE in kinds
    history = History()
    for f in frames:
        history.write(f)
    rng = random.Random(7)
    num_blocks = snaps[0][0].num_blocks
    checks = [(rng.randrange(num_blocks), rng.randrange(len(frames))) for _ in range(150)]
    checks += [(b, len(frames) - 1) for b in range(num_blocks)]
    for block, seq in checks:
        want = block_events(history.events(None, seq), block)
        got = history.block_events(block, seq)
        assert block_events(got, block) == want, (block, seq)
        assert len(got) <= len(history.events(None, seq))
    assert sum(len(history.block_events(b)) for b in range(num_blocks)) < num_blocks * len(history.events())
    history.budget_bytes = history.nbytes // 2  # trimmed: only what is kept
    first = history.first_seq
    for block in range(num_blocks):
        assert block_events(history.block_events(block), block) == block_events(history.events(), block)
        assert all(seq >= first for seq, _ in history.block_events(block))


def test_late_joiner_starts_from_encoder_keyframe():
    snaps = workload()
    enc = StreamEncoder(keyframe_interval=1000)
    for snap, events in snaps[:100]:
        enc.encode(snap, events)
    key = enc.keyframe()
    assert key.keyframe and key.seq == 99 and key.events == ()
    dec, history = StreamDecoder(), History()
    assert_same_snapshot(snaps[99][0], dec.feed(key.payload)[0])
    history.write(key)
    for i, (snap, events) in enumerate(snaps[100:], 100):
        frame = enc.encode(snap, events)
        assert not frame.keyframe
        assert_same_snapshot(snap, dec.feed(frame.payload)[0], f"frame {i}")
        history.write(frame)
    assert_same_snapshot(snaps[150][0], history.snapshot_at(150))


def test_keyframe_after_bytes_bounds_the_deltas_between_keyframes():
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=10 ** 6, keyframe_after_bytes=4000)
    run = 0
    for f in frames:
        run = 0 if f.keyframe else run + len(f.payload)
        assert run < 4000 + max(len(g.payload) for g in frames)
    assert 2 < sum(f.keyframe for f in frames) < len(frames) / 2


# ---- synthetic snapshots: every field, every kind of change (hypothesis) ---------------------------------------
def _conv(cid, rng: random.Random, **kw) -> ConversationInfo:
    base = dict(conversation_id=cid, status=Status.RUNNING, prompt_token_ids=(1, 2, 3), output_token_ids=(),
                output_text="", prompt_text="abc", block_table=(0,), num_computed_tokens=3, num_cached_tokens=0,
                max_new_tokens=9, temperature=0.5, parent_id=None, num_preemptions=0, arrival_step=0)
    base.update(kw)
    return ConversationInfo(**base)


def _mutate_conv(c: ConversationInfo, rng: random.Random, n: int) -> ConversationInfo:
    choice = rng.randrange(9)
    if choice == 0:  # a decode step
        return dataclasses.replace(c, output_token_ids=c.output_token_ids + (rng.randrange(70000),),
                                   output_text=c.output_text + rng.choice(["", "é", "ab", "\U0001F600"]),
                                   num_computed_tokens=c.num_computed_tokens + 1,
                                   block_table=c.block_table + _new_block(c.block_table, rng, n))
    if choice == 1:  # text rewritten in the middle (a held-back UTF-8 sequence resolved)
        cut = rng.randrange(len(c.output_text) + 1)
        return dataclasses.replace(c, output_text=c.output_text[:cut] + "\ufffd" + "x" * rng.randrange(3))
    if choice == 2:  # tokens dropped (a preemption's recompute, a reply's new prompt)
        cut = rng.randrange(len(c.output_token_ids) + 1)
        return dataclasses.replace(c, output_token_ids=c.output_token_ids[:cut],
                                   prompt_token_ids=c.prompt_token_ids + (5,), block_table=())
    if choice == 3:
        return dataclasses.replace(c, status=Status.FINISHED, finish_reason=rng.choice(list(FinishReason)))
    if choice == 4:
        return dataclasses.replace(c, turns=c.turns + ((rng.randrange(99), rng.randrange(99)),), label="req-7")
    if choice == 5:
        return dataclasses.replace(c, parent_id=rng.randrange(5), temperature=rng.random(),
                                   num_preemptions=c.num_preemptions + 1)
    if choice == 6:  # relocated: the whole table changes
        return dataclasses.replace(c, block_table=tuple(rng.sample(range(n), min(n, len(c.block_table)))))
    if choice == 7:  # equal but not the same object
        return dataclasses.replace(c)
    return c


def _new_block(table: tuple, rng: random.Random, n: int) -> tuple:
    """Sometimes a block the table does not name yet (a table never names a block twice)."""
    b = rng.randrange(n)
    return (b,) if rng.random() < 0.3 and b not in table else ()


def _snapshot(step, n, rng, convs, *, hashes=True, memory=True, arrays=None) -> PoolSnapshot:
    """A random pool that could exist (kvstream.poolstream.validate's rules): the arrays change at random places
    between frames, then the tables decide which blocks are USED, with their ref counts and an owner among their
    holders; the blocks no table names are FREE (empty, no owner, no hash) or CACHED (full, hashed)."""
    arrays = arrays or {}

    def arr(name, dtype, lo, hi):
        a = arrays.get(name)
        if a is None:
            a = np.zeros(n, dtype) if name != "owner" else np.full(n, -1, dtype)
        a = a.copy()
        k = rng.randrange(n + 1) if rng.random() < 0.3 else rng.randrange(3)
        idx = rng.sample(range(n), min(k, n))
        a[idx] = [rng.randrange(lo, hi) for _ in idx]
        a.setflags(write=False)
        return a

    tables = {c.conversation_id: c.block_table for c in convs if c.block_table}
    keys = list(tables)
    if rng.random() < 0.2:
        rng.shuffle(keys)
    holders: dict[int, list[int]] = {}
    for cid, table in tables.items():
        for b in table:
            holders.setdefault(b, []).append(cid)
    ref = np.zeros(n, np.int32)
    for b, cids in holders.items():
        ref[b] = len(cids)
    state = arr("state", np.int8, 0, 3).copy()
    state[state == 1] = 0
    state[ref > 0] = 1
    filled = arr("num_filled", np.int32, 0, 5).copy()
    filled[state == 0], filled[state == 2] = 0, 4
    owner = arr("owner", np.int32, -1, 2 ** 31 - 1).copy()
    owner[state == 0] = -1
    for b, cids in holders.items():
        if int(owner[b]) not in cids:
            owner[b] = cids[rng.randrange(len(cids))]
    block_hash = None
    if hashes:
        block_hash = arr("block_hash", np.uint64, 0, 2 ** 64).copy()
        block_hash[state == 0] = 0
        block_hash[(state == 2) & (block_hash == 0)] = 1
        block_hash.setflags(write=False)
    for a in (ref, state, filled, owner):
        a.setflags(write=False)
    counts = np.bincount(state, minlength=3)
    return PoolSnapshot(
        step_id=step, block_size=4, num_blocks=n, ref_count=ref, num_filled=filled, state=state, owner=owner,
        last_access=arr("last_access", np.int64, 0, 2 ** 62),
        block_tables=MappingProxyType({k: tables[k] for k in keys}), conversations=tuple(convs),
        metrics=EngineMetrics(num_steps=step, last_step_seconds=rng.random()),
        memory=MemoryStats(64, 16, int(counts[1]), int(counts[2]), int(counts[0]), 1, 2, 3, 4, 5, step, 7)
        if memory else None,
        model_name="m", max_model_len=99, device="cpu", block_hash=block_hash, version=step, source="engine")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 40), st.integers(1, 9))
def test_synthetic_round_trip(seed, n, interval):
    rng = random.Random(seed)
    convs = [_conv(i, rng) for i in range(rng.randrange(4))]
    enc, dec, history = StreamEncoder(keyframe_interval=interval), StreamDecoder(), History()
    snaps, prev = [], None
    for step in range(30):
        convs = [_mutate_conv(c, rng, n) for c in convs]
        if rng.random() < 0.2:
            convs.append(_conv(max([c.conversation_id for c in convs], default=0) + 1, rng))
        if rng.random() < 0.15 and convs:
            convs.pop(rng.randrange(len(convs)))  # left the finished window
        if rng.random() < 0.1:
            rng.shuffle(convs)
        arrays = None if prev is None else {name: getattr(prev, name) for name in ps.ARRAYS}
        snap = _snapshot(step, n, rng, convs, hashes=rng.random() > 0.1, memory=rng.random() > 0.1, arrays=arrays)
        events = [BlockEvent(step, EventKind.STORED, 3, (1,), block_hashes=(2 ** 64 - 1,), parent_hash=None,
                             token_ids=(1, 2, 3, 4))] if rng.random() < 0.5 else []
        frame = enc.encode(snap, events)
        got, got_events, _ = dec.feed(frame.payload)
        assert got_events == tuple(events)
        assert_same_snapshot(snap, got, f"step {step}")
        history.write(frame)
        snaps.append(snap)
        prev = snap
    for seq in rng.sample(range(len(snaps)), 10):
        assert_same_snapshot(snaps[seq], history.snapshot_at(seq), f"history {seq}")


def test_header_change_forces_a_keyframe():
    rng = random.Random(0)
    enc = StreamEncoder(keyframe_interval=100)
    a = _snapshot(1, 8, rng, [], hashes=True)
    b = dataclasses.replace(_snapshot(2, 8, rng, []), block_hash=None)
    c = _snapshot(3, 16, rng, [])
    d = dataclasses.replace(_snapshot(4, 16, rng, []), device="cuda:0")
    assert [enc.encode(s).keyframe for s in (a, b, c, d)] == [True, True, True, True]
    assert not enc.encode(d).keyframe


# ---- bad input -----------------------------------------------------------------------------------------------------
def _envelope(frame: Frame) -> ps_schema._Envelope:
    head = read_head(frame.payload)
    body = msgspec.msgpack.decode(head.body, type=ps.Body)
    return ps_schema._Envelope(ps.MAGIC, FORMAT_VERSION, head.stream_id, head.seq, head.step_id, head.keyframe, head.events,
                        body)


def _payload(env: ps_schema._Envelope, **changes) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(env, **changes))


def _body(env: ps_schema._Envelope, **changes) -> bytes:
    return _payload(env, body=msgspec.structs.replace(env.body, **changes))


@pytest.fixture(scope="module")
def stream():
    snaps = workload()[:40]
    _, frames = encode_all(snaps, keyframe_interval=100)
    return snaps, frames


def _at(frames, upto):
    dec = StreamDecoder()
    for f in frames[:upto]:
        dec.feed(f.payload)
    return dec


def test_foreign_and_newer_messages_are_refused(stream):
    snaps, frames = stream
    dec = _at(frames, 5)
    before = dec.snapshot()
    vllm_batch = msgspec.msgpack.encode([1.5, [{"type": "BlockStored", "block_hashes": [1]}], 0])
    env = _envelope(frames[5])
    cases = {
        b"": "not a pool-stream message",
        b"\xc1garbage": "not a pool-stream message",
        vllm_batch: "not a pool-stream message",
        msgspec.msgpack.encode({"magic": "kvpool"}): "not a pool-stream message",
        _payload(env, magic="kvpull"): "not a pool-stream message",
        _payload(env, format_version=FORMAT_VERSION + 1): "newer than this program reads",
        _payload(env, format_version="1"): "format version",
        frames[5].payload[:-3]: "malformed",
        _payload(env, keyframe=True): "disagree",
        _payload(env, seq=9): "frames are missing",
        _payload(env, seq=3): "it came before",
        _payload(env, stream_id=env.stream_id + 1): "another stream",
    }
    for payload, words in cases.items():
        with pytest.raises(StreamError, match=words):
            dec.feed(payload)
        assert dec.seq == 4
        assert_same_snapshot(snaps[4][0], dec.snapshot())
    assert dec.snapshot() is before
    assert_same_snapshot(snaps[5][0], dec.feed(frames[5].payload)[0])  # still decodes the real next frame
    with pytest.raises(StreamError, match="no keyframe"):
        StreamDecoder().feed(frames[5].payload)
    with pytest.raises(StreamError, match="no keyframe decoded"):
        StreamDecoder().snapshot()


def test_malformed_bodies_are_refused_and_change_nothing(stream):
    snaps, frames = stream
    i = next(i for i in range(8, 40) if not frames[i].keyframe and read_head(frames[i].payload).body)
    dec = _at(frames, i)
    env = _envelope(frames[i])
    body = env.body
    state = dec.snapshot()
    n = state.num_blocks
    some = next(iter(state.block_tables))
    conv = state.conversations[0].conversation_id
    bad_index = ps.ArrayPatch(ps.Packed("<i4", np.array([n], "<i4").tobytes()), 1)
    cases = {
        "past the pool": _body(env, arrays={"state": bad_index}),
        "dtype": _body(env, arrays={"state": ps.ArrayPatch(None, ps.Packed("<f8", b"\0" * 8 * n))}),
        "values for": _body(env, arrays={"state": ps.ArrayPatch(None, ps.Packed("|i1", b"\0" * (n - 1)))}),
        "do not fit": _body(env, arrays={"state": ps.ArrayPatch(None, 300)}),
        "lacks": _body(env, arrays={"nonsense": ps.ArrayPatch(None, 0)}),
        "drops": _body(env, tables=[ps.TablePatch(some, 999, ())]),
        "outside": _body(env, tables=[ps.TablePatch(some, 0, (n,))]),
        "removes block tables": _body(env, tables_removed=[10 ** 6]),
        "order": _body(env, tables_order=[some, some]),
        f"conversation {conv} drops": _body(env, conversations=[ps.ConvPatch(conv, output_text=(10 ** 6, ""))]),
        "new conversation": _body(env, conversations=[ps.ConvPatch(10 ** 6, status=Status.RUNNING)]),
        "patched twice": _body(env, conversations=[ps.ConvPatch(conv), ps.ConvPatch(conv)]),
        "drops conversations": _body(env, conversations_dropped=[10 ** 6]),
        "metrics has no field": _body(env, metrics={"bogus": 1}),
        "must be an integer": _body(env, metrics={"num_steps": 1.5}),
        "grown": _body(env, grown=ps.Grown(ps.Packed("<i4", np.array([10 ** 6], "<i4").tobytes()), 1,
                                           ps.Packed("|u1", b"\1"), ["x"], 1, 0, ps.Packed("|u1", b""))),
        "line up": _body(env, grown=ps.Grown(ps.Packed("<i4", np.array([conv], "<i4").tobytes()), 2,
                                             ps.Packed("|u1", b"\1"), ["x"], 1, 0, ps.Packed("|u1", b""))),
    }
    for words, payload in cases.items():
        with pytest.raises(StreamError, match=words):
            dec.feed(payload)
        assert dec.seq == i - 1 and dec.snapshot() is state, words
    assert_same_snapshot(snaps[i][0], dec.feed(frames[i].payload)[0])
    assert body is env.body


def test_malformed_keyframes_are_refused(stream):
    snaps, frames = stream
    env = _envelope(frames[0])
    key = env.body
    cases = {
        "header says": _body(env, header=msgspec.structs.replace(key.header, num_blocks=0)),
        "header dtypes": _body(env, header=msgspec.structs.replace(key.header, dtypes={"state": "|i1"})),
        "lacks": _body(env, metrics={}),
    }
    dec = _at(frames, 3)
    for words, payload in cases.items():
        with pytest.raises(StreamError, match=words):
            dec.feed(payload)
        assert dec.seq == 2
    assert_same_snapshot(snaps[3][0], dec.feed(frames[3].payload)[0])


def test_encoder_refuses_what_it_cannot_carry():
    rng = random.Random(0)
    snap = _snapshot(0, 8, rng, [])
    enc = StreamEncoder()
    with pytest.raises(TypeError):
        enc.encode("not a snapshot")
    with pytest.raises(TypeError):
        enc.encode(snap, ["not an event"])
    with pytest.raises(StreamError, match="num_blocks"):
        enc.encode(dataclasses.replace(snap, state=np.zeros(3, np.int8)))
    with pytest.raises(StreamError, match="dtype"):
        enc.encode(dataclasses.replace(snap, state=np.zeros(8, np.float32)))
    with pytest.raises(StreamError, match="nothing encoded"):
        enc.keyframe()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            StreamEncoder(keyframe_interval=bad)
    assert enc.last_seq == -1  # nothing was encoded by the refused calls
    # numpy scalars in a source's views are carried as plain numbers
    conv = _conv(1, rng, prompt_token_ids=tuple(np.arange(3, dtype=np.int64)), temperature=np.float32(0.5))
    frame = enc.encode(dataclasses.replace(snap, conversations=(conv,)))
    assert StreamDecoder().feed(frame.payload)[0].conversations[0].prompt_token_ids == (0, 1, 2)


# ---- History --------------------------------------------------------------------------------------------------------
def test_history_budget_trims_oldest_and_rekeys():
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=64)
    total = sum(len(f.payload) for f in frames)
    history = History(budget_bytes=total // 3)
    for f in frames:
        history.write(f)
        assert history.nbytes <= history.budget_bytes or len(history) == 1
        assert history.keyframe_seqs()[0] == history.first_seq
    assert history.last_seq == len(frames) - 1 and history.first_seq > 0
    first = history.first_seq
    assert not frames[first].keyframe or first % 64 == 0
    for seq in range(first, len(frames)):
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")
    assert history.events()[0][0] >= first
    with pytest.raises(LookupError, match="keeps frames"):
        history.snapshot_at(first - 1)
    history.budget_bytes = 1  # lowering the budget trims at once, down to the newest frame (re-keyed)
    assert len(history) == 1 and history.keyframe_seqs() == [len(frames) - 1]
    assert_same_snapshot(snaps[-1][0], history.snapshot_at(len(frames) - 1))
    for bad in (0, -5, True, "1"):
        with pytest.raises(ValueError, match="budget"):
            history.budget_bytes = bad


def test_history_refuses_frames_out_of_order():
    snaps = workload()[:20]
    _, frames = encode_all(snaps, keyframe_interval=5)
    other = encode_all(snaps, keyframe_interval=5)[1]
    history = History()
    with pytest.raises(StreamError, match="start with a keyframe"):
        history.write(frames[1])
    for f in frames[:7]:
        history.write(f)
    for bad, words in ((frames[6], "not newer"), (frames[8], "missing"), (other[10], "another stream")):
        with pytest.raises(StreamError, match=words):
            history.write(bad)
        assert history.last_seq == 6 and len(history) == 7
    with pytest.raises(TypeError):
        history.write(b"bytes")
    history.write(frames[10])  # a keyframe after a gap (a subscriber's resync) is fine
    assert history.seqs() == [0, 1, 2, 3, 4, 5, 6, 10]
    assert_same_snapshot(snaps[10][0], history.snapshot_at(10))
    with pytest.raises(LookupError):
        history.snapshot_at(8)
    with pytest.raises(TypeError):
        history.snapshot_at("3")
    history.clear()
    assert len(history) == 0 and history.first_seq is None and history.latest() is None
    history.write(other[0])


def test_block_tokens_come_from_stored_events_through_relocations():
    snaps = workload()
    if not any(e.kind == EventKind.STORED for _, ev in snaps for e in ev):
        pytest.skip("the engine emits no block events yet")
    _, frames = encode_all(snaps, keyframe_interval=32)
    history = History()
    for f in frames:
        history.write(f)
    checked = moved = 0
    for seq in range(0, len(snaps), 3):
        snap = snaps[seq][0]
        for c in snap.conversations:
            for logical, block in enumerate(snap.block_tables.get(c.conversation_id, ())):
                tokens = history.block_tokens(block, seq)
                start = logical * snap.block_size
                if snap.hashes()[block] and snap.num_filled[block] == snap.block_size:
                    assert tokens == c.token_ids[start:start + snap.block_size], (seq, block)
                    checked += 1
                    moved += any(e.kind == EventKind.RELOCATED for s, e in history.events(0, seq))
                elif tokens is not None:  # hashed earlier with these tokens, still holding them
                    assert tokens == c.token_ids[start:start + len(tokens)]
        free = np.flatnonzero(snap.state == 0)
        for block in free[:5]:
            assert history.block_tokens(int(block), seq) is None
    assert checked > 50 and moved > 0


def test_history_serves_a_reader_while_a_writer_writes():
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=16)
    history = History(budget_bytes=sum(len(f.payload) for f in frames) // 2)
    errors = []

    def writer():
        for f in frames:
            history.write(f)

    t = threading.Thread(target=writer)
    t.start()
    rng = random.Random(3)
    while t.is_alive() or rng.random() < 0.9:
        if len(history) == 0:
            continue
        lo, hi = history.first_seq, history.last_seq
        seq = rng.randint(lo, hi)
        try:
            got = history.snapshot_at(seq)
        except LookupError:
            continue  # trimmed away between the two reads
        if got.step_id != snaps[seq][0].step_id or got.version != snaps[seq][0].version:
            errors.append(seq)
        history.events(seq, hi)
    t.join()
    assert not errors
    assert_same_snapshot(snaps[-1][0], history.latest())


def test_encode_keyframe_rebuilds_the_same_state():
    snaps = workload()
    snap = snaps[100][0]
    frame = encode_keyframe(snap, 100, 42, snaps[100][1])
    assert frame.keyframe and frame.seq == 100 and frame.stream_id == 42 and frame.events == snaps[100][1]
    assert_same_snapshot(snap, StreamDecoder().feed(frame.payload)[0])


def test_the_pool_stream_package_does_not_import_the_history():
    """Issue 29: kvstream.history imports the pool stream, never the other way round (no module __getattr__ handing
    out History); the package keeps its public names."""
    import subprocess
    import sys
    code = ("import sys, kvstream.poolstream as ps; from kvstream.poolstream import (StreamEncoder, StreamDecoder, "
            "Frame, FrameHead, Header, Keyframe, Delta, read_head, frame_of, frame_from_payload, encode_keyframe, "
            "StreamError, FORMAT_VERSION, MAGIC, ARRAYS); print('kvstream.history' in sys.modules, "
            "hasattr(ps, 'History'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# ---- format 2: tiers and KV cache groups ------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

from tests.poolstream_helpers import assert_same_v2, synthetic_v2  # noqa: E402

_DATA = Path(__file__).parent / "data"


def test_synthetic_v2_pools_are_possible_and_exercise_groups_and_tiers():
    from kvstream.poolstream.validate import check_snapshot
    snaps = synthetic_v2()
    for snap, _ in snaps:
        check_snapshot(snap)
    assert any(-1 in t for s, _ in snaps for t in s.group_block_tables[1].values()), "no window released a block"
    kinds = {e.kind for _, ev in snaps for e in ev}
    assert {EventKind.OFFLOADED, EventKind.DROPPED, EventKind.FREED} <= kinds
    assert any(e.reason == "sliding_window" and e.group == 1 for _, ev in snaps for e in ev)
    assert all(s.tiers["host"].state.any() for s, _ in snaps[10:])


@pytest.mark.parametrize("interval", [1, 5, 256])
def test_tiers_and_groups_round_trip_exactly(interval):
    snaps = synthetic_v2(seed=interval)
    _, frames = encode_all(snaps, keyframe_interval=interval)
    dec = StreamDecoder()
    for (snap, events), f in zip(snaps, frames):
        got, got_events, _ = dec.feed(f.payload)
        assert_same_v2(snap, got, f"frame {f.seq}")
        assert got_events == events  # group, tier and tier_slots included
    assert read_head(frames[0].payload).events == snaps[0][1]


def test_history_scrubs_tiers_and_groups_back_and_forth():
    snaps = synthetic_v2(frames=50, seed=3)
    _, frames = encode_all(snaps, keyframe_interval=8)
    history = History()
    for f in frames:
        history.write(f)
    order = list(range(len(frames)))
    random.Random(4).shuffle(order)
    for seq in order:
        assert_same_v2(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")


def test_a_v2_keyframe_names_the_groups_and_tiers_in_its_header():
    snaps = synthetic_v2(frames=3)
    _, frames = encode_all(snaps)
    dec = StreamDecoder()
    dec.feed(frames[0].payload)
    h = dec.header
    assert [g.kind for g in h.groups] == ["full_attention", "sliding_window"] and h.groups[1].sliding_window == 8
    assert h.group_tables == 2 and sorted(h.tiers) == ["disk", "host"] and h.tiers["host"].num_blocks == 16
    assert msgspec.msgpack.decode(frames[0].payload)[1] == FORMAT_VERSION == 2


def test_a_plain_pool_has_one_group_table_set_and_carries_its_tables_once():
    """DESIGN.md: one table set per KV cache group, so a plain model's is ``(block_tables,)``; the stream must not
    carry that second copy (header group_tables 0, no conversation group tables), and the decoder rebuilds it."""
    snaps = workload()[:60]
    assert all(len(s.group_block_tables) == 1 and s.group_block_tables[0] is s.block_tables for s, _ in snaps)
    assert all(c.group_block_tables == (c.block_table,) for s, _ in snaps for c in s.conversations)
    _, frames = encode_all(snaps, keyframe_interval=7)
    dec = StreamDecoder()
    for (want, _), frame in zip(snaps, frames):
        got, _, _ = dec.feed(frame.payload)
        assert dec.header.group_tables == 0
        body = _envelope(frame).body
        assert not body.group_tables
        assert all(not (p.group_block_tables or ()) for p in body.conversations), "a one-group table travelled twice"
        assert got.group_block_tables[0] is got.block_tables and dict(got.block_tables) == dict(want.block_tables)
        assert all(c.group_block_tables == (c.block_table,) for c in got.conversations)


def test_a_version_1_recording_still_opens_as_a_one_group_pool_without_tiers():
    """tests/data/poolstream_v1.kvrec was written by the format-1 encoder (before tiers and groups)."""
    import json

    from kvstream.recording import open_recording, read_frames
    want = json.loads((_DATA / "poolstream_v1_expected.json").read_text())
    frames = list(read_frames(_DATA / "poolstream_v1.kvrec"))
    assert [msgspec.msgpack.decode(f.payload)[1] for f in frames] == [1] * len(want)
    history = open_recording(_DATA / "poolstream_v1.kvrec")
    for seq in list(range(len(want))) + [3, 0, 30]:
        snap, w = history.snapshot_at(seq), want[seq]
        assert (snap.step_id, snap.version) == (w["step_id"], w["version"])
        for name, values in w["arrays"].items():
            assert getattr(snap, name).tolist() == values, (seq, name)
        assert [[c, list(t)] for c, t in snap.block_tables.items()] == w["tables"]
        assert [[c.conversation_id, c.status.value, list(c.prompt_token_ids), list(c.output_token_ids),
                 list(c.block_table), c.num_computed_tokens] for c in snap.conversations] == w["conversations"]
        assert snap.kv_cache_groups == () and snap.block_group is None
        assert snap.group_block_tables == (snap.block_tables,)  # one group: block_tables itself
        assert dict(snap.tiers) == {}
        assert all(c.group_block_tables == (c.block_table,) and dict(c.prompt_token_sources) == {}
                   for c in snap.conversations)


def _rebuilt(snap: PoolSnapshot, **changes) -> PoolSnapshot:
    return dataclasses.replace(snap, **changes)


def _refused(snap: PoolSnapshot, rule: str) -> None:
    from kvstream.poolstream.validate import check_snapshot
    with pytest.raises(StreamError, match=rule):
        check_snapshot(snap)
    enc = StreamEncoder()
    with pytest.raises(StreamError, match=rule):  # the decoder refuses it too
        StreamDecoder().feed(enc.encode(snap).payload)


def test_the_validator_holds_tiers_to_their_meaning():
    from kvstream.views import TierView
    snap = synthetic_v2(frames=12)[-1][0]
    host = snap.tiers["host"]
    used = int(np.flatnonzero(host.state)[0])
    free = int(np.flatnonzero(host.state == 0)[0])

    def tier(**kw):
        return {**snap.tiers, "host": dataclasses.replace(host, **kw)}

    h = host.block_hash.copy()
    h[used] = 0
    _refused(_rebuilt(snap, tiers=tier(block_hash=h)), "tiers.*lacks a hash")
    h = host.block_hash.copy()
    h[free] = 7
    _refused(_rebuilt(snap, tiers=tier(block_hash=h)), "tiers.*has a hash")
    st_ = host.state.copy()
    st_[free] = 1  # USED: a tier holds no running blocks
    _refused(_rebuilt(snap, tiers=tier(state=st_)), "not FREE or CACHED")
    _refused(_rebuilt(snap, tiers={**snap.tiers, "gpu": TierView(1, np.zeros(1, np.int8), np.zeros(1, np.uint64),
                                                                    np.zeros(1, np.int64))}), "tier")


def test_the_validator_holds_groups_to_their_meaning():
    snap = next(s for s, _ in synthetic_v2() if any(-1 in t for t in s.group_block_tables[1].values()))
    g0, g1 = (dict(g) for g in snap.group_block_tables)
    cid = next(c for c, t in g1.items() if -1 in t)
    full_cid = next(iter(g0))

    def with_tables(t0, t1, **kw):
        convs = tuple(dataclasses.replace(c, block_table=t0.get(c.conversation_id, ()),
                                          group_block_tables=(t0.get(c.conversation_id, ()),
                                                              t1.get(c.conversation_id, ())))
                      for c in snap.conversations)
        return _rebuilt(snap, block_tables=t0, group_block_tables=(t0, t1), conversations=convs, **kw)

    # a -1 hole in the full-attention group
    _refused(with_tables({**g0, full_cid: (-1,) + g0[full_cid][1:]}, g1), "-1 entry in a full-attention group")
    # a -1 after a live block in the sliding group
    live = [b for b in g1[cid] if b != -1]
    _refused(with_tables(g0, {**g1, cid: tuple(live) + (-1,)}), "after a block")
    # a block of group 0 named in group 1's table
    _refused(with_tables(g0, {**g1, cid: g1[cid] + (g0[full_cid][0],)}), "belongs to group 0|names a block twice|"
                                                                          "ref count")
    # block_group out of range
    bg = snap.block_group.copy()
    bg[live[0]] = 5
    _refused(_rebuilt(snap, block_group=bg), "outside 0..1")
    # a group table set missing
    _refused(_rebuilt(snap, group_block_tables=(g0,)), "group table sets")
    # a conversation whose own group tables disagree with the pool's
    convs = tuple(dataclasses.replace(c, group_block_tables=(c.group_block_tables[0], ()))
                  if c.conversation_id == cid else c for c in snap.conversations)
    _refused(_rebuilt(snap, conversations=convs), "group tables differ")
    # prompt sources
    convs = tuple(dataclasses.replace(c, prompt_token_sources={"gpu": 3}) for c in snap.conversations)
    _refused(_rebuilt(snap, conversations=convs), "prompt token sources")


def test_a_producer_rewriting_one_writable_tier_array_in_place_still_gets_exact_deltas():
    """The encoder compares against its own copy of a writable tier array, not the array the producer goes on
    writing (a shared array compared with itself would send no change)."""
    from kvstream.views import TierView
    snaps = synthetic_v2(frames=20, seed=11)
    shared = {name: [np.zeros(t.num_blocks, t.state.dtype), np.zeros(t.num_blocks, t.block_hash.dtype),
                     np.zeros(t.num_blocks, t.last_access.dtype)] for name, t in snaps[0][0].tiers.items()}
    enc, dec = StreamEncoder(keyframe_interval=256), StreamDecoder()
    for snap, events in snaps:
        tiers = {}
        for name, t in snap.tiers.items():
            for arr, src in zip(shared[name], (t.state, t.block_hash, t.last_access)):
                arr[:] = src  # the same objects every frame, written in place
            tiers[name] = TierView(t.num_blocks, *shared[name])
        got, _, _ = dec.feed(enc.encode(dataclasses.replace(snap, tiers=tiers), events).payload)
        assert_same_v2(snap, got, f"step {snap.step_id}")


def test_frames_take_their_producers_numbers_and_a_gap_starts_a_keyframe():
    """An encoder given the producer's numbers (the engine runner's PoolUpdate.seq) uses them: the stream is numbered
    once. A number past the next one (an update not encoded) starts a keyframe, which a History takes after its gap;
    a number not past the last is refused."""
    snaps = workload()[:12]
    encoder, history = StreamEncoder(keyframe_interval=100), History()
    for i in range(5):
        history.write(encoder.encode(snaps[i][0], snaps[i][1], seq=i))
    after_gap = encoder.encode(snaps[6][0], snaps[6][1], seq=6)  # update 5 was never encoded
    assert after_gap.seq == 6 and after_gap.keyframe and not after_gap.bridged
    history.write(after_gap)
    follows = encoder.encode(snaps[7][0], snaps[7][1])  # no number given: the next one
    assert follows.seq == 7 and not follows.keyframe
    history.write(follows)
    assert history.seqs() == [0, 1, 2, 3, 4, 6, 7]
    assert_same_snapshot(snaps[7][0], history.snapshot_at(7))
    for bad in (7, 3, True, 8.0):
        with pytest.raises(ValueError, match="seq"):
            encoder.encode(snaps[8][0], snaps[8][1], seq=bad)
    assert encoder.encode(snaps[8][0], snaps[8][1]).seq == 8  # a refused number changed nothing
