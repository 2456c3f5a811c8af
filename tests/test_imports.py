"""The package's modules import each other without cycles (top-level
imports, as Python runs them; a module's own parent packages excluded, and
imports inside functions listed: each must keep an optional dependency
optional or a module light)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxtp"
# (module, imported) pairs a function may import lazily, and why
LAZY = {("jaxtp.data.tokenizer", "tokenizers"): "optional [data]",
        ("jaxtp.hf", "safetensors.numpy"): "optional [hf]",
        ("jaxtp.train.metrics", "tensorboardX"): "optional [tensorboard]",
        ("jaxtp.plot", "matplotlib"): "optional [plot]",
        ("jaxtp.plot", "matplotlib.pyplot"): "optional [plot], after choosing its backend",
        ("jaxtp.analysis.picture", "matplotlib.patches"): "optional [plot]",
        ("jaxtp.hlo", "jax"): "the HLO text reader needs no JAX",
        ("jaxtp.parallel.distributed", "jax._src"): "a private API, tried",
        ("jaxtp.parallel.vjp_split", "jax._src.interpreters.partial_eval"):
            "a private API, tried",
        ("jaxtp.train.orbax_errors", "orbax.checkpoint._src.serialization"):
            "a private API, tried",
        ("jaxtp.parallel.targets", "jax.experimental"): "after the CUDA plugin's setting",
        ("jaxtp.bench.torch_peer", "torch"): "never a dependency: the bench's optional peer"}


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(modules: dict[str, Path]):
    """{module: {imported module}} from the top-level imports (not under
    TYPE_CHECKING), and the function-level imports as (module, imported)."""
    edges, lazy = {}, set()
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        out = edges.setdefault(name, set())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _resolve(name, is_package, node)
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                           for a in node.names]
            else:
                targets = [node.module] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names]
            if node.col_offset == 0:
                out.update(t for t in targets if t in modules)
            elif not any(isinstance(p, ast.If) for p in _parents(tree, node)):
                lazy.update((name, t) for t in targets)
    return edges, lazy


def _parents(tree, node):
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            if child is node:
                yield parent
                yield from _parents(tree, parent)


def test_no_module_imports_itself_through_another():
    edges, _ = _edges(_modules())
    for name in edges:  # a package's __init__ importing its submodules is not a cycle
        edges[name] = {t for t in edges[name] if not name.startswith(t + ".")}
    done, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(edges):
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_functions_import_only_what_must_stay_lazy():
    _, lazy = _edges(_modules())
    unexplained = sorted(lazy - set(LAZY))
    assert not unexplained, unexplained


def test_no_two_test_files_share_a_name():
    """pytest imports each test file by its base name (the test folders are
    not packages), so two files of one name fail collection on a clean
    checkout: `import file mismatch`."""
    seen: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {n: ps for n, ps in seen.items() if len(ps) > 1}
