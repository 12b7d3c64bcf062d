import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# As in main.py: engine and GUI threads share two cores; spinning OpenMP workers would starve them (set before torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engine's cache (built kernels, fetched models) of this test session only, unless the caller chose one: a model
# the developer fetched (--fetch-model smollm2) must not change what the demos and the windows under test run.
if not os.environ.get("PAGED_KV_EXPLORER_CACHE"):
    _cache = tempfile.mkdtemp(prefix="paged-kv-tests-")
    os.environ["PAGED_KV_EXPLORER_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
