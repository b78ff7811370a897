"""The package's shape, held by tests (docs/architecture.md): no import circles - also none through
imports made inside functions - no module over 450 lines, and no machine's name in the code (the
figures measured on one live in docs/benchmarks.md)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "comfy_modelopt"


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The package's modules ``name`` imports anywhere in its file (``from X import y`` counts as an
    import of ``X.y`` where that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            for alias in node.names:
                hit = next((m for m in (f"{target}.{alias.name}", target) if m in modules), None)
                if hit and hit != name:
                    found.add(hit)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules and a.name != name}
    return found


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles, state = [], {}

    def visit(name, trail):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(trail[trail.index(other):] + [other]))
            elif other not in state:
                visit(other, trail + [other])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles


def test_no_module_over_450_lines_and_no_machine_names():
    long = [f"{p.relative_to(PACKAGE)}: {n}" for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450]
    named = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if "H100" in line or "H200" in line]
    assert not long and not named, (long, named)
