"""A small Llama checkpoint with a tokenizer, made on the spot: random weights written by transformers'
``save_pretrained``, a byte-level tokenizer built with the ``tokenizers`` library. Nothing is downloaded. Used by the
vLLM integration tests and by bench/vllm_plugin.py."""
from __future__ import annotations

from pathlib import Path


def make_checkpoint(out: Path) -> Path:
    """A 2-layer Llama (hidden 128, 2 query heads sharing 1 KV head of 64) with random weights and a byte-level
    tokenizer (256 byte symbols, <s>, </s>), saved the way Hugging Face checkpoints are."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    bos, eos = len(vocab), len(vocab) + 1
    vocab.update({"<s>": bos, "</s>": eos})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def make_hybrid_checkpoint(out: Path, kind: str, window: int = 64) -> Path:
    """The same small model with sliding-window layers, as vLLM pages them in KV cache groups: ``kind`` "llama" is
    a Llama whose config.json has ``layer_types`` alternating "sliding_attention" / "full_attention" (two groups),
    "mistral" a Mistral with ``sliding_window`` on every layer (one sliding-window group)."""
    import json

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    make_checkpoint(out)  # the tokenizer (and a Llama, replaced below)
    config = json.loads((out / "config.json").read_text())
    if kind == "llama":
        config["num_hidden_layers"] = 4
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
        config["sliding_window"] = window
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items()
                                                 if k not in ("layer_types", "sliding_window", "architectures")}))
        model.save_pretrained(out)
        saved = json.loads((out / "config.json").read_text())
        saved.update(layer_types=config["layer_types"], sliding_window=window)
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    elif kind == "mistral":
        torch.manual_seed(0)
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings")
        MistralForCausalLM(MistralConfig(sliding_window=window, **{k: config[k] for k in keep})).save_pretrained(out)
    else:
        raise ValueError(kind)
    return out
