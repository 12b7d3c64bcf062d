"""Loading a model: the built-in one from ``resources/builtin`` or a local Hugging Face-style checkpoint directory.

Weights are read with ``safetensors`` only; pickle-based ``*.bin`` checkpoints are refused, never unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import EngineError
from .model import CausalLM, ModelConfig
from .tokenizer import BOS_ID, EOS_ID, ByteTokenizer, HFTokenizer, NoTokenizer

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "resources" / "builtin"

# Used only if resources/builtin has no trained weights: a seeded random model of the same family.
BUILTIN_FALLBACK = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
}


@dataclass
class LoadedModel:
    model: CausalLM
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
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


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
    builtin = spec == "builtin"
    directory = BUILTIN_DIR if builtin else Path(spec).expanduser()
    if not builtin and not directory.is_dir():
        raise EngineError(f"checkpoint directory {spec!r} does not exist")
    has_config = (directory / "config.json").is_file()
    if not has_config and not builtin:
        raise EngineError(f"{directory} has no config.json: not a Hugging Face-style checkpoint")
    hf = _read_json(directory / "config.json") if has_config else dict(BUILTIN_FALLBACK)
    config = ModelConfig.from_hf_dict(hf)
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
    else:
        tokenizer = NoTokenizer(config.vocab_size)
    progress("ready", 1.0)
    return LoadedModel(model, config, tokenizer, "builtin" if builtin else str(directory), _eos_ids(config, directory))
