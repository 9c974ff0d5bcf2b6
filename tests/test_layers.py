"""The package layers: imports point downwards only, and none hides inside a function.

``LAYERS`` lists shardflow's packages from the top down. A module may import modules of its own
package and of any package in a lower layer; packages sharing a layer are independent of each
other. A module belongs to the longest package name that prefixes it, so ``engine.generate`` is a
layer of its own above ``engine`` (the forward-pass pieces that generation and training share).
No exceptions list: a new import that breaks the order fails this test.

Imports inside functions hide a module's real dependencies (and an upward import from this
test); they are allowed only for heavy third-party modules that an optional path needs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardflow

LAYERS: list[list[str]] = [
    ["cli"],
    ["runtime", "profiler", "examples"],
    ["engine.adaptive"],
    ["engine.generate", "engine.train"],
    ["engine", "plan"],
    ["rl"],
    ["perf"],
    ["models"],
    ["parallel"],
    ["data"],
    ["config"],
]

# Imported where their optional path starts (pictures, Parquet files, TensorBoard, the math
# reward, a torch version's variable-length attention, torch's compiler), so that runs without it
# never load them.
LAZY_THIRD_PARTY = ("matplotlib", "pyarrow", "torch.utils.tensorboard", "math_verify", "torch.nn.attention.varlen",
                    "datasets", "huggingface_hub", "wandb", "mlflow", "torch._dynamo", "torch._inductor",
                    "torch._functorch", "flash_attn.cute")


def package_of(module: str, layers: list[list[str]]) -> str | None:
    """The longest layered package prefixing ``module`` (dotted, without the root name)."""
    names = [p for layer in layers for p in layer]
    matches = [p for p in names if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def imports_of(path: Path, root: str) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every import in ``path``; internal modules
    relative to ``root``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module == root:  # ``from shardflow import parallel``: the named packages
                    found.extend((child.lineno, f"{root}.{a.name}", in_function) for a in child.names)
                else:
                    found.append((child.lineno, child.module, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def violations(src: Path, root: str = "shardflow", layers: list[list[str]] = LAYERS) -> list[str]:
    """Every import under ``src`` (the package directory) that points up or sideways, or hides in a
    function without being a lazy third-party import."""
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    found = []
    for path in sorted(src.rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        where = f"{root}/{path.relative_to(src)}"
        mine = package_of(module, layers) if module not in ("__init__", "__main__") else None
        if mine is None and module not in ("__init__", "__main__"):
            found.append(f"{where}: module {root}.{module} is in no layer")
            continue
        for line, target, in_function in imports_of(path, root):
            internal = target == root or target.startswith(root + ".")
            if in_function and not (not internal and target.startswith(LAZY_THIRD_PARTY)):
                found.append(f"{where}:{line}: imports {target} inside a function")
            if not internal or mine is None:
                continue
            theirs = package_of(target.removeprefix(root).removeprefix("."), layers)
            if theirs is None or theirs == mine:
                continue
            if rank[theirs] < rank[mine]:
                found.append(f"{where}:{line}: {mine} imports {target}, which is in a higher layer ({theirs})")
            elif rank[theirs] == rank[mine]:
                found.append(f"{where}:{line}: {mine} imports {target}; {mine} and {theirs} are independent")
    return found


def test_imports_point_downwards():
    assert violations(Path(shardflow.__file__).parent) == []


def test_an_upward_import_is_reported(tmp_path):
    """The check fails on a deliberate bad import: ``parallel`` importing the ``runtime``, a
    function-local import, and two siblings of one layer importing each other."""
    src = tmp_path / "pkg"
    for name, text in {
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/driver.py": "from pkg.parallel import layout\n",
        "parallel/__init__.py": "",
        "parallel/layout.py": "import pkg.runtime.driver\n",
        "parallel/world.py": "def f():\n    from pkg.parallel import layout\n    import matplotlib\n",
        "plan/__init__.py": "from pkg.engine import x\n",
        "engine/__init__.py": "",
        "engine/x.py": "",
    }.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    layers = [["runtime"], ["engine", "plan"], ["parallel"]]
    assert violations(src, "pkg", layers) == [
        "pkg/parallel/layout.py:1: parallel imports pkg.runtime.driver, which is in a higher layer (runtime)",
        "pkg/parallel/world.py:2: imports pkg.parallel inside a function",
        "pkg/plan/__init__.py:1: plan imports pkg.engine; plan and engine are independent",
    ]
