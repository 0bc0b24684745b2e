"""The code base stays ruff-clean (the project's style gate runs with the tests)."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    return subprocess.run([ruff, *args, str(ROOT)], capture_output=True, text=True)


def test_ruff_check_clean():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean():
    result = _ruff("format", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


# --- the layout (docs/architecture.md) ----------------------------------------------------

SRC = ROOT / "fp8jax" / "_src"
#: The floors of `fp8jax/_src`, bottom up: a module imports from its own folder or a lower
#: floor only. `convert` and `train` stand side by side and do not import each other.
FLOORS = {
    "core": 0,
    "kernels": 1,
    "recipes": 2,
    "gemm": 3,
    "ops": 4,
    "layers": 5,
    "convert": 6,
    "train": 6,
    "observe": 7,
}
MAX_LINES = 520


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / "fp8jax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every import in the file, lazy ones too."""
    import ast

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
    return found


def _targets(module: str, names: list[str], modules: dict) -> list[str]:
    """The fp8jax modules an import reaches: `from pkg import mod` reaches `pkg.mod`."""
    if not module.startswith("fp8jax"):
        return []
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
    return subs or [module]


def _floor(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "_src" and parts[2] in FLOORS:
        return parts[2], FLOORS[parts[2]]
    return None


def test_src_imports_run_down_the_floors_only():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        here = _floor(name)
        if here is None:
            continue
        for module, names, line in _imports(name, path):
            for target in _targets(module, names, modules):
                there = _floor(target)
                if target.startswith("fp8jax._src") and there is None and target != "fp8jax._src":
                    wrong.append(f"{name}:{line} -> {target} (a module outside the floors)")
                elif there and (
                    there[1] > here[1] or (there[1] == here[1] and there[0] != here[0])
                ):
                    wrong.append(f"{name}:{line} -> {target}")
                elif target == "fp8jax" or (
                    target.startswith("fp8jax.") and not target.startswith("fp8jax._src")
                ):
                    wrong.append(f"{name}:{line} -> {target} (the public API, above every floor)")
    assert not wrong, "imports up or across the floors:\n" + "\n".join(wrong)


def test_no_import_circle():
    modules = _modules()
    graph = {
        name: {
            t
            for module, names, _ in _imports(name, path)
            for t in _targets(module, names, modules)
            if t in modules and t != name and not name.startswith(t + ".")
        }
        for name, path in modules.items()
    }
    done, stack, circles = set(), [], []

    def visit(node: str) -> None:
        if node in stack:
            circles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_no_module_over_the_limit():
    """fp8jax's modules and the GPU check's (`benchmarks/gpu_check`: run once, unattended,
    on a lent GPU, where a module too long to read whole hides what a lease spends)."""
    modules = [*(ROOT / "fp8jax").rglob("*.py"), *(ROOT / "benchmarks" / "gpu_check").glob("*.py")]
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_src_module_is_on_the_architecture_page():
    """docs/architecture.md draws each module of `fp8jax/_src` in its layer: a new module
    left off the drawing is a layout nobody reviewed."""
    import re

    words = set(re.findall(r"\w+", (ROOT / "docs" / "architecture.md").read_text()))
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted(SRC.rglob("*.py"))
        if (p.parent.name if p.stem == "__init__" else p.stem) not in words
    ]
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_no_underscore_name_imported_across_modules():
    """A module's private helpers stay its own: what others need is its public-within-_src
    API. Tests, benchmarks, notebooks' helpers and examples are held to the same."""
    import ast

    files = [*(ROOT / "fp8jax").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    files += [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "notebooks").glob("*.py")]
    wrong = []
    for path in files:
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("fp8jax")
            ):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
                    aliases.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and path.parts[-2] != "fp8jax"
            ):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}"
                )
    assert not wrong, "\n".join(wrong)
