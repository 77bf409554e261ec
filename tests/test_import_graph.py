"""fastgrpo's imports, read from the source (lazy imports inside functions included): no cycle, and one direction
cli -> check -> bench -> train, integrations -> loss, sampling -> kernels and the small shared modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "fastgrpo"
# Each module's layer: a module may import from its own layer or a lower one, never a higher one.
LAYERS = [
    ("fastgrpo.cli", "fastgrpo.__main__"),
    ("fastgrpo.check",),
    ("fastgrpo.bench",),
    ("fastgrpo.train", "fastgrpo.integrations"),
    ("fastgrpo.loss", "fastgrpo.grpo_head", "fastgrpo.chunked", "fastgrpo.reference", "fastgrpo.sampling"),
    ("fastgrpo.kernels", "fastgrpo.loss_config", "fastgrpo.models", "fastgrpo.memory", "fastgrpo.sizes",
     "fastgrpo.routing"),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the fastgrpo modules it imports anywhere in its source (`from fastgrpo.train import checkpoint`
    names the module fastgrpo.train.checkpoint)."""
    mods = modules()

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fastgrpo"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in mods else owner(node.module))
            elif isinstance(node, ast.Import):
                edges |= {owner(alias.name) for alias in node.names if alias.name.startswith("fastgrpo")}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    for depth, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return depth
    raise AssertionError(f"{module} has no layer in LAYERS: add it")


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_one_way():
    graph = import_graph()
    upward = [f"{a} -> {b}" for a, edges in graph.items() if a != "fastgrpo" for b in edges
              if b != "fastgrpo" and layer(b) < layer(a)]
    assert upward == []


def test_the_training_path_never_imports_the_benchmarks():
    graph = import_graph()
    reached, todo = set(), ["fastgrpo.train.cli", "fastgrpo.train.trainer"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert not {m for m in reached if m.startswith("fastgrpo.bench")}
