"""Run without a window: the same feeds as the GUI, printed as text or as one JSON object per line.

``--headless`` drives the local engine (its runner thread, with the recorder and publisher sinks the command line
asks for) until nothing is left to decode, or plays a recording to its end, or follows attached streams until
``--quit-after`` or Ctrl+C. Text mode prints a progress line about once a second and, at the end, the text each
conversation generated; ``--json`` prints DESIGN.md's summary object (``kvstream.summary.json_summary``) about
once a second and once at exit, which is what scripts and CI read.

No Qt is imported here: headless runs on machines without a display.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import Counter

PRINT_INTERVAL_S = 1.0  # a line about once a second
POLL_S = 0.05  # how often the main thread looks at the feeds
TEXT_PREVIEW = 400  # characters of each conversation's output printed at the end


def summary_line(snap) -> str:
    """One progress line for a view: step, conversations by status, pool occupancy."""
    statuses = Counter(str(c.status) for c in snap.conversations)
    mem = snap.memory
    pool = (f"pool {mem.num_used_blocks} used / {mem.num_cached_blocks} cached / {mem.num_free_blocks} free, "
            f"{mem.num_filled_slots}/{mem.num_allocated_slots} slots filled" if mem else
            f"pool of {snap.num_blocks} blocks")
    convs = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no conversations"
    return f"step {snap.step_id:5d}: {convs}; {pool}"


def conversation_texts(snap, limit: int = TEXT_PREVIEW) -> list[str]:
    """'conversation 3 (finished: max new tokens, 40 tokens): <its output>' for each conversation of the view."""
    from .model.event_text import finish_words
    from .model.words import count
    lines = []
    for c in snap.conversations:
        reason = f": {finish_words(c.finish_reason)}" if c.finish_reason is not None else ""
        text = c.output_text if len(c.output_text) <= limit else c.output_text[:limit] + "…"
        lines.append(f"{c.name} ({c.status}{reason}, {count(len(c.output_token_ids), 'token')}): {text!r}")
    return lines


class _Stop:
    """Set by SIGINT/SIGTERM so the last line is still printed."""

    def __init__(self):
        self.event = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.event.set())


def follow(feeds, *, json_mode: bool, quit_after: float | None, out=print, done=None,
           check_prompt: str | None = None) -> int:
    """Poll ``feeds`` until ``done()`` (all finished), ``quit_after`` seconds, or a signal; print as asked.
    ``check_prompt``: the --check-prompt file, checked against every feed (explorer.feeds.prompt_watch).

    Returns the exit status: 0, or 1 when an output stopped (a full disk under ``--record``). The last line(s)
    describe each feed's final view.
    """
    stop = _Stop()
    stop.install()
    start = last_print = time.perf_counter()
    printed_any = False
    watch = None
    if check_prompt is not None:
        from .feeds.prompt_watch import PromptWatch
        watch = PromptWatch(check_prompt, feeds)
    while True:
        now = time.perf_counter()
        finished = done is not None and done()
        timed_out = quit_after is not None and now - start >= quit_after
        if finished or timed_out or stop.event.is_set():
            break
        if watch is not None and watch.tick() and not json_mode:
            _print_checks(watch, out)
        if now - last_print >= PRINT_INTERVAL_S or not printed_any:
            printed_any = _print_views(feeds, json_mode, out, watch=watch) or printed_any
            last_print = now
        stop.event.wait(POLL_S)
    failed = False
    for feed in feeds:
        for problem in feed.take_problems():
            print(f"{problem.title}: {problem.text}", file=sys.stderr)
            failed = failed or problem.title == "Output stopped"  # --record's disk filled, --publish's socket died
    if watch is not None:
        version = watch.version
        watch.settle()  # the final line's answer is the final pool's
        if not json_mode and watch.version != version:
            _print_checks(watch, out)
    _print_views(feeds, json_mode, out, final=True, watch=watch)
    return 1 if failed else 0


def _print_checks(watch, out) -> None:
    """Text mode: each feed's prompt check in words, when it changed."""
    from .model.outcome_text import check_sentence
    for feed in watch.feeds:
        state = watch.state_of(feed)
        head = f"prompt check ({watch.path})" + (f", {feed.title}" if len(watch.feeds) > 1 else "")
        if state.status == "checked":
            for check in state.checks:
                out(f"{head}{', ' + check.source if len(state.checks) > 1 else ''}: {check_sentence(check)}")
        elif state.status != "pending":
            out(f"{head}: {state.status}: {state.error}")


def _print_views(feeds, json_mode: bool, out, final: bool = False, watch=None) -> bool:
    """One line per pool (JSON or text); at the end, text mode adds what each conversation generated."""
    printed = False
    for feed in feeds:
        if json_mode:
            for pool, data in enumerate(feed.summaries(final)):
                if watch is not None:
                    data = {**data, "prompt_check": watch.json_for(feed, pool)}
                out(json.dumps(data))
                printed = True
            continue
        if not feed.capabilities.has_physical_pool:
            out(f"{feed.title}: {feed.status_text()}")
            printed = True
            continue
        snap = feed.final_view() if final else feed.latest()
        if snap is None:
            continue
        printed = True
        out(summary_line(snap) if len(feeds) == 1 else f"{feed.title}: {summary_line(snap)}")
        if final:
            for line in conversation_texts(snap):
                out("  " + line)
    return printed


def run_headless_cli(opts, cfg, spec) -> int:
    """``main.py --headless``: build the feeds ``spec`` (a SourceSpec) asks for and follow them; 2 on
    a source that fails. ``opts`` still carries the run's own flags (--json, --quit-after, the trace's)."""
    from .feeds import trace_export
    from .feeds.sources import open_sources
    feeds, engine, traffic, export = [], None, None, None
    # --export-trace: the local engine's traffic, seen step by step (a recording's is read from its file at the end)
    exported = trace_export.TraceExport() if opts.export_trace else None
    try:
        if spec.watch:
            feeds = open_sources(spec, window=False).feeds  # the same sources as the window builds
            for feed in feeds:
                feed.started()
            done = (lambda: all(f.complete for f in feeds)) if opts.open else None
        else:
            from engine import Engine

            from .feeds.demo import DEMOS
            if opts.metrics_port is not None:  # a port in use is said before the model loads
                from .model.metrics_export import start_export
                export = start_export(opts.metrics_port)
            driver = None
            if getattr(opts, "trace", None):  # the engine's traffic comes from a trace, fed on its own thread
                from engine import make_replay, read_trace
                driver = make_replay(cfg, read_trace(opts.trace), opts.replay or "instant", opts.trace_speed or 1.0,
                                     opts.trace_scale or 1.0)
                engine, cfg = driver.engine, driver.engine.cfg
                for note in driver.trace.notes:
                    print(f"trace: {note}", file=sys.stderr)
            else:
                engine = Engine(cfg, progress=None)
            if opts.demo in DEMOS:
                for note in DEMOS[opts.demo](engine).notes:  # a request lowered to fit the pool: say so
                    print(f"{opts.demo} demo: {note}", file=sys.stderr if opts.json else sys.stdout)
            sources = open_sources(spec, cfg, engine, window=False, driver=driver, export=export, traffic=exported)
            feeds, outputs = sources.feeds, sources.outputs
            engine = None  # the feed owns it now: closing the feed closes it
            done = feeds[0].idle
            if opts.demo == "serve":  # served traffic never runs dry: until --quit-after or Ctrl+C
                from .feeds.traffic import TrafficDriver
                traffic = TrafficDriver(feeds[0]).start()
                done = None
                print("serving traffic (1 request/s); stop with Ctrl+C"
                      + (f" (or after {opts.quit_after:g} s)" if opts.quit_after is not None else ""),
                      file=sys.stderr, flush=True)
            # --publish and --kv-events are for watchers in other processes: the run keeps publishing until
            # --quit-after or Ctrl+C instead of closing its sockets once idle (a late watcher catches up through
            # --kv-events' replay socket, if one was given)
            if outputs:
                done = None
                print(f"publishing {' and '.join(outputs)}; stop with Ctrl+C"
                      + (f" (or after {opts.quit_after:g} s)" if opts.quit_after is not None else ""),
                      file=sys.stderr, flush=True)
    except (ValueError, OSError, ImportError) as exc:  # EngineError, RecordingError, PublishError are ValueErrors
        for feed in feeds:
            feed.close()
        if export is not None:
            export.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:  # built, but a demo's setup or an output failed before a feed took it over
            engine.close()  # its KV-event sockets
    started = time.perf_counter()
    try:
        status = follow(feeds, json_mode=opts.json, quit_after=opts.quit_after, done=done,
                        check_prompt=getattr(opts, "check_prompt", None))
    finally:
        if traffic is not None:
            traffic.stop()
        for feed in feeds:
            feed.close()
        if export is not None:
            export.close()
    if exported is not None and not trace_export.write_for(exported, opts.export_trace, opts.open):
        status = status or 2
    if not opts.json and feeds and feeds[0].capabilities.can_command:  # the local engine: its decode rate
        snap = feeds[0].final_view()
        elapsed = time.perf_counter() - started
        tokens = snap.metrics.num_generated_tokens
        ended = "stopped" if traffic is not None else "idle"  # served traffic never runs dry
        print(f"{ended} after {snap.metrics.num_steps} steps in {elapsed:.1f} s; {tokens} tokens generated "
              f"({tokens / max(elapsed, 1e-9):.1f} tokens/s)")
    return status


def run_sweep_cli(opts, out=print) -> int:
    """``main.py --trace FILE --sweep CAPACITIES --headless``: the hit rate of each policy at each capacity, then
    the infinite pool; one JSON object a line with ``--json``, else a table. No torch, no window: the fast path
    replays the trace (engine.traffic.sweep). Returns 2 on a trace or capacity that cannot be used."""
    from engine import Sweep, SweepError, TraceError, blocks_for_bytes, kv_bytes_per_token, read_trace
    try:
        trace = read_trace(opts.trace)
        sweep = Sweep(trace, opts.warmup or 0.0)
        per_token = None
        if opts.kv_shape is not None:
            per_token, shape = kv_bytes_per_token(opts.kv_shape, opts.kv_cache_dtype)
            if not opts.json:
                out(f"K/V per token: {per_token:,} bytes ({shape}); a block of {trace.block_size} tokens: "
                    f"{per_token * trace.block_size / 2**20:.2f} MiB")
        points = []
        for text, blocks, nbytes in opts.capacities:
            if blocks is None:
                blocks = blocks_for_bytes(nbytes, per_token, trace.block_size)
            points.append((text if nbytes is not None else "", blocks))
        if not opts.json:
            out(f"{trace.name}: {trace.num_requests:,} requests, {trace.num_blocks:,} prompt blocks of "
                f"{trace.block_size} tokens ({sweep.num_nodes:,} distinct)"
                + (f"; counting the last {sweep.requests_counted:,} after a warmup of {opts.warmup:g}"
                   if opts.warmup else ""))
            out(f"{'policy':>9} {'blocks':>9} {'hit rate':>9} {'hit blocks':>11} {'token hits':>10} "
                f"{'cold':>9} {'evicted':>9} {'after break':>11} {'prefill':>8}")
        for policy in opts.policy_list:
            for capacity, blocks in points:
                _print_point(sweep.point(policy, blocks, capacity, opts.host_tier_blocks, opts.disk_tier_blocks,
                                         opts.disk_tier_path), opts.json, out)
        _print_point(sweep.infinite(), opts.json, out)
    except BrokenPipeError:  # the reader stopped reading (``| head -1``): nothing more to say to it
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (TraceError, SweepError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not opts.json:
        out("prefill: what a prefill-bound server gains, 1 / (1 - token hit rate); belady is the offline bound")
    return 0


def _print_point(point, json_mode: bool, out) -> None:
    if json_mode:
        out(json.dumps(point.as_json()))
        return
    blocks = "infinite" if point.blocks is None else f"{point.blocks:,}"
    speedup = "-" if point.prefill_speedup == float("inf") else f"{point.prefill_speedup:.2f}x"
    m = point.misses
    out(f"{point.policy:>9} {blocks:>9} {point.hit_rate:>8.2%} {point.hit_blocks:>11,} {point.token_hit_rate:>9.2%} "
        f"{m.get('cold', 0):>9,} {m.get('evicted', 0):>9,} {m.get('after_break', 0):>11,} {speedup:>8}")
