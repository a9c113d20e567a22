"""The layering the package's tree promises, read from the source with ``ast`` (nothing is imported):

- only ``integrations/`` imports Lightning or transformers (and the apps ``demo/`` and ``commands/``, the top-level
  re-export modules of integrations, and ``_compat.py``, whose guarded imports sit inside functions);
- ``theory/`` imports nothing of the monitor: only itself and the shared vocabulary;
- the lower layers do not import the ones above them (measure does not import decide or act, decide does not import
  act, and none of them imports the monitor or the integrations other than the monitor's messages and collective).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_stale"
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "peft")
APPS = ("integrations", "demo", "commands")
REEXPORTS = ("fabric.py", "hf.py", "factory.py")  # the documented paths of integrations' modules


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imports(path: Path, module_level_only: bool = False) -> list[str]:
    """The absolute module names ``path`` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    nodes = ast.iter_child_nodes(tree) if module_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif module_level_only and isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, try/except imports
            found += [n for sub in ast.walk(node) for n in _names(sub)]
    return found


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module]
    return []


def part(path: Path) -> str:
    """The subpackage (or top-level file name) ``path`` belongs to."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.name


def is_framework(name: str) -> bool:
    return name.split(".")[0] in FRAMEWORKS


def test_the_contract_reads_real_imports() -> None:
    assert any(is_framework(n) for n in imports(PACKAGE / "integrations" / "callback.py"))
    assert "lightning_stale.measure.engine" in imports(PACKAGE / "monitor" / "pipeline.py")


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_integrations_import_training_frameworks(path: Path) -> None:
    if part(path) in APPS or part(path) in REEXPORTS:
        return
    if part(path) == "_compat.py":  # guarded imports with a fallback, each inside the function that needs it
        found = [n for n in imports(path, module_level_only=True) if is_framework(n)]
    else:
        found = [n for n in imports(path) if is_framework(n)]
    assert not found, f"{path.relative_to(PACKAGE)} imports {found}: only lightning_stale/integrations/ may"


@pytest.mark.parametrize("path", sorted((PACKAGE / "theory").rglob("*.py")), ids=lambda p: p.name)
def test_theory_imports_nothing_of_the_monitor(path: Path) -> None:
    ours = [n for n in imports(path) if n.startswith("lightning_stale")]
    allowed = ("lightning_stale.theory", "lightning_stale.vocab")
    bad = [n for n in ours if n != "lightning_stale" and not n.startswith(allowed)]
    assert not bad, f"theory/{path.name} imports {bad}"


LOWER = {"measure": ("decide", "act", "integrations"), "decide": ("act", "integrations"), "act": ("integrations",)}
SHARED_FROM_MONITOR = ("lightning_stale.monitor.messages", "lightning_stale.monitor.collective")


@pytest.mark.parametrize("layer", sorted(LOWER))
def test_lower_layers_do_not_import_upper_ones(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imports(path):
            upper = [f"lightning_stale.{u}" for u in LOWER[layer]]
            assert not any(name == u or name.startswith(u + ".") for u in upper), f"{path} imports {name}"
            if name.startswith("lightning_stale.monitor"):
                assert name.startswith(SHARED_FROM_MONITOR), f"{path} imports {name}"
