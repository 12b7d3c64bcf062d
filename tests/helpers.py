"""What several test files share: waiting on a condition, tiny checkpoints written with the project's own model
class, faults injected into an engine's forward pass, pools built from tables.

Tests wait on what they wait for (a future, an event, a Qt signal, a status the code under test reports); where
the only thing to watch is a value another thread changes, :func:`wait_until` polls it, and :func:`holds_for` is
for the few checks whose subject is time itself (nothing happens while paused; nothing gets through).
"""
import json
import time
from pathlib import Path

POLL_S = 0.01  # how often wait_until and holds_for look at their condition


def _poll(condition, seconds: float, *, serve=None, until: bool):
    """Look at ``condition()`` every POLL_S (calling ``serve()`` first, if given) for up to ``seconds``; return
    (its last value, whether it turned ``until`` before the time was up)."""
    deadline = time.monotonic() + seconds
    while True:
        if serve is not None:
            serve()
        value = condition()
        if bool(value) == until:
            return value, True
        if time.monotonic() >= deadline:
            return value, False
        time.sleep(POLL_S)


def wait_until(predicate, timeout: float = 10.0, *, what: str = "the condition", serve=None, seen=None):
    """``predicate()``'s first true value, looked at until it holds (``serve()`` before each look: a wire peer
    answering its replay socket, a publisher sending a probe); AssertionError naming ``what`` (and ``seen()``,
    what was seen instead) after ``timeout`` seconds."""
    value, held = _poll(predicate, timeout, serve=serve, until=True)
    if not held:
        detail = f": {seen()}" if seen is not None else ""
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{detail}")
    return value


def holds_for(predicate, seconds: float, *, what: str = "the condition", serve=None) -> None:
    """Check that ``predicate()`` stays true for ``seconds`` (for checks whose subject is time itself: a paused
    engine does not step, a stranger's socket gets nothing); AssertionError naming ``what`` as soon as it fails."""
    _value, broke = _poll(predicate, seconds, serve=serve, until=False)
    if broke:
        raise AssertionError(f"{what} stopped holding within {seconds:g} s")


def joined(sub, probe, accept=None, timeout: float = 10.0):
    """Call ``probe()`` (something that makes the publisher send) until the ZMQ SUB socket ``sub`` receives a message
    ``accept(message)`` takes (any, by default), and return that message; what came before it is dropped. A PUB
    socket drops what it sends before a subscription has reached it, and tells nobody when one has."""
    def received():
        while sub.poll(0):
            message = sub.recv_multipart()
            if accept is None or accept(message):
                return message
        return None
    return wait_until(received, timeout, serve=probe, what="the subscription to reach the publisher")


def package_imports(top: str, *, named_module_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of package ``top`` (a folder at the repository's root) it imports: relative or
    absolute, at the top, inside a function or under TYPE_CHECKING (read from the source, nothing is imported).
    ``from X import name`` counts as importing X and, where it is a module, X.name; with ``named_module_only``,
    X.name alone where it is a module (the package's __init__ is then not counted as imported too)."""
    import ast
    root = Path(__file__).resolve().parents[1]
    paths = sorted((root / top).rglob("*.py"))
    names = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:  # "from . import files" names a module
                    module = f"{base}.{alias.name}"
                    found.add(module if module in names or not named_module_only else base)
                    if not (named_module_only and module in names):
                        found.add(base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in names} - {name}
    return graph


def make_config(num_blocks: int = 64, block_size: int = 4):
    """The GUI tests' engine: the built-in model on a small pool."""
    from engine import EngineConfig
    return EngineConfig(model="builtin", num_blocks=num_blocks, block_size=block_size)


def write_tiny_checkpoint(path: Path, *, vocab_size: int = 97, seed: int = 0, std: float = 0.3,
                          eos_token_id=None, num_kv_heads: int = 2) -> Path:
    """A random Llama-style model whose weights are large enough that greedy outputs vary from token to token."""
    import torch
    from safetensors.torch import save_file

    from engine.model.causal_lm import CausalLM, ModelConfig
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=12,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_ids=() if eos_token_id is None else (eos_token_id,))
    model = CausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(std / 0.02)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


_ORDINALS = {1: "first", 2: "second", 3: "third"}


def fail_forward_on_call(monkeypatch, engine, n: int) -> None:
    """Make ``engine``'s model forward raise ``RuntimeError("injected fault on the third forward call")`` (for n = 3)
    on its ``n``-th call from now (the calls before it run for real): a fault in the middle of a multi-step
    operation such as generate()."""
    real, calls = engine.runner.forward, []

    def forward(prepared):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(f"injected fault on the {_ORDINALS.get(n, f'{n}th')} forward call")
        return real(prepared)

    monkeypatch.setattr(engine.runner, "forward", forward)


def used_blocks(tables: dict, num_blocks: int):
    """(state, ref_count) arrays of a pool whose only used blocks are those ``tables`` name, each block's ref count
    the number of table entries naming it (the pool's own invariant)."""
    import numpy as np

    from kvstream.views import BlockState
    state = np.zeros(num_blocks, np.int8)
    ref = np.zeros(num_blocks, np.int32)
    for table in tables.values():
        for b in table:
            state[b] = BlockState.USED
            ref[b] += 1
    return state, ref


def write_tiny_gguf(path: Path, *, block_count: int | None = None, layers: int = 2, seed: int = 0) -> Path:
    """A small Llama-architecture GGUF file (float32 tensors, no tokenizer), written with the gguf package as
    llama.cpp lays one out; ``block_count`` is what its header claims (by default the layers it holds)."""
    import numpy as np
    from gguf import GGUFWriter

    vocab, hidden, inter, heads, kv_heads = 64, 48, 64, 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)

    def weights(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers if block_count is None else block_count)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tensor("token_embd.weight", weights(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weights(vocab, hidden))
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (heads * head_dim, hidden)),
                            ("attn_k", (kv_heads * head_dim, hidden)), ("attn_v", (kv_heads * head_dim, hidden)),
                            ("attn_output", (hidden, heads * head_dim)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            writer.add_tensor(f"blk.{i}.{name}.weight",
                              np.ones(shape, np.float32) if name.endswith("norm") else weights(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
