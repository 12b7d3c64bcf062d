"""Loading a model: the built-in one from ``resources/builtin`` or a local Hugging Face-style checkpoint directory.

Weights are read with ``safetensors`` only; pickle-based ``*.bin`` checkpoints are refused, never unpickled.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import EngineError
from .causal_lm import CausalLM, ModelConfig
from .tokenizer import BOS_ID, EOS_ID, ByteTokenizer, HFTokenizer, NoTokenizer

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "resources" / "builtin"

# Used only if resources/builtin has no trained weights: a seeded random model of the same family.
BUILTIN_FALLBACK = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
}


NO_MODEL = "none"  # --model none: no weights and no forward pass (trace replays at full size)
# What the pool needs of a model that is not there: one K/V plane of one head of one element per slot, so every path
# that moves, saves, offloads or loads blocks runs as for a real model (at 8 bytes a slot); a vocabulary as wide as a
# trace's synthesised tokens need, and positions for the longest prompts traces hold.
NO_MODEL_CONFIG = dict(vocab_size=(1 << 31) - 1, hidden_size=1, intermediate_size=1, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=1, max_position_embeddings=1 << 24)


@dataclass
class LoadedModel:
    model: CausalLM | None  # None for --model none
    config: ModelConfig
    tokenizer: Any  # ByteTokenizer | HFTokenizer | NoTokenizer
    name: str
    eos_token_ids: tuple[int, ...]


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path} does not hold a JSON object")
    return data


def _eos_ids(config: ModelConfig, directory: Path) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen).get("eos_token_id")
        for e in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if isinstance(e, bool) or not isinstance(e, int):
                raise EngineError(f"{gen}: eos_token_id must be an integer or a list of integers, got {e!r}")
            if not 0 <= e < config.vocab_size:
                raise EngineError(f"{gen}: eos_token_id {e} is outside the vocabulary (0..{config.vocab_size - 1})")
            if e not in ids:
                ids.append(e)
    return tuple(ids)


def _directory(spec: str) -> tuple[bool, Path]:
    """(built-in?, directory) for a model spec, refusing what is not a checkpoint directory."""
    if not isinstance(spec, str):
        raise EngineError("model must be 'builtin' or the path of a checkpoint directory")
    converted = _gguf_directory(spec)
    if converted is not None:  # a GGUF model: loaded from its converted checkpoint in the cache
        return False, converted
    builtin = spec == "builtin"
    directory = BUILTIN_DIR if builtin else Path(spec).expanduser()
    if not builtin:
        if directory.is_file():
            raise EngineError(f"{spec!r} is a file; --model takes a checkpoint directory (the folder holding "
                              f"config.json and *.safetensors)")
        if not directory.is_dir():
            raise EngineError(f"checkpoint directory {spec!r} does not exist")
        if not (directory / "config.json").is_file():
            raise EngineError(f"{directory} has no config.json: not a Hugging Face-style checkpoint")
    return builtin, directory


def _gguf_directory(spec: str) -> Path | None:
    """The converted checkpoint directory of a GGUF model spec ("smollm2", or a local ``.gguf`` file, converted into
    the cache the first time); None for every other spec. See engine/model/gguf_model.py."""
    if isinstance(spec, str) and (spec.lower().endswith(".gguf") or spec in _known_gguf_models()):
        from .gguf_model import resolve_model_spec
        return resolve_model_spec(spec)
    return None


def _known_gguf_models() -> tuple[str, ...]:
    from .gguf_model import KNOWN_MODELS
    return tuple(KNOWN_MODELS)


def _model_name(spec: str, directory: Path) -> str:
    """What the window calls a loaded model: a known model's name, a GGUF file's path, or the directory."""
    return spec if spec in _known_gguf_models() or spec.lower().endswith(".gguf") else str(directory)


def read_model_config(spec: str) -> ModelConfig:
    """The model's shape from its config.json (cheap: no weights are read), validated."""
    if spec == NO_MODEL:  # not a network's shape, so not checked as one (a head of one element has no rotary pairs)
        return ModelConfig(**NO_MODEL_CONFIG)
    builtin, directory = _directory(spec)
    has_config = (directory / "config.json").is_file()
    return ModelConfig.from_hf_dict(_read_json(directory / "config.json") if has_config else dict(BUILTIN_FALLBACK))


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (None when the system does not say)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits_memory(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    """Refuse a pool whose K/V tensor cannot fit in the memory left, saying what it would take."""
    from ..kv.cache import KVCache

    planes = max(len(layers) for _kind, _window, layers in config.kv_cache_groups())  # layers per group, at most
    need = KVCache.bytes_for(planes, num_blocks, block_size, config.num_key_value_heads,
                             config.head_dim, dtype)
    have = available_memory(device)
    if have is not None and need > 0.9 * have:
        per_block = need // num_blocks
        raise EngineError(
            f"a pool of {num_blocks:,} blocks x {block_size} slots needs {need / 2**30:.1f} GiB for its K/V "
            f"({per_block / 2**10:.0f} KiB per block: {planes} layers x K and V x {block_size} "
            f"slots x {config.num_key_value_heads} heads x {config.head_dim} dims), but only {have / 2**30:.1f} GiB "
            f"of {device.type} memory is available; use at most {int(0.9 * have // per_block):,} blocks or smaller "
            f"blocks")


def _load_weights(model: CausalLM, files: list[Path], progress: Callable[[str, float], None]) -> None:
    from safetensors import safe_open

    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    for i, path in enumerate(files):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for j, name in enumerate(names):
                    if name not in wanted:
                        if name == "lm_head.weight" and model.config.tie_word_embeddings:
                            continue
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise EngineError(f"unexpected tensor {name!r} in {path.name}: not a supported "
                                          f"{model.config.architecture} checkpoint")
                    tensor = f.get_tensor(name)
                    param = wanted[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise EngineError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                                          f"{tuple(param.shape)}")
                    with torch.no_grad():
                        param.copy_(tensor.to(param.dtype))
                    seen.add(name)
                    progress(f"loading {path.name}", (i + (j + 1) / max(len(names), 1)) / len(files))
        except EngineError:
            raise
        except Exception as exc:  # truncated or corrupt file
            raise EngineError(f"cannot read weights from {path}: {exc}") from None
    missing = sorted(set(wanted) - seen - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    if missing:
        raise EngineError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}")


def load_model(spec: str, dtype: torch.dtype, device: torch.device, seed: int,
               progress: Callable[[str, float], None] | None = None) -> LoadedModel:
    """Build the model named by ``spec`` ("builtin" or a directory) on ``device`` in ``dtype``."""
    progress = progress or (lambda message, fraction: None)
    if spec == NO_MODEL:
        config = read_model_config(spec)
        return LoadedModel(None, config, NoTokenizer(config.vocab_size), NO_MODEL, ())
    builtin, directory = _directory(spec)
    config = read_model_config(spec)
    eos_ids = _eos_ids(config, directory)
    progress("building model", 0.0)
    with torch.device("cpu"):
        model = CausalLM(config)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if files:
        _load_weights(model, files, progress)
    elif builtin:
        model.init_weights(seed)
    else:
        pickled = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded, convert them to safetensors)" if pickled else ""
        raise EngineError(f"{directory} has no *.safetensors weights{hint}")
    model = model.to(device=device, dtype=dtype).eval()
    model.prepare_inference()
    if builtin:
        tokenizer: Any = ByteTokenizer()
    elif (directory / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(directory / "tokenizer.json")
        if tokenizer.vocab_size > config.vocab_size:
            raise EngineError(f"the tokenizer in {directory} has {tokenizer.vocab_size} tokens but the model's "
                              f"vocabulary has {config.vocab_size}: they do not belong together")
    else:
        tokenizer = NoTokenizer(config.vocab_size)
    progress("ready", 1.0)
    return LoadedModel(model, config, tokenizer, "builtin" if builtin else _model_name(spec, directory), eos_ids)
