"""The layering the package's tree promises, read from the source with ``ast`` (nothing is imported):

- only ``integrations/`` imports Lightning or transformers (and the apps ``demo/`` and ``commands/``, and
  ``_compat.py``, whose guarded imports sit inside functions);
- ``theory/`` imports nothing of the monitor: only itself and the shared vocabulary;
- no module imports from a layer above its own (:data:`LAYERS`, every subpackage and top-level module, lowest first).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_stale"
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "peft")
APPS = ("integrations", "demo", "commands")


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
    if part(path) in APPS:
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


# Every subpackage and top-level module of the package, lowest layer first. A module imports only from the layers
# below its own and from inside its own part: nothing runs back up, and no two parts of one layer lean on each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_compat.py",),  # other packages' private and version-dependent APIs
    ("testing",),  # the host-sync counter and the meta stand-in: they lean on nothing they measure
    ("vocab.py",),  # names and argument checks
    # what the user is told, sums across ranks, the saved state's versions, copies to the device
    ("messages.py", "ranks.py", "state.py", "transfers.py"),
    ("formats", "theory"),  # number formats; the stall theory
    ("sim.py", "optim"),  # the theory's simulation; QuantizedAdamW
    ("adapters",),  # optimizer state -> slots (and their samples)
    ("measure",),  # slots -> counts
    ("decide",),  # counts -> ledger, forecast, policies, remedies
    ("act",),  # decisions -> resets, guards, weight writes
    ("monitor",),  # the components around each optimizer
    ("integrations",),  # the front-ends of training frameworks
    ("fabric.py", "hf.py", "factory.py", "policies.py", "remedies.py"),  # documented paths, re-exporting
    ("__init__.py",),
    ("demo",),
    ("commands",),
    ("cli.py",),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def part_of_name(name: str) -> str | None:
    """The part of the package an imported name lies in: None for other packages and for the package itself (the
    base of ``from lightning_stale import _compat``); a name the package's ``__init__`` holds is ``__init__.py``'s."""
    parts = name.split(".")
    if parts[0] != "lightning_stale" or len(parts) == 1:
        return None
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return f"{parts[1]}.py" if (PACKAGE / f"{parts[1]}.py").is_file() else "__init__.py"


def test_every_part_of_the_package_has_a_layer() -> None:
    found = {part(p) for p in modules()}
    assert found == set(LAYER), f"not layered: {sorted(found - set(LAYER))}; gone: {sorted(set(LAYER) - found)}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_back_up_a_layer(path: Path) -> None:
    own = part(path)
    for name in imports(path):
        target = part_of_name(name)
        if target is None or target == own:
            continue
        assert LAYER[target] < LAYER[own], (f"{path.relative_to(PACKAGE)} ({own}, layer {LAYER[own]}) imports {name} "
                                             f"({target}, layer {LAYER[target]})")


def test_the_layer_check_sees_an_upward_import() -> None:
    assert part_of_name("lightning_stale.monitor.monitor") == "monitor"
    assert part_of_name("lightning_stale.StaleStateCallback") == "__init__.py"
    assert part_of_name("lightning_stale._compat") == "_compat.py" and part_of_name("lightning_stale") is None
    assert LAYER[part_of_name("lightning_stale.monitor.metrics")] > LAYER["measure"]
