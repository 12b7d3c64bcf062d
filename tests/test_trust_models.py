"""Issue 48, models from outside: no config, GGUF header or weights file can crash the engine, hang it, or make it
decode nonsense under a model's name.

Each test writes the fault into a real checkpoint (absurd sizes, NaN weights, a FIFO, values outside their domain,
a converted model's weights swapped) and checks for one clear EngineError before anything large is allocated, or,
for a fault that shows only while decoding, that the one conversation stops with a reason and the rest go on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from engine import Engine, EngineConfig, EngineError
from engine.model import gguf_model, loader
from engine.model.gguf_model import KNOWN_MODELS, convert_gguf
from kvstream.views import FinishReason, Status
from tests.helpers import write_tiny_checkpoint, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_build(monkeypatch):
    """Building the model is where the allocator would run out: a refusal must come before it."""
    def refuse(config):
        raise AssertionError(f"the model was built ({config}) before its sizes were checked")
    monkeypatch.setattr(loader, "CausalLM", refuse)


def _checkpoint(tmp_path: Path, **fields) -> Path:
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(fields)
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


# ---- absurd sizes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("vocab_size", 2**31, "does not belong to these weights"),
    ("hidden_size", 2**20, "does not belong to these weights"),
    ("intermediate_size", 2**33, "does not belong to these weights"),
    ("max_position_embeddings", 2**40, "rotary tables for 1,099,511,627,776 positions"),
])
def test_a_config_asking_for_absurd_sizes_is_refused_before_allocating(tmp_path, no_build, field, value, words):
    ckpt = _checkpoint(tmp_path, **{field: value})
    with pytest.raises(EngineError, match=words):
        Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16))


def test_a_model_larger_than_memory_is_refused_before_allocating(tmp_path, no_build, monkeypatch):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(loader, "available_memory", lambda device: 1 << 16)  # 64 KiB left
    with pytest.raises(EngineError, match="GiB of memory is available"):
        loader.load_model(str(ckpt), torch.float32, torch.device("cpu"), 0)


def test_a_gguf_header_claiming_a_million_blocks_is_refused(tmp_path, monkeypatch, no_build):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", block_count=10**6)
    with pytest.raises(EngineError, match="block_count is 1,000,000 but it holds tensors for 2 layers"):
        Engine(EngineConfig(model=str(gguf), block_size=4, num_blocks=16))


# ---- weights that are not numbers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_at_load(tmp_path, bad):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(EngineError, match="'model.layers.1.mlp.down_proj.weight' in model.safetensors holds NaN or "
                                          "infinite values"):
        Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16))


def test_weights_that_overflow_float16_are_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"][0, 0] = 1e6  # finite in float32, infinite in float16
    save_file(tensors, str(ckpt / "model.safetensors"))
    Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16))  # float32 runs it
    with pytest.raises(EngineError, match="'lm_head.weight' holds NaN or infinite values in float16"):
        Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16, dtype="float16"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("values", [(float("nan"), float("inf")), (-float("inf"),)])
def test_non_finite_logits_stop_that_conversation_and_the_others_go_on(tmp_path, monkeypatch, temperature, values):
    """Weights that pass the load check may still overflow while decoding: the conversation whose logits are not
    finite stops with that reason (greedy took token 0 from NaN; sampling raised), the engine runs on."""
    ckpt = str(write_tiny_checkpoint(tmp_path / "ckpt"))

    def run(fault: bool):
        eng = Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=32, seed=0))
        victim = eng.add_conversation(prompt_token_ids=[5, 6, 7, 8, 9], max_new_tokens=8, temperature=temperature)
        other = eng.add_conversation(prompt_token_ids=[11, 12, 13], max_new_tokens=8, temperature=temperature)
        eng.step()
        eng.step()
        if fault:
            real = eng.runner.forward

            def forward(prepared):
                logits = real(prepared).clone()
                for row, seq in enumerate(prepared.sampled):
                    if seq.seq_id == victim:  # an infinity alone too: greedy's argmax would not notice -inf
                        for column, value in enumerate(values, start=3):
                            logits[row, column] = value
                return logits
            monkeypatch.setattr(eng.runner, "forward", forward)
        eng.run_until_idle()
        return eng, victim, other

    eng, victim, other = run(True)
    info = eng.conversation(victim)
    assert info.status == Status.FINISHED and info.finish_reason == FinishReason.NON_FINITE
    assert len(info.output_token_ids) == 2  # the tokens of the two good steps, none from the bad one
    errors = eng.take_background_errors()
    assert len(errors) == 1 and f"conversation {victim} stopped" in errors[0] and "NaN or infinite" in errors[0]
    ref, _, ref_other = run(False)
    assert eng.conversation(other).output_token_ids == ref.conversation(ref_other).output_token_ids
    assert eng.conversation(victim).output_token_ids == ref.conversation(victim).output_token_ids[:2]
    eng.check_invariants()
    later = eng.add_conversation(prompt_token_ids=[1, 2, 3], max_new_tokens=3)  # and the engine takes more
    eng.run_until_idle()
    assert len(eng.conversation(later).output_token_ids) == 3


def test_a_dry_run_that_meets_non_finite_logits_reports_nothing(tmp_path, monkeypatch):
    """What a rolled-back step saw is not said: only committed stops reach the runner."""
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "ckpt")), block_size=4, num_blocks=32))
    cid = eng.add_conversation(prompt_token_ids=[5, 6, 7], max_new_tokens=8)
    eng.step()
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda prepared: torch.full_like(real(prepared), float("nan")))
    eng._dry_run(2)
    assert eng.take_background_errors() == []
    assert eng.conversation(cid).status == Status.RUNNING


# ---- files that are not files -------------------------------------------------------------------------------------
def test_a_fifo_as_weights_is_refused_at_once(tmp_path):
    """In a process of its own: a reader blocked opening a FIFO holds the interpreter (safetensors keeps the GIL),
    so only a separate process can be timed out."""
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    code = ("import sys\nfrom engine import Engine, EngineConfig, EngineError\ntry:\n"
            f"    Engine(EngineConfig(model={str(ckpt)!r}, block_size=4, num_blocks=16))\n"
            "except EngineError as exc:\n    print(exc)\n    sys.exit(3)\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a FIFO as weights hung")
    assert done.returncode == 3, done.stderr
    assert "is a FIFO (named pipe), not a regular file" in done.stdout


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_gguf_path_that_is_not_a_file_says_what_it_is(tmp_path, kind):
    path = tmp_path / "x.gguf"
    if kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    words = "is a folder" if kind == "folder" else "is a FIFO"
    with pytest.raises(EngineError, match=f"{words}.*not a GGUF file"):
        Engine(EngineConfig(model=str(path), block_size=4, num_blocks=16))


# ---- values outside their domain ----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("rope_theta", -1, "rope_theta must be a positive number, got -1"),
    ("rope_theta", 0, "rope_theta must be a positive number, got 0"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a positive number, got -1"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be a positive number"),
    ("eos_token_id", [True], "eos_token_id must be a token id"),
    ("eos_token_id", "2", "eos_token_id must be a token id"),
    ("bos_token_id", True, "bos_token_id must be a token id"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
])
def test_values_outside_their_domain_are_refused(tmp_path, field, value, words):
    ckpt = _checkpoint(tmp_path, **{field: value})
    with pytest.raises(EngineError, match=words):
        Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16))


# ---- a converted model is what was converted ----------------------------------------------------------------------
@pytest.fixture
def converted(tmp_path, monkeypatch):
    """A converted 'smollm2' in a fresh cache: the tiny GGUF file converted under SmolLM2's pinned hash (as the
    fetch converts the real one), so that --model smollm2 loads it."""
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "cache"))
    directory = gguf_model.models_dir() / "smollm2"
    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), directory, KNOWN_MODELS["smollm2"].sha256,
                 lambda message: None)
    return directory


def _smollm2():
    return Engine(EngineConfig(model="smollm2", block_size=4, num_blocks=16))


def test_replaced_weights_do_not_run_under_the_models_name(converted):
    assert _smollm2().generate([[1, 2, 3]], max_new_tokens=2)
    weights = converted / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = -tensors["lm_head.weight"]  # other weights, the same size
    size = weights.stat().st_size
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == size
    with pytest.raises(EngineError, match="model.safetensors is not the file its conversion wrote \\(its SHA-256 "
                                          "differs\\); run `python main.py --fetch-model smollm2`"):
        _smollm2()


def test_a_weights_file_the_conversion_did_not_write_is_refused(converted):
    (converted / "extra.safetensors").write_bytes((converted / "model.safetensors").read_bytes())
    with pytest.raises(EngineError, match="holds extra.safetensors, which its conversion did not write"):
        _smollm2()


def test_a_truncated_weights_file_is_refused_by_its_size(converted):
    weights = converted / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(EngineError, match="its size differs"):
        _smollm2()


def test_files_are_hashed_once_per_change(converted, monkeypatch):
    hashed = []
    real = gguf_model.sha256_of
    monkeypatch.setattr(gguf_model, "sha256_of", lambda path: (hashed.append(Path(path).name), real(path))[1])
    _smollm2()
    assert hashed == []  # the conversion recorded what it wrote
    weights = converted / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: a change to look at
    _smollm2()
    assert hashed == ["model.safetensors"]
    _smollm2()
    assert hashed == ["model.safetensors"]


def test_an_older_conversion_is_asked_to_be_converted_again(converted):
    manifest = converted / gguf_model.MANIFEST
    old = json.loads(manifest.read_text())
    old["converter_version"] = 1
    del old["files"]
    manifest.write_text(json.dumps(old))
    with pytest.raises(EngineError, match="converted by an older version.*--fetch-model smollm2"):
        _smollm2()


def test_a_changed_local_gguf_conversion_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = Engine(EngineConfig(model=str(gguf), block_size=4, num_blocks=16)).generate([[1, 2, 3]], max_new_tokens=4)
    directory = gguf_model.models_dir() / f"gguf-{gguf_model.sha256_of(gguf)[:16]}"
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = np.zeros_like(tensors["lm_head.weight"])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    again = Engine(EngineConfig(model=str(gguf), block_size=4, num_blocks=16)).generate([[1, 2, 3]], max_new_tokens=4)
    assert again == first
