"""The command line of DESIGN.md, parsed and checked before anything heavy loads.

Every mistake ends in one line, ``error: ...`` on stderr, and exit status 2: argparse's own usage dump is replaced
by that line, and combinations that cannot work together (``--json`` without ``--headless``, ``--record`` of an
attached pool, ...) are refused here with the reason, before torch or Qt start.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

DEMO_NAMES = ("busy", "crowd", "serve", "tiers", "window", "traffic", "lesson", "none")

USAGE = """python main.py [--model builtin|smollm2|PATH] [--block-size N] [--num-blocks N] [--device cpu|cuda|auto]
               [--demo busy|crowd|serve|tiers|window|traffic|lesson|none] [--headless] [--json]
               [--screenshot PATH] [--quit-after SECONDS]
               [--geometry WxH] [--record FILE] [--open FILE] [--kv-events ENDPOINT] [--publish ENDPOINT]
               [--attach ENDPOINT]... [--attach-kv-events ENDPOINT]... [--tokenizer DIR] [--compile-attention]
               [--make-keys DIR] [--fetch-model NAME] [--host-tier-blocks N] [--disk-tier-blocks N]
               [--disk-tier-path FILE] [--dtype float32|bfloat16] [--eviction-policy NAME]
               [--trace FILE [--replay instant|timed] [--trace-speed X] [--trace-scale X]
                [--sweep CAPACITY[,CAPACITY...] [--policies lru,fifo,...] [--kv-shape CONFIG.json]
                 [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2] [--warmup F]]] [--export-trace FILE]
               [--check-prompt FILE] [--metrics-port PORT] [--attach-metrics URL]"""

POLICY_NAMES = ("lru", "fifo", "s3fifo", "s3lru", "radix", "belady")  # engine.EVICTION_POLICIES (a test checks)
SWEEP_POLICIES = "lru,fifo,s3lru,belady"  # a sweep's policies unless --policies says


class UsageError(Exception):
    """A command line that cannot run; the message is the one line the user sees."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line and exit 2 (not the usage text)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        raise UsageError(message)


def parse_geometry(text: str) -> tuple[int, int]:
    """'1366x768' -> (1366, 768); a clear ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d{1,9})\s*[xX×]\s*(\d{1,9})\s*", text or "")  # 0x0: a number, out of range
    if not match:
        raise ValueError(f"--geometry must look like WIDTHxHEIGHT (for example 1366x768), got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not (320 <= width <= 16384 and 240 <= height <= 16384):
        raise ValueError(f"--geometry {width}x{height} is out of range: width 320-16384, height 240-16384 pixels")
    return width, height


def check_endpoint(flag: str, endpoint: str, bind: bool = False) -> str:
    """A ZMQ endpoint ``tcp://host:port``, ``ipc://path`` or ``inproc://name``; ``*`` as host only to bind. The one
    rule of kvstream.endpoints (ports 1-65535), said as a usage error naming ``flag``."""
    from kvstream.endpoints import EndpointError
    from kvstream.endpoints import check_endpoint as check
    try:
        return check(endpoint, bind=bind, what=flag)
    except EndpointError as exc:
        raise UsageError(str(exc)) from None


def check_stream_spec(flag: str, spec: str, bind: bool = False) -> str:
    """``ENDPOINT[,curve=DIR]`` of ``--publish`` / ``--attach``: the endpoint checked as above, and the CURVE key
    directory holding what a publisher (``bind``) or a watcher needs."""
    from kvstream.curve import check_directory
    from kvstream.endpoints import EndpointError, stream_spec
    try:
        _, curve = stream_spec(spec, bind=bind, what=flag)
        if curve is not None:
            check_directory(curve, server=bind)
    except EndpointError as exc:
        raise UsageError(str(exc)) from None
    return spec


def _check_output_file(flag: str, path: str, regular: bool = False) -> None:
    """The folder must exist and be writable; ``regular``: an existing path must be a regular file (a PNG written
    into /dev/full or a FIFO is never a screenshot; a recording may go to a pipe)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if regular and os.path.exists(path) and not os.path.isfile(path):
        raise UsageError(f"{flag} {path} exists and is not a regular file; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="main.py", description="Paged KV-cache explorer", usage=USAGE)
    parser.add_argument("--model", default=None,
                        help="'builtin' (the default; a demo runs smollm2 once fetched), 'smollm2', a local "
                             "checkpoint directory or a local Llama-architecture .gguf file")
    parser.add_argument("--fetch-model", metavar="NAME", choices=("smollm2",),
                        help="download and convert a real model into the user's cache once, then exit")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per block (default 16)")
    parser.add_argument("--num-blocks", type=int, default=128, help="physical blocks in the pool (default 128)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--demo", default="none", choices=DEMO_NAMES,
                        help="busy: a few conversations sharing blocks; crowd: many, for large pools; serve: a server's "
                             "traffic that never runs dry (busy and crowd go on as served traffic in the window); "
                             "tiers: prefixes that come back from a host tier; window: a model with a sliding-window group; lesson")
    parser.add_argument("--headless", action="store_true", help="no window: print progress (or --json) instead")
    parser.add_argument("--json", action="store_true",
                        help="with --headless: one JSON object per line, about once a second and once at exit")
    parser.add_argument("--screenshot", metavar="PATH", help="save a PNG of the window once it is drawn")
    parser.add_argument("--quit-after", type=float, metavar="SECONDS", help="close the app after this long")
    parser.add_argument("--geometry", metavar="WxH", help="window size in pixels, e.g. 1366x768")
    parser.add_argument("--record", metavar="FILE", help="save the local engine's pool stream to FILE while running")
    parser.add_argument("--open", metavar="FILE", help="replay a recording (GUI: scrub it; headless: to the end)")
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="the local engine publishes vLLM-format KV events on this ZMQ endpoint (as vLLM does: "
                             "tcp://*:PORT and ipc:// bind, a host address connects); ENDPOINT,replay=ADDR adds the "
                             "replay socket late watchers catch up through, ,topic=T a topic, ,curve=DIR lets in only "
                             "watchers holding a key authorized in DIR (--make-keys; vLLM's own consumers cannot)")
    parser.add_argument("--publish", metavar="ENDPOINT", help="publish the local engine's pool stream over ZMQ; "
                        "ENDPOINT,curve=DIR lets in only watchers holding a key authorized in DIR (--make-keys)")
    parser.add_argument("--attach", metavar="ENDPOINT", action="append", default=[],
                        help="watch a pool stream (another --publish, or vLLM with the plugin); repeatable; "
                             "ENDPOINT,curve=DIR to a publisher that asks for CURVE keys")
    parser.add_argument("--make-keys", metavar="DIR", help="make a CURVE key directory for --publish/--attach "
                        "ENDPOINT,curve=DIR (and the vLLM plugin's PAGED_KV_EXPLORER_CURVE), then exit")
    parser.add_argument("--attach-kv-events", metavar="ENDPOINT", action="append", default=[],
                        help="watch a vLLM/SGLang KV-event stream; repeatable; ENDPOINT,curve=DIR for this app's "
                             "engine publishing with --kv-events ENDPOINT,curve=DIR")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (tokenizer.json) for token text")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dtype of the local engine's weights, activations and KV cache (default float32; "
                             "bfloat16 halves the pool's bytes per block)")
    parser.add_argument("--compile-attention", action="store_true",
                        help="decode attention through the torch.compile'd kernel for every shape, compiled on the "
                             "engine thread (seconds per batch/context size bucket). Without it, contexts of 512+ "
                             "tokens in steady use are compiled in the background and take the kernel where it "
                             "measures faster")
    parser.add_argument("--host-tier-blocks", type=int, default=0, metavar="N",
                        help="keep up to N blocks the device pool evicts in host memory, and load them back on a "
                             "prefix hit (default 0: off)")
    parser.add_argument("--disk-tier-blocks", type=int, default=0, metavar="N",
                        help="keep up to N blocks the host tier evicts on disk, in --disk-tier-path (default 0: off)")
    parser.add_argument("--disk-tier-path", metavar="FILE",
                        help="the disk tier's file: created new (mode 0600), or a tier file of an earlier run reused; "
                             "any other existing file is refused")
    parser.add_argument("--eviction-policy", default="lru", choices=POLICY_NAMES,
                        help="which cached block the pool gives up first: lru (vLLM's free queue, the default), "
                             "fifo, s3fifo, s3lru (S3-FIFO's probation in front of LRU), radix (SGLang's radix "
                             "cache) or belady (furthest next use: a trace "
                             "replay only, it needs the future)")
    parser.add_argument("--trace", metavar="FILE", help="the local engine's traffic comes from a request trace "
                        "(Mooncake JSONL or kv-cache-tester JSON); --model none replays full-size traces")
    parser.add_argument("--replay", choices=("instant", "timed"), help="with --trace: instant (one request at a "
                        "time, no outputs: the hit figures of a capacity sweep; the default headless) or timed "
                        "(arrivals on the trace's clock, outputs decoded; the default in the window)")
    parser.add_argument("--trace-speed", type=float, metavar="X", help="with --trace: arrivals come X times "
                        "faster than the trace's clock (default 1)")
    parser.add_argument("--trace-scale", type=float, metavar="X", help="with --trace: each request decodes X times "
                        "its output length (default 1)")
    parser.add_argument("--export-trace", metavar="FILE", help="write the traffic this run sees (a recording, "
                        "or the local engine's) as a Mooncake JSONL trace, to replay at other sizes")
    parser.add_argument("--sweep", metavar="CAPACITIES", help="with --trace and --headless: no live run; the hit "
                        "rate at each capacity (blocks, or bytes such as 8GiB with --kv-shape) for each policy")
    parser.add_argument("--policies", metavar="NAMES", help=f"with --sweep: eviction policies (default "
                        f"{SWEEP_POLICIES}; any of {', '.join(POLICY_NAMES)})")
    parser.add_argument("--kv-shape", metavar="CONFIG.json", help="with --sweep: a Hugging Face config.json whose "
                        "K/V size per token turns byte capacities into blocks")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="how the local engine's pool stores K/V, as vLLM's option of that name (default auto: "
                             "the model's dtype; fp8 is e4m3, a quarter of float32's bytes per block, half of "
                             "bfloat16's); a sweep counts its bytes")
    parser.add_argument("--warmup", type=float, metavar="F", help="with --sweep: count only the last 1 - F of the "
                        "requests, as kvcache-simulator does (default 0: all)")
    parser.add_argument("--check-prompt", metavar="FILE", help="would this prompt hit? FILE holds a prompt (text, "
                        "tokenised with the model's tokenizer or --tokenizer, or a JSON list of token ids): which of "
                        "its blocks the watched or local pool holds now, where, and why the others miss; read again "
                        "whenever it changes (a file not there yet is waited for); --json lines carry prompt_check")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the local engine's /metrics in Prometheus' format under vLLM's names on this port "
                             "(all interfaces; 0: a free port, said on stderr)")
    parser.add_argument("--attach-metrics", metavar="URL",
                        help="with --attach-kv-events: read that vLLM server's own /metrics (http://HOST:PORT"
                             "/metrics) and show its hit rate and KV usage beside what its KV events say")
    return parser


def _check_tiers(opts: argparse.Namespace) -> None:
    """--host-tier-blocks, --disk-tier-blocks and --disk-tier-path: sizes, the pairing, and the file's folder."""
    for flag, value in (("--host-tier-blocks", opts.host_tier_blocks), ("--disk-tier-blocks", opts.disk_tier_blocks)):
        if value < 0:  # the upper bound is EngineConfig's (main.py reports it the same way, exit 2)
            raise UsageError(f"{flag} must be 0 (off) or more, got {value}")
    if opts.disk_tier_blocks and not opts.disk_tier_path:
        raise UsageError("--disk-tier-blocks needs --disk-tier-path FILE (where the disk tier writes)")
    if opts.disk_tier_path and not opts.disk_tier_blocks:
        raise UsageError("--disk-tier-path needs --disk-tier-blocks N (how many blocks the disk tier holds)")
    if opts.disk_tier_path:
        _check_output_file("--disk-tier-path", opts.disk_tier_path)
        # the tier file is written over at start: never the recording (--open runs no local engine, refused above)
        if opts.record and _same_path(opts.disk_tier_path, opts.record):
            raise UsageError(f"--disk-tier-path {opts.disk_tier_path} is the file --record writes; give the disk "
                             "tier a file of its own")


def _same_path(a: str, b: str) -> bool:
    """Whether two paths name one file (through links too), or would once created."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _check_metrics(opts: argparse.Namespace) -> None:
    """--metrics-port's range; --attach-metrics' URL, and the KV events it is read beside."""
    if opts.metrics_port is not None and not 0 <= opts.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be a port 1-65535 (0: a free one), got {opts.metrics_port}")
    if opts.metrics_port is not None and opts.sweep is not None:
        raise UsageError("--sweep replays the trace without an engine: --metrics-port would serve nothing; drop it")
    if opts.attach_metrics is not None:
        from kvstream.metrics import MetricsError, check_url
        try:
            opts.attach_metrics = check_url(opts.attach_metrics)
        except MetricsError as exc:
            raise UsageError(str(exc)) from None
        if not opts.attach_kv_events:
            raise UsageError("--attach-metrics reads a vLLM server's /metrics beside its KV events: add "
                             "--attach-kv-events ENDPOINT of the same server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check; raises UsageError with the one line to print."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    for action in parser._actions:  # an empty value is a mistake, never "absent" (--make-keys '' opened the window)
        values = getattr(opts, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str) and not value.strip() and action.option_strings:
                raise UsageError(f"{action.option_strings[0]} needs a value, got an empty one")
    opts.size = parse_geometry(opts.geometry) if opts.geometry is not None else None
    if opts.quit_after is not None and not opts.quit_after >= 0:
        raise UsageError("--quit-after must be a number of seconds, 0 or more")
    if opts.json and not opts.headless:
        raise UsageError("--json prints to the terminal: add --headless (the window has File > Export > JSON)")
    if opts.headless and opts.screenshot:
        raise UsageError("--screenshot needs the window; drop --headless")
    if opts.headless and opts.geometry:
        raise UsageError("--geometry sizes the window; drop --headless")
    if opts.headless and opts.demo == "lesson":
        raise UsageError("the lesson needs the window; drop --headless")
    if opts.screenshot:
        _check_output_file("--screenshot", opts.screenshot, regular=True)
    for endpoint in opts.attach:
        check_stream_spec("--attach", endpoint)
    for spec in opts.attach_kv_events:  # ENDPOINT[,replay=ADDR][,topic=T][,dp=N][,name=X][,curve=DIR]
        from kvstream.curve import check_directory
        from kvstream.kv_events.endpoint import parse_endpoint_spec, usable
        try:
            for endpoint in parse_endpoint_spec(spec):
                usable(endpoint)  # ports 1-65535 (ZMQ would wrap 99999 to 34463)
                if endpoint.curve:
                    check_directory(endpoint.curve, server=False)
        except ValueError as exc:
            raise UsageError(f"--attach-kv-events: {exc}") from None
    if opts.publish:
        check_stream_spec("--publish", opts.publish, bind=True)
    opts.kv_events_replay, opts.kv_events_topic, opts.kv_events_curve = None, "", None
    if opts.kv_events is not None:  # ENDPOINT[,replay=ADDR][,topic=T][,curve=DIR], as --attach-kv-events reads it
        from kvstream.curve import check_directory
        from kvstream.endpoints import split_spec
        try:
            first, options = split_spec(opts.kv_events, {"replay": None, "topic": "", "curve": None},
                                        "use replay=ADDR, topic=T or curve=DIR", bare="replay")
            if options["curve"] is not None:
                opts.kv_events_curve = check_directory(options["curve"], server=True)
        except ValueError as exc:
            raise UsageError(f"--kv-events: {exc}") from None
        if options["replay"] is not None:
            opts.kv_events_replay = check_endpoint("--kv-events replay", options["replay"], bind=True)
        opts.kv_events_topic = options["topic"]
        opts.kv_events = check_endpoint("--kv-events", first, bind=True)
    _check_metrics(opts)
    watching = [flag for flag, on in (("--open", opts.open), ("--attach", opts.attach),
                                      ("--attach-kv-events", opts.attach_kv_events)) if on]
    if opts.open and (opts.attach or opts.attach_kv_events):
        raise UsageError("--open replays one recording; it cannot be combined with --attach or --attach-kv-events")
    if watching:
        local = [flag for flag, on in (("--record", opts.record), ("--publish", opts.publish),
                                       ("--kv-events", opts.kv_events), ("--compile-attention",
                                                                         opts.compile_attention),
                                       ("--demo", opts.demo not in ("none", "lesson")),
                                       ("--host-tier-blocks", opts.host_tier_blocks),
                                       ("--disk-tier-blocks", opts.disk_tier_blocks),
                                       ("--metrics-port", opts.metrics_port is not None)) if on]
        if local:
            raise UsageError(f"{' and '.join(local)} run the local engine, but {watching[0]} watches another "
                             "source instead; use them in separate runs")
    if opts.open and not os.path.isfile(opts.open):
        raise UsageError(f"--open {opts.open}: no such file" if not os.path.exists(opts.open)
                         else f"--open {opts.open} is not a file")
    if opts.record:
        _check_output_file("--record", opts.record)
        if opts.open and os.path.abspath(opts.open) == os.path.abspath(opts.record):
            raise UsageError("--record would overwrite the file --open reads")
    _check_tiers(opts)
    _traffic_demo(opts)
    _check_trace(opts, watching)
    if opts.check_prompt is not None:
        if opts.sweep is not None:
            raise UsageError("--check-prompt checks a prompt against a running pool; a --sweep runs none")
        if os.path.isdir(opts.check_prompt):
            raise UsageError(f"--check-prompt {opts.check_prompt} is a folder; give the prompt's file")
    if opts.tokenizer is not None and not _builtin_tokenizer(opts.tokenizer):
        if not os.path.isdir(opts.tokenizer):
            raise UsageError(f"--tokenizer {opts.tokenizer}: no such directory")
        if not os.path.isfile(os.path.join(opts.tokenizer, "tokenizer.json")):
            raise UsageError(f"--tokenizer {opts.tokenizer} has no tokenizer.json")
    return opts


def _traffic_demo(opts: argparse.Namespace) -> None:
    """``--demo traffic`` is a trace replay of the shipped excerpt, paced for a person: it becomes ``--trace`` with
    the demo's replay settings (those the user gave win), and ``opts.traffic_demo`` says it was the demo."""
    opts.traffic_demo = opts.demo == "traffic"
    if not opts.traffic_demo:
        return
    if opts.trace is not None:
        raise UsageError("--demo traffic replays its own trace; drop --trace (or --demo to replay yours)")
    from .feeds import traffic_demo
    defaults = build_parser()
    for name, value in traffic_demo.SETTINGS.items():  # the demo's pool and model, unless the user named theirs
        if getattr(opts, name) == defaults.get_default(name):
            setattr(opts, name, value)
    opts.trace = traffic_demo.excerpt_path()
    opts.replay = opts.replay or traffic_demo.MODE
    opts.trace_speed = opts.trace_speed or traffic_demo.SPEED
    opts.trace_scale = opts.trace_scale or traffic_demo.SCALE
    opts.demo = "none"


def _check_trace(opts: argparse.Namespace, watching: list[str]) -> None:
    """--trace and what goes with it: the file, the replay's settings, a sweep's capacities and policies."""
    needs_trace = [flag for flag, on in (("--replay", opts.replay), ("--trace-speed", opts.trace_speed is not None),
                                         ("--trace-scale", opts.trace_scale is not None),
                                         ("--sweep", opts.sweep is not None)) if on]
    if needs_trace and opts.trace is None:
        raise UsageError(f"{needs_trace[0]} goes with --trace FILE (the trace to replay)")
    needs_sweep = [flag for flag, on in (("--policies", opts.policies is not None),
                                         ("--kv-shape", opts.kv_shape is not None),
                                         ("--warmup", opts.warmup is not None)) if on]
    if needs_sweep and opts.sweep is None:
        raise UsageError(f"{needs_sweep[0]} goes with --sweep CAPACITIES")
    if opts.eviction_policy == "belady" and opts.trace is None:
        raise UsageError("--eviction-policy belady needs to know every request to come: only a trace replay "
                         "(--trace FILE) can run it")
    if opts.export_trace is not None:
        _check_output_file("--export-trace", opts.export_trace)
        streams = [w for w in watching if w != "--open"]
        if streams:
            raise UsageError(f"--export-trace writes the local engine's traffic or a recording's (--open), not a "
                             f"stream {streams[0]} watches: record it (--record), then --open it with --export-trace")
        if opts.sweep is not None:
            raise UsageError("--export-trace writes the traffic of a run; --sweep runs none")
        for flag, other in (("--open", opts.open), ("--record", opts.record)):
            if other and os.path.abspath(opts.export_trace) == os.path.abspath(other):
                raise UsageError(f"--export-trace would overwrite the file {flag} names")
    if opts.trace is None:
        return
    if watching:
        raise UsageError(f"--trace drives the local engine, but {watching[0]} watches another source instead")
    if opts.demo not in ("none",):
        raise UsageError(f"--trace and --demo {opts.demo} both bring the engine its traffic: use one")
    if os.path.isdir(opts.trace):
        raise UsageError(f"--trace {opts.trace} is a folder; give a trace file (Mooncake .jsonl or "
                         "kv-cache-tester .json)")
    if not os.path.isfile(opts.trace):
        raise UsageError(f"--trace {opts.trace}: no such file")
    if opts.export_trace is not None and os.path.abspath(opts.export_trace) == os.path.abspath(opts.trace):
        raise UsageError("--export-trace would overwrite the trace --trace reads")
    for flag, value in (("--trace-speed", opts.trace_speed), ("--trace-scale", opts.trace_scale)):
        if value is not None and not (value > 0 and value < float("inf")):
            raise UsageError(f"{flag} must be a positive number, got {value}")
    if opts.sweep is None:
        return
    if not opts.headless:
        raise UsageError("--sweep prints figures and opens no window: add --headless (the window's Capacity dock "
                         "sweeps the trace you open)")
    if opts.demo not in ("none",):
        raise UsageError("--sweep replays the trace, not a demo: drop --demo")
    from engine import SweepError, parse_capacity
    capacities = []
    for text in opts.sweep.split(","):
        try:
            capacities.append((text.strip(), *parse_capacity(text)))
        except SweepError as exc:
            raise UsageError(f"--sweep: {exc}") from None
    if any(nbytes is not None for _, _, nbytes in capacities) and opts.kv_shape is None:
        raise UsageError("--sweep: a capacity in bytes needs --kv-shape CONFIG.json (how many bytes a token's K/V "
                         "takes)")
    if opts.kv_shape is not None and not os.path.isfile(opts.kv_shape):
        raise UsageError(f"--kv-shape {opts.kv_shape}: no such file")
    opts.capacities = capacities
    policies = [p.strip() for p in (opts.policies or SWEEP_POLICIES).split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        raise UsageError(f"--policies: {unknown[0] if unknown else 'none given'} is not a policy; choose from "
                         f"{', '.join(POLICY_NAMES)}")
    opts.policy_list = list(dict.fromkeys(policies))
    if opts.warmup is not None and not 0 <= opts.warmup < 1:
        raise UsageError(f"--warmup must be at least 0 and below 1, got {opts.warmup}")


def source_spec(opts: argparse.Namespace):
    """The run's sources and sinks as the rooms below take them: the one place the namespace's flags are read for
    them (explorer/feeds never sees argparse)."""
    from .feeds.sources import SinkSpec, SourceSpec, WatchSpec
    watch = WatchSpec(open=opts.open, attach=tuple(opts.attach), attach_kv_events=tuple(opts.attach_kv_events),
                      tokenizer=opts.tokenizer, attach_metrics=getattr(opts, "attach_metrics", None))
    sinks = SinkSpec(record=opts.record, publish=opts.publish, kv_events=opts.kv_events,
                     kv_events_replay=getattr(opts, "kv_events_replay", None))
    return SourceSpec(watch=watch, sinks=sinks, demo=opts.demo)


def engine_config(opts: argparse.Namespace):
    """The local engine's EngineConfig from the checked flags; raises EngineError for values the engine refuses."""
    from engine import EngineConfig
    return EngineConfig(model=opts.model, block_size=opts.block_size, num_blocks=opts.num_blocks,
                        device=opts.device, dtype=opts.dtype, compile_attention=opts.compile_attention,
                        kv_events_endpoint=opts.kv_events, kv_events_replay_endpoint=opts.kv_events_replay,
                        kv_events_topic=opts.kv_events_topic, kv_events_curve=opts.kv_events_curve,
                        host_tier_blocks=opts.host_tier_blocks, disk_tier_blocks=opts.disk_tier_blocks,
                        disk_tier_path=opts.disk_tier_path, eviction_policy=opts.eviction_policy,
                        kv_cache_dtype=opts.kv_cache_dtype)


def _builtin_tokenizer(path: str) -> bool:
    """``--tokenizer builtin`` or ``--tokenizer resources/builtin``: the built-in byte tokenizer (no tokenizer.json)."""
    from .feeds.stream_feed import is_builtin_tokenizer
    return is_builtin_tokenizer(path)


def display_problem(env=None) -> str | None:
    """Why the window could not open, in one line, or None. On Linux with no display Qt's xcb plugin aborts the
    process (SIGABRT, a core dump) after a hint to install libxcb-cursor0, which is not the cause; this says what to
    do instead, before Qt (or torch) loads."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return None
    platform = env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0].strip().lower()
    hint = "run with --headless, or set QT_QPA_PLATFORM=offscreen to draw without a display (e.g. for --screenshot)"
    if platform.startswith("wayland") and not env.get("WAYLAND_DISPLAY"):
        return f"QT_QPA_PLATFORM is {platform} but WAYLAND_DISPLAY is not set: {hint}"
    if platform and platform != "xcb":  # offscreen, minimal, vnc, eglfs, wayland with its display ...
        return None
    wayland = env.get("WAYLAND_DISPLAY")
    if wayland and not platform:  # Qt's default on Linux takes Wayland when a compositor is there
        folder = env.get("XDG_RUNTIME_DIR", "")
        if os.path.exists(wayland if os.path.isabs(wayland) else os.path.join(folder, wayland)):
            return None
    display = env.get("DISPLAY")
    if not display:
        return f"no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set): {hint}"
    if not _x_reachable(display):
        return f"cannot reach the X display {display!r} (DISPLAY): {hint}"
    return None


def _x_reachable(display: str) -> bool:
    """Whether an X server answers at ``display`` ("[host]:N[.screen]"): a connect to its socket, nothing more."""
    import socket

    host, sep, rest = display.rpartition(":")
    number = rest.split(".")[0]
    if not sep or not number.isdigit():
        return False
    if host in ("", "unix"):
        path = f"/tmp/.X11-unix/X{number}"
        for address in (path, "\0" + path):  # the file, then Linux's abstract socket of the same name
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(2.0)
                try:
                    sock.connect(address)
                    return True
                except OSError:
                    continue
        return False
    try:
        with socket.create_connection((host.strip("[]"), 6000 + int(number)), timeout=2.0):
            return True
    except OSError:
        return False


def parse_or_exit(argv: list[str] | None = None) -> argparse.Namespace:
    """parse_args, or print the one line and exit 2."""
    try:
        return parse_args(argv)
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
