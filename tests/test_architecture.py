"""The package's shape: imports run one way, down the layers, with no cycle.

Every import is counted, those inside functions included; an import inside a function
is allowed only for an optional dependency (it is not a way around a layer rule)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specmoe"

# Bottom to top. A module may import modules of its own package or of a lower layer.
# The cost model is a side library: it sits just above the base and is imported only
# from autotune and the entry points.
LAYERS = [
    ["specmoe.base"],
    ["specmoe.costmodel"],
    ["specmoe.kernels"],
    ["specmoe.model"],
    ["specmoe.experts"],
    ["specmoe.policies"],
    ["specmoe.engine"],
    ["specmoe.autotune"],
    ["specmoe.api", "specmoe.flags"],
    ["specmoe.tools"],
    ["specmoe.server", "specmoe.bench"],
    ["specmoe.distributed"],  # engine replicas on Ray: composes the server (serve --replicas)
    ["specmoe.cli", "specmoe"],
]
COSTMODEL_MAY_USE = ("specmoe.base", "specmoe.costmodel")
COSTMODEL_USERS = ("specmoe.autotune", "specmoe.tools", "specmoe.bench", "specmoe.costmodel")
OPTIONAL = {"fastapi", "uvicorn", "starlette", "matplotlib", "rich", "ray", "transformers", "scipy", "httpx",
            "llama_cpp", "gguf", "compressed_tensors", "selenium", "pyarrow", "llmcompressor", "datasets"}
# project modules that exist to wrap an optional dependency (the FastAPI app, uvicorn, Ray Serve)
WRAPS_OPTIONAL = ("specmoe.server.app", "specmoe.server.graceful", "specmoe.distributed.serve", "importlib.util")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Absolute names an ImportFrom brings in (a name may be a submodule)."""
    if node.level == 0:
        base = node.module or ""
    else:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def imports_of(path: Path, package: Path = PACKAGE) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import in the file."""
    module, tree = module_name(path, package), ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in inside, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(n, id(node) in inside, node.lineno) for n in resolve(module, path.name == "__init__.py", node)]
    return found


def project_edges(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> project modules it imports."""
    known = {module_name(p, package) for p in package.rglob("*.py")}
    edges = {}
    for path in package.rglob("*.py"):
        targets = {name for name, _, _ in imports_of(path, package) if name in known}
        edges[module_name(path, package)] = targets - {module_name(path, package)}
    return edges


def layer_of(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in edges.items():
        for target in targets:
            if package_of(target) == package_of(module) and module != "specmoe":
                continue
            if layer_of(target) >= layer_of(module) and module != "specmoe":
                bad.append(f"{module} -> {target}")
            if target.startswith("specmoe.costmodel") and not module.startswith(COSTMODEL_USERS):
                bad.append(f"{module} -> {target} (the cost model serves autotune and the tools only)")
            if module.startswith("specmoe.costmodel") and not target.startswith(COSTMODEL_MAY_USE):
                bad.append(f"{module} -> {target} (the cost model imports only the base layer)")
    return sorted(bad)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle among modules (each package's __init__ counted as a module), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_imports_go_down_the_layers():
    assert upward_imports(project_edges()) == []


def test_no_import_cycle():
    assert find_cycle(project_edges()) is None


def test_imports_inside_functions_are_only_for_optional_dependencies():
    lazy = []
    for path in PACKAGE.rglob("*.py"):
        for name, inside, line in imports_of(path):
            root = name.split(".")[0]
            if inside and root not in OPTIONAL and not name.startswith(WRAPS_OPTIONAL):
                lazy.append(f"{path.relative_to(PACKAGE)}:{line} imports {name} inside a function")
    assert sorted(set(lazy)) == []


def test_the_cost_model_imports_no_torch():
    for path in (PACKAGE / "costmodel").rglob("*.py"):
        assert not [n for n, _, _ in imports_of(path) if n.split(".")[0] == "torch"], path


def test_modules_and_functions_fit_on_a_screen():
    long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


# --- the checker itself: it must catch what it is for -------------------------------------


def test_checker_flags_an_upward_import():
    edges = {"specmoe.model.moe": {"specmoe.policies.base"}, "specmoe.policies.base": set()}
    assert upward_imports(edges) == ["specmoe.model.moe -> specmoe.policies.base"]


def test_checker_flags_a_cycle_through_function_level_imports(tmp_path):
    """A package of two modules in tmp_path: engine imports policies at the top, policies
    imports engine back inside a function. The edges read from the files close the cycle."""
    package = tmp_path / "specmoe"
    files = {"__init__.py": "", "engine/__init__.py": "", "engine/engine.py": "from ..policies import auto\n",
             "policies/__init__.py": "", "policies/auto.py": "def f():\n    from ..engine import engine\n"}
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert imports_of(package / "policies" / "auto.py", package) == [
        ("specmoe.engine", True, 2), ("specmoe.engine.engine", True, 2)]
    edges = project_edges(package)
    assert edges["specmoe.policies.auto"] == {"specmoe.engine", "specmoe.engine.engine"}
    assert find_cycle(edges) == ["specmoe.engine.engine", "specmoe.policies.auto", "specmoe.engine.engine"]
    assert "specmoe.policies.auto -> specmoe.engine.engine" in upward_imports(edges)


@pytest.mark.parametrize("module", ["specmoe.base.units", "specmoe.costmodel.shapes", "specmoe.cli"])
def test_every_module_has_a_layer(module):
    assert layer_of(module) >= 0
