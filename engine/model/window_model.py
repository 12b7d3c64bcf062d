"""A small mixed-attention checkpoint the project makes itself, for the window demo (``--demo window``).

It is the built-in model's weights and shape under a config whose ``layer_types`` alternate sliding-window and
full-attention layers (Llama-shaped, as vLLM's Llama reads ``layer_types``), with a byte-level ``tokenizer.json`` that
gives exactly the built-in tokenizer's ids (byte b -> id b, BOS 256, EOS 257), so text prompts work. The built-in
model was trained with full attention everywhere, so its text degrades once a conversation is longer than the window:
the point of the demo is the pool (long conversations keep a bounded number of sliding-group blocks), not the prose.
Where the built-in weights are missing, a seeded random model of the same shape is written instead.

Written once into the user's cache folder (the same one as the native kernels), named by its window, and reused.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


from ..errors import EngineError
from .loader import BUILTIN_DIR, BUILTIN_FALLBACK
from ..native import cache_dir
from .tokenizer import BOS_ID, EOS_ID

DEMO_WINDOW = 64  # tokens a sliding layer reads back (4 blocks of the default 16 slots)


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer and decoder use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer_json() -> str:
    """A tokenizer.json whose ids are the built-in ByteTokenizer's: one token per byte, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in _byte_unicode().items()}
    vocab["<s>"], vocab["</s>"] = BOS_ID, EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tok.to_str()


def write_window_checkpoint(path: Path, window: int = DEMO_WINDOW, seed: int = 0) -> Path:
    """Write the mixed checkpoint into ``path`` (made if needed): config.json (layer_types alternating
    "sliding_attention" / "full_attention", ``sliding_window`` = ``window``), model.safetensors, tokenizer.json,
    generation_config.json. Returns ``path``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise EngineError(f"the window must be a positive number of tokens, got {window!r}")
    from safetensors.torch import load_file, save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    builtin_config = BUILTIN_DIR / "config.json"
    weights = BUILTIN_DIR / "model.safetensors"
    config = json.loads(builtin_config.read_text()) if builtin_config.is_file() else dict(BUILTIN_FALLBACK)
    config.pop("torch_dtype", None)
    layers = int(config["num_hidden_layers"])
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    config["sliding_window"] = window
    if weights.is_file():
        tensors = {k: v.float().contiguous() for k, v in load_file(str(weights)).items()}
    else:
        from .causal_lm import CausalLM, ModelConfig
        model = CausalLM(ModelConfig.from_hf_dict(config))
        model.init_weights(seed)
        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                   if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
    (path / "tokenizer.json").write_text(byte_tokenizer_json())
    return path


def window_checkpoint(window: int = DEMO_WINDOW) -> Path:
    """The demo's checkpoint directory in the user's cache, written on first use (atomically: into a temporary
    folder renamed into place, so two processes never see half of one)."""
    target = cache_dir() / "models" / f"window-demo-{window}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix="window-demo-", dir=target.parent))
    write_window_checkpoint(temp, window)
    try:
        os.replace(temp, target)
    except OSError:  # another process got there first
        for f in temp.iterdir():
            f.unlink()
        temp.rmdir()
    return target


__all__ = ["DEMO_WINDOW", "write_window_checkpoint", "window_checkpoint", "byte_tokenizer_json"]

