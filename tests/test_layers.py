"""The layer rules of docs/architecture.md that import-linter cannot state: only ``shardsafe.dist``
uses torch.distributed's process-group API, and no module imports another module's private
names (a leading underscore) from outside its own package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"

# torch.distributed's sub-packages that hold types and protocols, not collectives: DTensor and its
# placements (adapters), FSDP's module types (adapters), DCP's planner and storage interfaces (the
# DCP plugin), which every layer may name.
_TYPE_PACKAGES = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed._composable")
_TYPE_NAMES = {"ProcessGroup"}  # only under TYPE_CHECKING


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, ast.parse(path.read_text(), str(path))))
    return out


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_package = (SRC.parent / Path(*package) / "__init__.py").exists()
    base = package if is_package else package[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _collective_imports(module: str, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" or alias.name.startswith("torch.distributed.distributed_c10d"):
                    found.append(f"{module}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                found.append(f"{module}: from torch import distributed")
            elif node.module == "torch.distributed":
                found += [f"{module}: from torch.distributed import {a.name}" for a in node.names if a.name not in _TYPE_NAMES]
            elif node.module.startswith("torch.distributed") and not node.module.startswith(_TYPE_PACKAGES):
                found.append(f"{module}: from {node.module} import ...")
    return found


def test_only_dist_uses_the_process_group_api():
    offenders = [line for name, tree in _modules() if name != "shardsafe.dist" for line in _collective_imports(name, tree)]
    assert offenders == []


def test_the_checker_sees_a_collective_import():
    tree = ast.parse("import torch.distributed as dist\nfrom torch.distributed import all_gather\nfrom torch.distributed.tensor import DTensor\n")
    assert _collective_imports("m", tree) == ["m: import torch.distributed", "m: from torch.distributed import all_gather"]


def _area(module: str) -> str:
    """The part of shardsafe a module belongs to: its sub-package (``shardsafe.megatron`` for
    ``shardsafe.megatron.strategies.base``), or itself for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _private_imports(module: str, tree: ast.Module) -> list[str]:
    """Private names imported from a module of another sub-package or top-level module."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _absolute(module, node)
        if not source.startswith("shardsafe"):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                if _area(source) != _area(module) and source != "shardsafe":
                    found.append(f"{module}: from {source} import {alias.name}")
    return found


def test_no_private_name_crosses_a_package():
    offenders = [line for name, tree in _modules() for line in _private_imports(name, tree)]
    assert offenders == []


@pytest.mark.parametrize(
    ("module", "code", "expected"),
    [
        ("shardsafe.dcp.convert", "from ..lightning._checkpoint import _plain\n", ["shardsafe.dcp.convert: from shardsafe.lightning._checkpoint import _plain"]),
        ("shardsafe.dcp.convert", "from .values import _helper\n", []),
        ("shardsafe.megatron.strategies.fully_parallel", "from ..utils import _sharded_object_id\n", []),
        ("shardsafe.api", "from .checkpointer import _read_metadata\n", ["shardsafe.api: from shardsafe.checkpointer import _read_metadata"]),
        ("shardsafe.engine.writer", "from ..format.values import encode_objects\n", []),
    ],
)
def test_the_checker_sees_a_private_import(module, code, expected):
    assert _private_imports(module, ast.parse(code)) == expected
