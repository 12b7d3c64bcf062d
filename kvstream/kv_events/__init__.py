"""vLLM-format KV events: what vLLM and SGLang publish about their prefix caches, read and written here.

One import for everything a caller needs; each concept has its own file:

- :mod:`kvstream.kv_events.codec`: the event structs (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``),
  the batch ``[ts, events, data_parallel_rank]``, a vLLM-exact encoder and a lenient decoder;
- :mod:`kvstream.kv_events.publisher`: :class:`KVEventPublisher` (ZMQ PUB + ROUTER replay), used by the engine;
- :mod:`kvstream.kv_events.endpoint`: :class:`KVEventEndpoint` and the ``--attach-kv-events`` spec;
- :mod:`kvstream.kv_events.subscriber`: :class:`KVEventSubscriber` (SUB + DEALER replay, gaps, status);
- :mod:`kvstream.kv_events.index`: :class:`KVCacheIndex`, the content model of one instance, the cross-instance
  queries and :func:`json_summary`.

Wire format (fixed by DESIGN.md): multipart ``[topic, 8-byte big-endian seq, msgpack(batch)]``; replay request
``[8-byte start seq]``, answered by ``[topic, seq, payload]`` per buffered batch and ``[b"", -1, b""]``.
"""
from kvstream.kv_events.codec import (END_SEQ, MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, TIERS, AllBlocksCleared,
                                      BlockHash, BlockRemoved, BlockStored, DecodeReport, KVCacheEvent, KVEvent,
                                      KVEventBatch, KVEventDecodeError, KVEventError, decode_batch,
                                      decode_batch_counted, decode_batch_report, encode_batch, make_batch,
                                      medium_tier, parse_frames)
from kvstream.kv_events.endpoint import KVEventEndpoint, endpoint_for_rank, parse_endpoint_spec
from kvstream.kv_events.index import (CONTENT_NOT_SENT, CONTENT_SENT, KVCacheIndex, PrefixNode, Residency,
                                      StoredBlock, Timeline, hash_text, json_summary, prefix_overlap,
                                      prefix_overlap_by_tier, where_cached)
from kvstream.kv_events.publisher import KVEventPublisher
from kvstream.kv_events.subscriber import (CATCHING_UP, CONNECTING, FAILED, LIVE, RECONNECTING, SILENT,
                                           EndpointStatus, KVEventSubscriber)

__all__ = [
    "END_SEQ", "MEDIUM_CPU", "MEDIUM_GPU", "AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored",
    "KVCacheEvent", "KVEvent", "KVEventBatch", "KVEventDecodeError", "KVEventError", "decode_batch",
    "decode_batch_counted", "encode_batch", "make_batch", "parse_frames",
    "MEDIUM_STORAGE", "TIERS", "DecodeReport", "decode_batch_report", "medium_tier",
    "KVEventEndpoint", "endpoint_for_rank", "parse_endpoint_spec",
    "KVCacheIndex", "PrefixNode", "StoredBlock", "Timeline", "hash_text", "json_summary", "prefix_overlap",
    "where_cached", "CONTENT_NOT_SENT", "CONTENT_SENT", "Residency", "prefix_overlap_by_tier",
    "KVEventPublisher",
    "CATCHING_UP", "CONNECTING", "FAILED", "LIVE", "RECONNECTING", "SILENT", "EndpointStatus", "KVEventSubscriber",
]
