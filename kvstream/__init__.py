"""What crosses a process boundary, in one Qt-free, torch-free package.

- :mod:`kvstream.views`: the immutable pool views every source produces (engine, pool stream, vLLM plugin).
- :mod:`kvstream.events`: block events, the typed record of every change to a pool.
- :mod:`kvstream.kv_events`: vLLM-format KV events (what vLLM and SGLang publish over ZMQ): codec, publisher,
  subscriber, index, endpoints, one file each.
- :mod:`kvstream.poolstream`: the project's own pool stream (keyframes, per-step deltas, events): schema, encoder,
  decoder, and the ZMQ publisher / subscriber of ``--publish`` / ``--attach``; :mod:`kvstream.history` keeps it in
  memory, :mod:`kvstream.recording` on disk.
- :mod:`kvstream.endpoints`: ZMQ endpoints checked in one place (ports, wildcards) and the data-parallel rank rule;
  :mod:`kvstream.curve`: CURVE keys, so that only authorized watchers read a pool stream.
- :mod:`kvstream.vllm.plugin`: the vLLM general plugin that publishes a vLLM server's pool as a pool stream.
"""
