"""What the package declares agrees with what is tested: the torch range with deps.env's pin and
the torch these tests run with, the build backend's requirements with deps.env, the public
functions carry type hints (the package ships py.typed), and the package's modules import each
other in floors, never in a circle."""
import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

import jagflash

ROOT = Path(__file__).resolve().parents[2]
needs_tomllib = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")


def pinned(name):
    for line in (ROOT / "deps.env").read_text().splitlines():
        if line.startswith(name + "="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"deps.env has no {name}")


def pyproject():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def release(version):
    """(major, minor) of a version string such as 2.11.0+cu130."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@needs_tomllib
def test_declared_torch_range_is_the_tested_minor_release():
    (torch_requirement,) = [d for d in pyproject()["project"]["dependencies"] if re.match(r"torch\b", d)]
    major, minor = release(pinned("TORCH_PIP_VERSION"))
    assert torch_requirement.replace(" ", "") == f"torch>={major}.{minor},<{major}.{minor + 1}"
    # The torch running these tests is inside that range too (a test run with another torch
    # would be testing something the package does not declare).
    assert release(torch.__version__) == (major, minor)


@needs_tomllib
def test_build_system_runs_the_in_tree_backend():
    build_system = pyproject()["build-system"]
    assert build_system["build-backend"] == "jagflash_build"
    assert build_system["backend-path"] == ["python/build_backend"]
    # The test tools and GoogleTest are not build requirements.
    assert not any(re.match(r"(clang-format|nvidia-cuda-cuobjdump|nvidia-cuda-nvdisasm)\b", r)
                   for r in build_system["requires"])


def load_backend():
    spec = importlib.util.spec_from_file_location("jagflash_build_under_test",
                                                  ROOT / "python" / "build_backend" / "jagflash_build.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    return backend


@pytest.mark.parametrize("headers_present", [True, False])
def test_backend_asks_for_pinned_cutlass_only_without_the_headers(tmp_path, monkeypatch, headers_present):
    backend = load_backend()
    include = tmp_path / "include"
    if headers_present:
        (include / "cute").mkdir(parents=True)
        (include / "cute" / "tensor.hpp").write_text("")
    monkeypatch.setattr(backend, "cutlass_headers_dir", lambda: include)
    cutlass = [r for r in backend.native_build_requires() if r.startswith("nvidia-cutlass")]
    assert cutlass == ([] if headers_present else [f"nvidia-cutlass=={pinned('CUTLASS_PIP_VERSION')}"])


@pytest.mark.parametrize("version_text, enough", [("cmake version 3.24.0", True), ("cmake version 3.23.5", False),
                                                  ("cmake version 4.1.2", True), (None, False)])
def test_backend_asks_for_cmake_only_without_a_recent_one(monkeypatch, version_text, enough):
    backend = load_backend()
    if version_text is None:
        monkeypatch.setattr(backend.shutil, "which", lambda name: None)
    else:
        monkeypatch.setattr(backend.shutil, "which", lambda name: "/usr/bin/cmake")
        monkeypatch.setattr(backend.subprocess, "run",
                            lambda *a, **k: type("Done", (), {"stdout": version_text + "\n"})())
    assert ("cmake>=3.24" in backend.native_build_requires()) == (not enough)


@pytest.mark.parametrize("has_torch", [True, False])
def test_backend_asks_for_torch_only_when_the_target_environment_has_none(tmp_path, monkeypatch, has_torch):
    """The binding builds against the installed torch when there is one (no second torch in the
    build environment); else pip must bring the package's own torch requirement."""
    backend = load_backend()
    monkeypatch.setattr(backend, "find_torch_dir", lambda: tmp_path if has_torch else None)
    (dependency,) = [d for d in pyproject_dependencies() if re.match(r"torch\b", d)]
    torch_requires = [r for r in backend.native_build_requires() if re.match(r"torch\b", r)]
    assert torch_requires == ([] if has_torch else [dependency])


def test_binding_finds_the_torch_it_runs_with():
    """Outside pip's isolation the binding is built against the torch this Python imports."""
    spec = importlib.util.spec_from_file_location("jagflash_binding_under_test",
                                                  ROOT / "python" / "build_backend" / "jagflash_binding.py")
    binding = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(binding)
    assert binding.find_torch_dir() == Path(torch.__file__).resolve().parent


def pyproject_dependencies():
    """pyproject.toml's dependencies, read without tomllib (Python 3.10 has none)."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.findall(r'"([^"]+)"', re.search(r"^dependencies\s*=\s*\[([^\]]*)\]", text, re.M).group(1))


PUBLIC_FUNCTIONS = [name for name in jagflash.__all__
                    if inspect.isfunction(getattr(jagflash, name))]


def test_public_function_list_is_not_empty():
    assert {"jagged_attention", "attention", "generate_lengths", "visible_pairs"} <= set(PUBLIC_FUNCTIONS)


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_public_functions_are_fully_annotated(name):
    signature = inspect.signature(getattr(jagflash, name))
    unannotated = [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not unannotated, f"jagflash.{name}: parameters without a type hint: {unannotated}"
    assert signature.return_annotation is not inspect.Signature.empty, f"jagflash.{name}: no return type hint"


@pytest.mark.parametrize("op", [jagflash.ops.fwd, jagflash.ops.bwd], ids=["fwd", "bwd"])
def test_custom_ops_have_schemas(op):
    # torch.library.custom_op derives the schema from the type hints: every argument is typed.
    assert "Tensor q" in str(op._opoverload._schema)


# ---- The import floors. Each module of the package imports only modules of its own floor or
# below, at module level: a function-local import of a sibling is how an import circle hides (it
# runs, but the modules are no longer layered). Lowest first.
FLOORS = (
    ("the C library: its structs, its loading, its statuses as exceptions", ("_capi", "_lib", "_errors")),
    ("conventions every caller shares: the mask arguments, the offsets check, the block mask, one call's "
     "arguments and their layout for the ops", ("_mask", "_offsets_check", "block_mask", "_problem")),
    ("which path serves a call, and the slow path's warning", ("_backend",)),
    ("one call of the binding", ("_launch",)),
    ("the custom ops", ("ops",)),
    ("the public API", ("functional", "lengths")),
    ("FlashAttention's signature and torch's registry, on top", ("compat", "registry")),
    ("the package", ("__init__",)),
)
FLOOR_OF = {module: level for level, (_, modules) in enumerate(FLOORS) for module in modules}
PACKAGE_DIR = Path(jagflash.__file__).resolve().parent


def package_sources():
    """{module name: source} of the package that these tests import."""
    return {path.stem: path.read_text() for path in sorted(PACKAGE_DIR.glob("*.py"))}


def own_imports(source, modules):
    """(imported module, line, whether inside a function or class) for every import of one of the
    package's modules in source. modules: the package's module names (a name imported from the
    package that is not one of them comes from __init__)."""
    found = []

    def imported(package_path, names):
        if package_path:
            return [package_path[0]]
        return [name if name in modules else "__init__" for name in names]

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inside = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
            targets = []
            if isinstance(child, ast.Import):
                for alias in child.names:
                    parts = alias.name.split(".")
                    if parts[0] == "jagflash":
                        targets += imported(parts[1:], ["__init__"])
            elif isinstance(child, ast.ImportFrom):
                parts = child.module.split(".") if child.module else []
                names = [alias.name for alias in child.names]
                if child.level == 1:
                    targets += imported(parts, names)
                elif child.level == 0 and parts and parts[0] == "jagflash":
                    targets += imported(parts[1:], names)
            found.extend((target, child.lineno, inside) for target in targets)
            visit(child, inside)

    visit(ast.parse(source), False)
    return found


def floor_violations(sources, floor_of):
    """What breaks the floors in {module: source}: a module with no floor, an import of the package
    inside a function or class, an import of a higher floor, an import circle. Empty when the floors hold."""
    problems = [f"{module}: in no floor (add it to FLOORS)" for module in sources if module not in floor_of]
    graph = {}
    for module, source in sources.items():
        graph[module] = set()
        for target, line, local in own_imports(source, set(sources)):
            graph[module].add(target)
            if local:
                problems.append(f"{module}:{line}: imports {target} inside a function or class")
            if module in floor_of and target in floor_of and floor_of[target] > floor_of[module]:
                problems.append(f"{module}:{line}: imports {target}, a floor above its own "
                                f"({floor_of[target]} > {floor_of[module]})")
    # A circle among modules of one floor (the floors alone allow imports within a floor).
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                problems.append("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return problems


def test_every_module_is_on_a_floor_and_every_floor_module_exists():
    assert set(package_sources()) == set(FLOOR_OF)


def test_modules_import_only_their_floor_or_below_at_module_level():
    assert floor_violations(package_sources(), FLOOR_OF) == []


def test_floor_check_finds_the_circle_a_local_import_hides():
    """The check itself, on a package with the circle these floors removed (_launch imports
    _backend, and _backend imports _launch and functional inside a function), an import from the
    package's __init__ below it, and a module on no floor."""
    sources = {
        "_capi": "import ctypes\n",
        "_backend": "from . import _capi\n\ndef backend():\n    from . import _launch\n"
                    "    from .functional import _offsets\n",
        "_launch": "from . import _backend, _capi\n",
        "ops": "from jagflash import _launch, JagflashError\n",
        "functional": "import jagflash._launch\nfrom . import ops\n",
        "extra": "from . import _capi\n",
    }
    floor_of = {"_capi": 0, "_backend": 1, "_launch": 2, "ops": 3, "functional": 4, "__init__": 5}
    assert floor_violations(sources, floor_of) == [
        "extra: in no floor (add it to FLOORS)",
        "_backend:4: imports _launch inside a function or class",
        "_backend:4: imports _launch, a floor above its own (2 > 1)",
        "_backend:5: imports functional inside a function or class",
        "_backend:5: imports functional, a floor above its own (4 > 1)",
        "ops:1: imports __init__, a floor above its own (5 > 3)",
        "import circle: _backend -> _launch -> _backend",
    ]
