"""The package's imports point one way (docs/design.md section 3), read from the source with ``ast``.

Every ``import`` / ``from ... import`` in every module of hyscale_hf counts, at module level and
inside functions alike, plus ``importlib.import_module("hyscale_hf....")`` calls with a literal
name and the package ``__init__``'s table of lazily loaded names. An edge goes to the module an
import names; the parent packages Python initialises on the way are not edges (every submodule
import would otherwise point at ``hyscale_hf/__init__``, which is why that file imports nothing).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hyscale_hf

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hyscale_hf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _known(name: str) -> str | None:
    """The longest hyscale_hf module that ``name`` starts with (None outside the package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported hyscale_hf module, at module level?) for each import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            target = _known(name)
            if target and target != module:
                found.append((target, id(node) in top_level))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {module: {target for target, _ in _imports(module)} for module in MODULES}
    # The package __init__ loads its public names on first access: those are its imports.
    graph["hyscale_hf"] |= {f"hyscale_hf.{where}" for where in hyscale_hf._PUBLIC.values()}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    # patching reaches the families only inside functions: the walk must see those imports.
    edges = dict(_imports("hyscale_hf.patching"))
    assert edges["hyscale_hf.model_patches"] is False
    assert edges["hyscale_hf.state"] is True
    assert ("hyscale_hf.families", True) in _imports("hyscale_hf.model_patches.llama")


def test_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_hyscale_hf():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_nothing_of_hyscale_hf_outside_kernels():
    for module in MODULES:
        if module.startswith("hyscale_hf.kernels"):
            outside = {t for t, _ in _imports(module) if not t.startswith("hyscale_hf.kernels")}
            assert not outside, f"{module} imports {sorted(outside)}"


def test_core_never_imports_model_patches_at_module_level():
    for module in MODULES:
        if module.startswith(("hyscale_hf.model_patches", "hyscale_hf.recipes")):
            continue
        eager = {t for t, top in _imports(module) if top and t.startswith("hyscale_hf.model_patches")}
        assert not eager, f"{module} imports {sorted(eager)} at module level"


def _run(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_importing_the_kernels_does_not_import_transformers():
    _run("import hyscale_hf.kernels, sys; assert 'transformers' not in sys.modules")


def test_package_and_core_names_do_not_import_transformers_until_families_are_needed():
    glue = {"callbacks", "model_patches._checkpointing"}
    light = sorted(name for name, where in hyscale_hf._PUBLIC.items() if where not in glue)
    _run(
        "import sys, hyscale_hf\n"
        f"for name in {light!r}: getattr(hyscale_hf, name)\n"
        "hyscale_hf.HyScaleConfig(topk=4)\n"
        "assert 'transformers' not in sys.modules, 'a core name imported transformers'\n"
        # The families register on first use of patch_model / supported_model_types.
        "assert 'llama' in hyscale_hf.supported_model_types()\n"
    )


@pytest.mark.parametrize("name", hyscale_hf.__all__)
def test_every_public_name_resolves(name):
    assert getattr(hyscale_hf, name) is not None
    assert name in dir(hyscale_hf)


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hyscale_hf.nope  # noqa: B018
