#!/usr/bin/env bash
# Install SGLang's KV-event publisher module without its GPU stack, for tests/test_kv_events.py's SGLang cases.
#
# sglang/srt/disaggregation/kv_events.py itself needs msgspec, pyzmq (project dependencies), pydantic and
# psutil; the test loads it without running sglang's package __init__ files, which pull in triton, torch and
# FastAPI. So: those two pure-Python packages, then sglang with no dependencies. Pinned: the test is written
# against this version's publisher (map-encoded events, [ts, events, attn_dp_rank] batches).
# Usage: bash tools/install_sglang_publisher.sh   (inside the venv that runs the tests)
set -euo pipefail
python -m pip install --quiet "pydantic>=2" "psutil>=5"
python -m pip install --quiet --no-deps "sglang==0.5.23"
python - <<'PY'
import importlib.util, os, sys, types
root = os.path.dirname(importlib.util.find_spec("sglang").origin)
for name, sub in (("sglang", ""), ("sglang.srt.utils", "srt/utils")):
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(root, sub)]
    sys.modules[name] = pkg
import sglang.srt.disaggregation.kv_events as k
print("SGLang publisher importable:", k.ZmqEventPublisher.__module__)
PY
