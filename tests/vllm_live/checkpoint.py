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
