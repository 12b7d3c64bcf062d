"""Loading a model: the built-in one from ``resources/builtin`` or a local Hugging Face-style checkpoint directory.

Weights are read with ``safetensors`` only; pickle-based ``*.bin`` checkpoints are refused, never unpickled.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import EngineError
from ..kv.fp8 import read_scales, scale_name
from ..validation import file_kind
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
    files: tuple[Path, ...] = ()  # the files it was loaded from (what a disk tier's path must never be)


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path} does not hold a JSON object")
    return data


def _regular(path: Path) -> Path:
    kind = file_kind(path)
    if kind is not None:
        raise EngineError(f"{path} is {kind}, not a regular file: a checkpoint's files must be regular files")
    return path


def _positive_number(d: dict, key: str, where: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _token_id_list(value, key: str, where: str) -> None:
    for e in value if isinstance(value, list) else ([] if value is None else [value]):
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise EngineError(f"{where}: {key} must be a token id (an integer from 0) or a list of them, got {e!r}")


def check_config_domains(d: dict, where: str = "config.json") -> None:
    """Refuse config values outside their domain, which the model's shape checks do not see: a rotary base or a
    norm epsilon that is not a positive number (-1 decodes, into nonsense), token ids that are not integers (JSON's
    true would be read as 1), flags that are not booleans."""
    _positive_number(d, "rms_norm_eps", where, 1e-6)
    parameters = d.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise EngineError(f"{where}: rope_parameters must be an object, got {parameters!r}")
    if "rope_theta" in d or not (parameters or {}).get("rope_theta"):
        _positive_number(d, "rope_theta", where, 10000.0)
    else:
        _positive_number(parameters, "rope_theta", f"{where} rope_parameters", 10000.0)
    _token_id_list(d.get("eos_token_id"), "eos_token_id", where)
    bos = d.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or bos < 0):
        raise EngineError(f"{where}: bos_token_id must be a token id (an integer from 0) or null, got {bos!r}")
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if key in d and not isinstance(d[key], bool):
            raise EngineError(f"{where}: {key} must be true or false, got {d[key]!r}")


def parameter_count(config: ModelConfig) -> int:
    """Weights the model described by ``config`` holds (what CausalLM allocates), computed without allocating."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h
    if config.attention_bias:
        layer += q + 2 * kv + h
    elif config.qkv_bias:
        layer += q + 2 * kv
    if config.qk_norm:
        layer += 2 * config.head_dim
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + head + h + config.num_hidden_layers * layer


def weights_in_files(files: list[Path]) -> int:
    """Weights the safetensors ``files`` hold, read from their headers (no tensor data is read)."""
    from safetensors import safe_open

    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    total += math.prod(f.get_slice(name).get_shape())
        except Exception as exc:  # truncated or corrupt file
            raise EngineError(f"cannot read weights from {path}: {exc}") from None
    return total


def check_model_fits(config: ModelConfig, files: list[Path], device: torch.device) -> None:
    """Refuse, before anything is allocated, a config whose weights are not what its files hold (read from their
    headers) or cannot fit in memory (the model is built in float32 first, and its rotary tables hold two float32
    rows per position)."""
    count = parameter_count(config)
    if files:
        held = weights_in_files(files)
        if count > held:
            raise EngineError(f"config.json describes {count:,} weights, but the checkpoint's weights files hold "
                              f"{held:,}: config.json does not belong to these weights (check vocab_size, "
                              "hidden_size, intermediate_size, num_hidden_layers)")
    rotary = 2 * max(config.max_position_embeddings, 64) * config.head_dim * 4
    need = count * 4 + rotary
    have = available_memory(torch.device("cpu"))
    if have is not None and need > 0.9 * have:
        raise EngineError(f"this model needs {need / 2**30:,.1f} GiB to build ({count:,} weights in float32 and "
                          f"rotary tables for {config.max_position_embeddings:,} positions) but only "
                          f"{have / 2**30:,.1f} GiB of memory is available")
    if device.type == "cuda":
        free = available_memory(device)
        if free is not None and count * 2 > free:
            raise EngineError(f"this model's {count:,} weights do not fit in the {free / 2**30:,.1f} GiB of GPU "
                              "memory available")


def check_finite(model: CausalLM, what: str) -> None:
    """Refuse weights that hold NaN or infinities (they decode into one token forever, or crash sampling)."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise EngineError(f"the weight {name!r} holds NaN or infinite values {what}: the model cannot be run")


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
        kind = file_kind(directory)
        if kind is not None and kind != "a folder":
            raise EngineError(f"{spec!r} is {kind}; --model takes a checkpoint directory (the folder holding "
                              f"config.json and *.safetensors)")
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
    d = _read_json(directory / "config.json") if has_config else dict(BUILTIN_FALLBACK)
    check_config_domains(d, str(directory / "config.json") if has_config else "config.json")
    return ModelConfig.from_hf_dict(d)


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


READ_SPAN = 64 << 20  # bytes of tensors read through one mapping of a weights file before it is let go


def _load_weights(model: CausalLM, files: list[Path], progress: Callable[[str, float], None]) -> None:
    """Read every tensor of ``files`` into the model's parameters, converted to their dtype one tensor at a time.
    safetensors maps the file and each page read stays resident until the mapping closes, so the file is opened
    again after every READ_SPAN bytes: loading holds the model and at most that much of the file, never both
    whole."""
    from safetensors import safe_open

    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    scales: dict[tuple[int, str], torch.Tensor] = {}  # fp8 KV scales (engine/kv/fp8.py), as vLLM reads them
    for i, path in enumerate(files):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
            f, read = None, 0
            for j, name in enumerate(names):
                if f is None or read > READ_SPAN:
                    f = None  # the mapping goes with its last reference
                    f, read = safe_open(str(path), framework="pt"), 0
                if name not in wanted:
                    if (target := scale_name(name)) is not None:
                        scales[target] = f.get_tensor(name).clone()  # (a view would keep the mapping)
                        continue
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
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise EngineError(f"tensor {name!r} in {path.name} holds NaN or infinite values: the model "
                                      "cannot be run")
                if tensor.dtype not in (param.dtype, torch.float32):  # through float32, as a float32 model was
                    tensor = tensor.float()
                with torch.no_grad():
                    param.copy_(tensor)
                read += tensor.numel() * tensor.element_size()
                del tensor
                seen.add(name)
                progress(f"loading {path.name}", (i + (j + 1) / max(len(names), 1)) / len(files))
            f = None
        except EngineError:
            raise
        except Exception as exc:  # truncated or corrupt file
            raise EngineError(f"cannot read weights from {path}: {exc}") from None
    missing = sorted(set(wanted) - seen - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    if missing:
        raise EngineError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}")
    model.set_kv_scales(read_scales(scales, model.config.num_hidden_layers, files[0].parent.name))


def _empty_model(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The model with its parameters allocated in ``dtype`` and not written (no page of them is resident until the
    weights are copied in): built on the meta device, each parameter then made once (a tied one stays tied)."""
    with torch.device("meta"):
        model = CausalLM(config)
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
                module._parameters[name] = made[id(param)]
    return model


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc keeps what a load freed for later allocations, where
    the loader's temporaries, tensors of a few hundred KiB each, were)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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
    files = [_regular(p) for p in sorted(directory.glob("*.safetensors"))] if directory.is_dir() else []
    check_model_fits(config, files, device)
    progress("building model", 0.0)
    model = _empty_model(config, dtype)
    if files:
        _load_weights(model, files, progress)
    elif builtin:
        model.init_weights(seed)
    else:
        pickled = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded, convert them to safetensors)" if pickled else ""
        raise EngineError(f"{directory} has no *.safetensors weights{hint}")
    model = model.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:  # (float32: each tensor was checked as it was read)
        check_finite(model, f"in {dtype}".replace("torch.", ""))  # a float32 weight may overflow in float16
    model.prepare_inference()
    release_freed_memory()
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
    own = tuple(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else ()
    if isinstance(spec, str) and spec.lower().endswith(".gguf"):
        own += (Path(spec).expanduser(),)
    return LoadedModel(model, config, tokenizer, "builtin" if builtin else _model_name(spec, directory), eos_ids,
                       own)
