"""The package's shape: no import cycle (imports inside functions count), small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import prefixserve

PACKAGE = Path(prefixserve.__file__).parent
MAX_LINES = 700
# A module may be longer when its docstring says why, in a sentence starting with this.
LONG_MODULE_REASON = "Longer than 700 lines because"


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (functions included)."""
    files = {module_name(root, path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: None if is_package else -1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_package_has_no_import_cycle_counting_imports_inside_functions():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import json\n")
    assert find_cycle(import_graph(pkg)) is None


def test_no_module_is_over_700_lines_without_a_reason_at_its_top():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            if LONG_MODULE_REASON not in docstring:
                long.append(f"{path.relative_to(PACKAGE)} ({text.count(chr(10))} lines)")
    assert not long, f"modules over {MAX_LINES} lines with no reason in their docstring: {long}"


def test_no_native_source_is_over_700_lines_without_a_reason_at_its_top():
    """The same rule for csrc/: the reason in the file's opening comment (its first 40 lines)."""
    long = []
    for path in sorted((PACKAGE / "model" / "kernels" / "csrc").rglob("*")):
        if path.suffix not in (".cpp", ".h"):
            continue
        text = path.read_text()
        opening = "\n".join(text.splitlines()[:40])
        if text.count("\n") > MAX_LINES and LONG_MODULE_REASON not in opening:
            long.append(f"{path.name} ({text.count(chr(10))} lines)")
    assert not long, f"native sources over {MAX_LINES} lines with no reason at their top: {long}"


def test_the_native_bindings_live_in_their_own_file():
    csrc = PACKAGE / "model" / "kernels" / "csrc"
    holders = [p.name for p in csrc.rglob("*.cpp") if "PYBIND11_MODULE" in p.read_text()]
    assert holders == ["bindings.cpp"]


def test_every_module_says_its_job_in_a_docstring():
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not missing, f"modules without a docstring: {missing}"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_core_imports_nothing_of_torch_the_engine_the_worker_the_model_or_the_server():
    """Nor of the tiers, the proposers or the grammars: the scheduler names them through the
    protocols of core/sched/interfaces.py (and core/request.py's RequestGrammar), which they
    implement."""
    above = ("engine", "worker", "model", "entrypoints", "cluster", "lora", "llm", "cli", "bench")
    above += ("kv_store", "spec_decode", "inputs", "structured_output")
    forbidden = ("torch",) + tuple(f"prefixserve.{room}" for room in above)
    found = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / "core").rglob("*.py"))
        for name in _imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    }
    assert not found, sorted(found)


def test_config_is_the_bottom_floor_and_imports_no_room_of_the_package():
    """config.py's records hold plain values: importing it imports no other module of the
    package but dtypes.py (so importing core/ never imports the disk tier, LoRA or speculation
    through the config)."""
    imported = {
        name for name in _imported_modules(PACKAGE / "config.py") if name.startswith("prefixserve")
    }
    assert imported <= {"prefixserve.dtypes"}, sorted(imported)


def test_the_package_root_holds_at_most_a_dozen_modules():
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root_modules) <= 12, root_modules


def test_every_folder_says_what_it_holds():
    missing = [
        str(init.relative_to(PACKAGE))
        for init in sorted(PACKAGE.rglob("__init__.py"))
        if not ast.get_docstring(ast.parse(init.read_text()))
    ]
    assert not missing, missing


def test_the_server_and_the_cluster_import_the_engines_errors_not_its_implementation():
    """entrypoints/ and cluster/ know an engine through engine/client.py (EngineClient,
    EngineRequest), engine/exceptions.py (its errors) and engine/request_stream.py (its
    streams); the step loop's files are the CLI's and a replica's to build, nobody's to import
    from (cluster/replica.py builds one, inside the function that does)."""
    implementation = ("prefixserve.engine.async_llm", "prefixserve.engine.llm_engine")
    found = set()
    for room in ("entrypoints", "cluster"):
        for path in sorted((PACKAGE / room).rglob("*.py")):
            top_level = {
                node.module
                for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.ImportFrom) and node.module
            }
            found |= {
                f"{path.relative_to(PACKAGE)} imports {name}"
                for name in top_level & set(implementation)
            }
    assert not found, sorted(found)


def _room(module: str) -> str:
    """The top-level room of a module of the package (`prefixserve.core.sched.scheduler` ->
    `core`); a root module is its own room (`prefixserve.outputs` -> `outputs`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph collapsed to top-level rooms (a room's imports of itself dropped)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        room = _room(module)
        rooms.setdefault(room, set()).update(_room(t) for t in targets if _room(t) != room)
    for targets in list(rooms.values()):
        for target in targets:
            rooms.setdefault(target, set())
    return rooms


def test_no_cycle_among_the_top_level_rooms():
    """Collapsed to its rooms (core, kv_store, spec_decode, engine, worker, ...), the package's
    imports form no cycle: every arrow points down (imports inside functions count)."""
    cycle = find_cycle(room_graph(import_graph(PACKAGE)))
    assert cycle is None, "rooms import each other: " + " -> ".join(cycle)


def test_the_room_check_finds_a_cycle_between_two_rooms_that_modules_alone_hide(tmp_path):
    pkg = tmp_path / "pkg"
    for room in ("low", "high"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from pkg.high import b\n")
    (pkg / "high" / "b.py").write_text("import json\n")
    (pkg / "high" / "c.py").write_text("from pkg.low import d\n")
    (pkg / "low" / "d.py").write_text("import json\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) is None  # no module cycle...
    assert find_cycle(room_graph(graph)) is not None  # ...but low and high import each other


def test_the_worker_never_imports_the_engine():
    found = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / "worker").rglob("*.py"))
        for name in _imported_modules(path)
        if name == "prefixserve.engine" or name.startswith("prefixserve.engine.")
    }
    assert not found, sorted(found)


def test_the_root_records_import_no_room():
    """outputs.py and sampling_params.py are records every room reads: they import no room of
    the package (config.py's records and dtypes.py at most)."""
    allowed = {"prefixserve.config", "prefixserve.dtypes"}
    found = {
        f"{name} imports {imported}"
        for name in ("outputs.py", "sampling_params.py")
        for imported in _imported_modules(PACKAGE / name)
        if imported.startswith("prefixserve") and imported not in allowed
    }
    assert not found, sorted(found)


def _attribute_assignments(tree: ast.AST) -> list[str]:
    """`a.b = ...` targets in `tree` whose object is not `self` itself (`self.x = ...` is a
    field of the object being built; `part.x = ...` wires one part into another)."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                is_self = isinstance(item, ast.Attribute) and (
                    isinstance(item.value, ast.Name) and item.value.id == "self"
                )
                if isinstance(item, ast.Attribute) and not is_self:
                    found.append(f"line {node.lineno}: {ast.unparse(item)}")
    return found


def test_an_engines_parts_are_wired_through_their_constructors():
    """The builders (engine/builder.py, kv_store/open_tiers.py) set no attribute of a part they
    built, and LLMEngine's and KVCacheManager's constructors set only their own fields: what a
    part uses is an argument of its constructor, never an attribute set after it."""
    found = {
        f"{name}: {line}"
        for name in ("engine/builder.py", "kv_store/open_tiers.py")
        for line in _attribute_assignments(ast.parse((PACKAGE / name).read_text()))
    }
    for name, cls in (
        ("engine/llm_engine.py", "LLMEngine"),
        ("core/kv_cache/kv_cache_manager.py", "KVCacheManager"),
    ):
        tree = ast.parse((PACKAGE / name).read_text())
        init = next(
            item
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.name == cls
            for item in node.body
            if isinstance(item, ast.FunctionDef) and item.name == "__init__"
        )
        found |= {f"{cls}.__init__: {line}" for line in _attribute_assignments(init)}
    assert not found, sorted(found)


def test_the_wiring_check_sees_a_part_set_after_construction():
    tree = ast.parse("s = Scheduler()\ns.kv_connector = c\nself.a = self.b.c = 1\n")
    assert _attribute_assignments(tree) == ["line 2: s.kv_connector", "line 3: self.b.c"]


ENTRYPOINTS = "prefixserve.entrypoints"
DIALECTS = ("openai", "anthropic")


def entrypoints_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports among entrypoints/' sub-rooms (`server`, the shell; the dialects `openai` and
    `anthropic`; `chat`, what both dialects share; `api_server`, the module composing them),
    each module collapsed to its sub-room, a sub-room's imports of itself dropped."""

    def sub_room(module: str) -> str | None:
        if not module.startswith(ENTRYPOINTS + "."):
            return None
        return module.removeprefix(ENTRYPOINTS + ".").split(".")[0]

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        room = sub_room(module)
        if room is None:
            continue
        found = {sub_room(t) for t in targets} - {None, room}
        rooms.setdefault(room, set()).update(r for r in found if r is not None)
    for targets in list(rooms.values()):
        for target in targets:
            rooms.setdefault(target, set())
    return rooms


def test_the_entrypoints_sub_rooms_have_no_cycle():
    """server/, openai/, anthropic/, chat/ and api_server.py import each other one way only
    (imports inside functions count)."""
    rooms = entrypoints_graph(import_graph(PACKAGE))
    assert {"server", "openai", "anthropic", "chat", "api_server"} <= set(rooms), sorted(rooms)
    cycle = find_cycle(rooms)
    assert cycle is None, "entrypoints' sub-rooms import each other: " + " -> ".join(cycle)


def test_the_server_shell_imports_no_dialect_and_the_dialects_never_import_each_other():
    """The shell (server/) knows no dialect: the dialects register their routes on it, and
    api_server.py is the one module that imports the shell and both of them."""
    rooms = entrypoints_graph(import_graph(PACKAGE))
    found = {f"server imports {d}" for d in rooms["server"] & {*DIALECTS, "api_server"}}
    found |= {f"{a} imports {b}" for a in DIALECTS for b in DIALECTS if b in rooms[a]}
    found |= {f"{a} imports api_server" for a in (*DIALECTS, "chat") if "api_server" in rooms[a]}
    assert not found, sorted(found)
    assert rooms["api_server"] >= {"server", *DIALECTS}


def test_the_entrypoints_check_sees_one_dialect_import_the_other(tmp_path):
    pkg = tmp_path / "prefixserve"
    for room in ("", "/server", "/openai", "/anthropic"):
        (pkg / f"entrypoints{room}").mkdir(parents=True)
        (pkg / f"entrypoints{room}" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "entrypoints" / "server" / "state.py").write_text("import json\n")
    (pkg / "entrypoints" / "openai" / "serving.py").write_text(
        "from prefixserve.entrypoints.server.state import x\n"
    )
    (pkg / "entrypoints" / "anthropic" / "serving.py").write_text(
        "def f():\n    from prefixserve.entrypoints.openai import serving\n"
    )
    rooms = entrypoints_graph(import_graph(pkg))
    assert rooms == {"server": set(), "openai": {"server"}, "anthropic": {"openai"}}
