"""Where the local engine's frames go besides the window: a recording file (``--record``) and a ZMQ publisher
(``--publish``), as sinks of its runner.

Both are the kvstream pool stream; the runner encodes each frame once and hands the same bytes to every sink.
"""
from __future__ import annotations


def engine_sinks(opts) -> list:
    """Sinks for ``--record FILE`` and ``--publish ENDPOINT``; raises ValueError/OSError with a clear message."""
    sinks: list = []
    if not (opts.record or opts.publish):
        return sinks
    try:
        if opts.record:
            from kvstream.recording import Recorder
            sinks.append(Recorder(opts.record))
        if opts.publish:
            from kvstream.poolstream.publisher import PoolStreamPublisher
            sinks.append(PoolStreamPublisher(opts.publish))
    except Exception:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        raise
    return sinks
