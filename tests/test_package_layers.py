"""The package's layers import downward only: model/ and kernels/ know nothing of the engine, the engine
nothing of serving or the entrypoints (README, "How the package is laid out")."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "ouro_backend"
# What each subpackage may import from ouro_backend (besides itself and the shared top-level modules).
ALLOWED = {
    "model": set(),
    "kernels": {"model"},
    "engine": {"model", "kernels"},
    "serving": {"engine", "model"},
    "train": {"engine", "model", "models"},
    "entrypoints": {"engine", "model", "kernels", "serving", "models"},
}
SHARED = {"config", "sampling_params", "outputs", "models"}


def _imports(path: pathlib.Path):
    """(line, top-level ouro_backend part) of every import inside the package, relative or absolute."""
    parts = path.relative_to(PKG.parent).with_suffix("").parts  # ("ouro_backend", "engine", "scheduler")
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = list(base) + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names] if not node.module else [target]
            else:
                names = [node.module.split(".")] if node.module else []
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for t in names:
            if t[0] == "ouro_backend" and len(t) > 1:
                yield node.lineno, t[1]


def test_imports_run_downward():
    bad = []
    for sub, allowed in ALLOWED.items():
        for path in sorted((PKG / sub).rglob("*.py")):
            for line, top in _imports(path):
                if top not in allowed | SHARED | {sub}:
                    bad.append(f"{path.relative_to(PKG.parent)}:{line} imports ouro_backend.{top}")
    for path in sorted(PKG.glob("*.py")):  # the shared top-level modules import no subpackage but the engine's
        for line, top in _imports(path):  # public classes (__init__)
            if top not in SHARED and not (path.name == "__init__.py" and top == "engine"):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports ouro_backend.{top}")
    assert not bad, "\n".join(bad)
