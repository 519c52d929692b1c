import ast
from pathlib import Path

import bloomtrain

ROOT = Path(bloomtrain.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """bloomtrain module -> bloomtrain modules it imports, counting imports inside functions:
    a function-local import still fails at call time when the two modules need each other."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c not in (name, "bloomtrain"))
        graph[name] = targets
    return graph


def test_data_modules_have_no_import_cycle():
    graph = _import_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), list(graph[start])
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
        return False

    cyclic = [m for m in graph if m.startswith("bloomtrain.data") and reaches(m, m)]
    assert cyclic == []
    assert graph["bloomtrain.data.sources"] <= {"bloomtrain.utils", "bloomtrain.data.indexed"}
