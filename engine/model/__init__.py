"""The model: config loading, checkpoints (safetensors, GGUF), tokenizer, chat templates, the network, sampling, and
the runner that feeds it one scheduled batch."""
