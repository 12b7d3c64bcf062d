"""DESIGN.md's layering, checked: kvstream imports neither torch nor Qt, the engine no Qt, and the explorer only the
engine's public names (no engine.block_pool, engine.scheduler, ...)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "PySide6", "PyQt5", "PyQt6", "pyqtgraph", "shiboken6")


@pytest.mark.parametrize("package, banned", [("kvstream", HEAVY), ("engine", HEAVY[1:])])
def test_package_imports_nothing_heavy(package, banned):
    modules = sorted(p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib; [importlib.import_module('{package}.' + m) for m in {modules!r}];"
            f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({list(banned)!r})); print(bad);"
            "sys.exit(1 if bad else 0)")
    if package == "kvstream":  # the vLLM tap is imported only inside vLLM; it needs nothing heavy either
        code = code.replace("import sys, importlib;", "import sys, importlib; sys.modules['vllm'] = None;", 1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


PUBLIC = {"Engine", "EngineConfig", "EngineError", "EngineRunner", "EngineFailure", "RunnerStopped",
          "RelocationReport", "ToyPagedSequence", "BlockState", "Status", "FinishReason", "paged_attention"}


def test_explorer_uses_only_the_engines_public_names():
    bad = []
    for path in sorted((ROOT / "explorer").glob("*.py")) + [ROOT / "main.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
                if node.module != "engine" or any(a.name not in PUBLIC for a in node.names):
                    bad.append(f"{path.name}:{node.lineno} from {node.module} import "
                               f"{', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("engine.") for a in node.names):
                bad.append(f"{path.name}:{node.lineno} import {', '.join(a.name for a in node.names)}")
    assert not bad, "explorer reaches into engine internals:\n" + "\n".join(bad)
