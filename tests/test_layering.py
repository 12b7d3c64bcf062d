"""DESIGN.md's layering, checked: kvstream imports neither torch nor Qt, the engine no Qt, the explorer's feeds and
model no Qt, and the explorer only the engine's public names (no engine.kv.pool, engine.scheduler, ...)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import package_imports

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "PySide6", "PyQt5", "PyQt6", "pyqtgraph", "shiboken6")


QT = HEAVY[1:]
QT_FREE = ("explorer/feeds", "explorer/model", "explorer/render")  # the explorer's floors below the widgets


@pytest.mark.parametrize("package, banned", [("kvstream", HEAVY), ("engine", QT)]
                         + [(folder.replace("/", "."), QT) for folder in QT_FREE])
def test_package_imports_nothing_heavy(package, banned):
    folder = ROOT.joinpath(*package.split("."))
    modules = sorted(".".join(p.relative_to(folder).with_suffix("").parts).removesuffix("__init__").rstrip(".")
                     for p in folder.rglob("*.py"))  # every module of every subpackage
    modules = [m for m in modules if m]
    code = (f"import sys, importlib; [importlib.import_module('{package}.' + m) for m in {modules!r}];"
            f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({list(banned)!r})); print(bad);"
            "sys.exit(1 if bad else 0)")
    if package == "kvstream":  # the vLLM tap is imported only inside vLLM; it needs nothing heavy either
        code = code.replace("import sys, importlib;", "import sys, importlib; sys.modules['vllm'] = None;", 1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


PUBLIC = {"Engine", "EngineConfig", "EngineError", "EngineRunner", "EngineFailure", "RunnerStopped",
          "RelocationReport", "ToyPagedSequence", "BlockState", "Status", "FinishReason", "paged_attention",
          "fetch_model", "fetched_model", "window_checkpoint",
          # real traffic (engine/traffic): traces, replays, sweeps, the eviction policies' names
          "EVICTION_POLICIES", "read_trace", "Trace", "TraceError", "Sweep", "SweepPoint", "SweepError",
          "parse_capacity", "kv_bytes_per_token", "blocks_for_bytes", "make_replay", "TraceReplay", "ReplayError"}


def qt_imports(source: str, filename: str) -> list[str]:
    """Every import of Qt in ``source``, at the top or inside a function (a lazy import loads Qt all the same)."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        bad += [f"{filename}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in QT]
    return bad


@pytest.mark.parametrize("folder", QT_FREE)
def test_explorer_lower_floors_never_import_qt(folder):
    """The feeds, the model and the renderer are tested and run (headless, benchmarks) without a display: no file
    of theirs imports Qt, not even inside a function, where importing the package above would not show it."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad += qt_imports(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, "Qt below the widgets:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", ["from PySide6 import QtCore", "import pyqtgraph as pg",
                                  "def f():\n    from PySide6.QtWidgets import QLabel", "import shiboken6"])
def test_qt_import_scan_catches(line):
    assert qt_imports(line, "snippet.py")


def test_explorer_uses_only_the_engines_public_names():
    bad = []
    for path in sorted((ROOT / "explorer").rglob("*.py")) + [ROOT / "main.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
                if node.module != "engine" or any(a.name not in PUBLIC for a in node.names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import "
                               f"{', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("engine.") for a in node.names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} import {', '.join(a.name for a in node.names)}")
    assert not bad, "explorer reaches into engine internals:\n" + "\n".join(bad)


# ---- one writer of the block pool ---------------------------------------------------------------------------------
POOL_WRITERS = {"engine/kv/pool.py", "engine/kv/manager.py"}  # the pool itself and its one manager (kv/groups.py's
#                                                              per-kind policies only answer the manager's questions)
INPLACE = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
           "discard", "move_to_end", "sort", "reverse", "fill", "put", "itemset", "resize", "__setitem__",
           "__delitem__"}  # methods that change a container (list, dict, set, OrderedDict, numpy array) in place
NUMPY_INPLACE = {"at", "copyto", "put", "place", "putmask", "put_along_axis", "fill_diagonal"}  # np.add.at(a, ...)


def _rooted_in(node, is_root):
    """Whether ``node`` is an attribute/subscript chain (x.a[b].c) whose base satisfies ``is_root``."""
    while True:
        if is_root(node):
            return True
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        else:
            return False


def _targets(node):
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        targets = [node.optional_vars]
    else:
        return []
    out = []
    for t in targets:  # a, b.c = ... unpacks
        out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
    return out


def block_pool_mutators():
    """BlockPool's methods that change it, read from its source: a method is a mutator if it assigns or deletes
    through ``self`` (``self.x = ``, ``self.x[i] += ``), changes one of its containers in place (``self._free.pop()``,
    ``np.add.at(self.x, ...)``, ``setattr(self, ...)``), or calls another mutator. New mutators are found without
    editing this test."""
    tree = ast.parse((ROOT / "engine" / "kv" / "pool.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockPool")
    is_self = lambda n: isinstance(n, ast.Name) and n.id == "self"  # noqa: E731
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    direct, calls = set(), {name: set() for name in methods}
    for name, fn in methods.items():
        for node in ast.walk(fn):
            if any(not is_self(t) and _rooted_in(t, is_self) for t in _targets(node)):
                direct.add(name)
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute) and is_self(f.value):
                    calls[name].add(f.attr)
                elif isinstance(f, ast.Attribute) and f.attr in INPLACE and _rooted_in(f.value, is_self):
                    direct.add(name)
                elif (isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args
                      and is_self(node.args[0])):
                    direct.add(name)
                elif (isinstance(f, ast.Attribute) and f.attr in NUMPY_INPLACE and node.args
                      and _rooted_in(node.args[0], is_self) and not is_self(node.args[0])):
                    direct.add(name)
    mutators = set(direct)
    while True:  # a method that calls a mutator mutates
        more = {name for name, called in calls.items() if called & mutators} - mutators
        if not more:
            return mutators - {"__init__"}
        mutators |= more


def pool_writes(source, filename, mutators):
    """Lines of ``source`` that change a block pool: an assignment, augmented assignment or ``del`` through a pool
    (``self.pool.clock = 3``, ``pool.ref_count[b] -= 1``, ``eng.pool.owner[:] = -1``), a call of one of its
    mutators (``self.pool.touch_used(7)``, ``self.engine.pool.take(0)``), an in-place change of one of its
    containers (``pool._free.pop(b)``, ``pool.state.fill(0)``, ``np.add.at(pool.ref_count, ...)``, ``out=pool.x``)
    or ``setattr(pool, ...)``. A pool is any expression ending in ``.pool`` or named ``pool``, and any local name
    bound to one (``p = self.pool``). Creating the pool (``self.pool = BlockPool(...)``) is not a write to it.

    A static scan cannot see everything (a pool passed to a helper under another name, ``getattr`` tricks), but
    every way the engine's own code has written the pool so far is covered, and the scan is checked below on
    snippets of each form."""
    tree = ast.parse(source, filename)
    aliases = {"pool"}

    def is_pool(node):
        return ((isinstance(node, ast.Name) and node.id in aliases)
                or (isinstance(node, ast.Attribute) and node.attr == "pool"))

    for node in ast.walk(tree):  # p = self.pool (and p = pool) make p a pool too
        if isinstance(node, ast.Assign) and is_pool(node.value):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def through_pool(node):  # an attribute or item of a pool, not the pool binding itself
        return not is_pool(node) and _rooted_in(node, is_pool)

    bad = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if any(through_pool(t) for t in _targets(node)):
            bad.append(f"{filename}:{line} assigns to the pool: {ast.unparse(node).splitlines()[0]}")
        if not isinstance(node, ast.Call):
            continue
        f, why = node.func, None
        if isinstance(f, ast.Attribute) and is_pool(f.value) and f.attr in mutators:
            why = f"calls BlockPool.{f.attr}"
        elif isinstance(f, ast.Attribute) and f.attr in INPLACE and through_pool(f.value):
            why = "changes a pool container in place"
        elif isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and is_pool(node.args[0]):
            why = f"{f.id} on the pool"
        elif isinstance(f, ast.Attribute) and f.attr in NUMPY_INPLACE and node.args and through_pool(node.args[0]):
            why = f"numpy {f.attr} into a pool array"
        elif any(k.arg == "out" and through_pool(k.value) for k in node.keywords):
            why = "writes a pool array through out="
        if why:
            bad.append(f"{filename}:{line} {why}: {ast.unparse(node)}")
    return bad


def test_pool_mutators_are_found():
    mutators = block_pool_mutators()
    assert {"take", "add_ref", "drop_ref", "set_owner", "set_filled", "register_hash", "clear_hashes",
            "touch_used", "permute", "restore"} <= mutators
    assert not mutators & {"lookup", "can_allocate", "next_free", "check_invariants", "num_free_blocks",
                           "free_queue"}


@pytest.mark.parametrize("line", [
    "self.pool.clock = self.step_id", "self.pool.touch_used(3)", "pool.ref_count[b] -= 1", "eng.pool.owner[:] = -1",
    "self.engine.pool.take(0)", "pool._free.pop(b)", "p = self.pool\np.clock = 1", "np.add.at(pool.ref_count, i, 1)",
    "setattr(self.pool, 'clock', 2)", "del pool.hashed[h]", "np.copyto(pool.state, x)", "np.add(a, b, out=pool.x)",
    "self.pool.state.fill(0)", "self.pool.clock, n = 1, 2"])
def test_pool_write_scan_catches(line):
    assert pool_writes(line, "snippet.py", block_pool_mutators())


@pytest.mark.parametrize("line", [
    "self.pool = BlockPool(4, 4)", "used = self.pool.state == 1", "n = pool.num_free_blocks",
    "b = self.pool.lookup(h)", "x = np.add(pool.ref_count, 1)", "self.manager.touch_used(3)"])
def test_pool_write_scan_allows(line):
    assert not pool_writes(line, "snippet.py", block_pool_mutators())


def test_only_the_manager_writes_the_pool():
    """DESIGN.md: the engine's pool state has one writer. Every engine module other than kv/pool.py (the pool)
    and kv/manager.py (its manager) may read the pool but must change it through KVCacheManager, so every
    change is an event and is rolled back with the manager's checkpoint."""
    mutators = block_pool_mutators()
    bad = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() not in POOL_WRITERS:
            bad += pool_writes(path.read_text(), str(path.relative_to(ROOT)), mutators)
    assert not bad, "engine code outside the KV-cache manager changes the block pool:\n" + "\n".join(bad)


def explorer_imports(top: str = "explorer") -> dict[str, set[str]]:
    """Module -> the ``top`` package's modules it imports (relative or absolute, at the top or inside a function)."""
    return package_imports(top)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in ``graph`` (module -> the modules it imports), each as the path that closes it."""
    found, done = [], set()

    def visit(module, stack):
        if module in stack:
            found.append(stack[stack.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


ROOMS = {"feeds": 0, "model": 1, "render": 2, "widgets": 3, "window": 4, "cli": 2, "headless": 2}  # the explorer's
# rooms, by floor: every source of frames; the window's model (the source the panels read, its step cursor, pacing,
# colours, words); pool views to RGBA; one panel per file; the main window and its Qt adapters. The command line and
# the headless run stand beside the renderer: Qt-free, above the feeds and the model they drive.


def room_of(module: str) -> str | None:
    """The room of an explorer module ("explorer.model.cursor" -> "model"), None for the package's own files."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def floors_climbed(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a room on a higher floor than the importer's (an arrow that runs back up)."""
    bad = []
    for module, targets in sorted(graph.items()):
        here = room_of(module)
        for target in sorted(targets):
            there = room_of(target)
            if here is not None and there is not None and there != here and ROOMS[there] >= ROOMS[here]:
                bad.append(f"{module} ({here}) imports {target} ({there})")
    return bad


def test_every_explorer_module_lives_in_a_room_and_imports_only_below_it():
    """Each room imports only its own modules and rooms on floors below: window -> widgets -> render -> model ->
    feeds (the command line and headless beside the renderer). The window's model is in explorer/model, with its Qt
    adapter in explorer/window; no panel reaches up to the window."""
    graph = explorer_imports("explorer")
    assert {room_of(m) for m in graph} == set(ROOMS) | {None}
    assert "explorer.model.pool_source" in graph and "explorer.window.qt_source" in graph
    assert not [m for m in graph if m.startswith("explorer.widgets.source")]  # the model no longer lives in widgets
    bad = floors_climbed(graph)
    assert not bad, "explorer imports that climb a floor:\n" + "\n".join(bad)


def test_the_floor_check_catches():
    assert floors_climbed({"explorer.model.a": {"explorer.widgets.b"}, "explorer.feeds.c": {"explorer.model.a"},
                           "explorer.headless": {"explorer.window.d"}}) == [
        "explorer.feeds.c (feeds) imports explorer.model.a (model)",
        "explorer.headless (headless) imports explorer.window.d (window)",
        "explorer.model.a (model) imports explorer.widgets.b (widgets)"]
    assert floors_climbed({"explorer.widgets.b": {"explorer.model.a", "explorer.widgets.c"}}) == []


@pytest.mark.parametrize("top", ["explorer", "kvstream"])
def test_no_two_modules_of_a_package_import_each_other(top):
    """No circles in the explorer (File, Help and the menus once imported each other) nor in kvstream (the History
    and the recordings once did, through an import inside a function): each module stands above what it imports,
    so it can be read, and tested, from the ground up."""
    graph = explorer_imports(top)
    if top == "explorer":
        assert graph["explorer.window.actions"] >= {"explorer.window.files"}  # the walk sees relative imports
    cycles = circles(graph)
    assert not cycles, f"{top} modules import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def namespace_readers(folder: Path) -> list[str]:
    """Every function under ``folder`` that takes the command line's namespace (a parameter named ``opts``) and
    every module that imports argparse: what cli.py should have turned into typed specs already."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(arg.arg == "opts" for arg in node.args.args + node.args.kwonlyargs):
                    found.append(f"{path.name}:{node.lineno} {node.name}(opts)")
            elif isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
                found.append(f"{path.name}:{node.lineno} imports argparse")
    return found


def test_the_namespace_stops_at_the_command_line():
    """explorer/cli.py turns the flags once into typed specs (SourceSpec, EngineConfig); the feeds and the window's
    model take those, never the argparse namespace, so they can be driven without a command line."""
    root = Path(__file__).resolve().parents[1] / "explorer"
    assert not namespace_readers(root / "feeds") + namespace_readers(root / "model")
    assert namespace_readers(root / "window")  # the check sees what it looks for (app.py's run_gui(opts, ...))
