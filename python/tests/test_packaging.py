"""What the package declares agrees with what is tested: the torch range with deps.env's pin and
the torch these tests run with, the build backend's requirements with deps.env, and the public
functions carry type hints (the package ships py.typed)."""
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
