"""Static facts about a bloomtrain source tree: class and function sizes, the import graph
between its modules (function-local imports included: they fail at call time just the same when
two modules need each other), and where tensor, pipeline and ZeRO parallelism are composed.

    python tests/structure.py [REPO_ROOT]     # prints the figures, then one JSON line

tests/infra/test_structure.py asserts on the same functions.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

# The calls that apply one parallelism each; composing them is parallelize()'s job alone.
COMPOSERS = ("apply_tensor_parallel", "build_pipeline_chunks", "ZeroEngine",
             "MixedPrecisionOptimizer")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(repo: Path) -> dict[str, Path]:
    return {_module_name(p, repo): p for p in sorted((repo / "bloomtrain").rglob("*.py"))}


def _trees(files) -> dict:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}


def sizes(repo: Path) -> dict[str, list[tuple[str, int]]]:
    """Every class and function (nested ones too) with its length in lines, largest first."""
    out = {"classes": [], "functions": []}
    for name, tree in _trees(modules(repo)).items():
        for node in ast.walk(tree):
            kind = ("classes" if isinstance(node, ast.ClassDef) else
                    "functions" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else None)
            if kind:
                out[kind].append((f"{name}.{node.name}", node.end_lineno - node.lineno + 1))
    return {k: sorted(v, key=lambda x: -x[1]) for k, v in out.items()}


def _resolve(importer: str, node, known: set[str], is_package: bool) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:  # relative: from the importer's package
        base = importer.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = set()
    for a in node.names:
        if f"{module}.{a.name}" in known:
            out.add(f"{module}.{a.name}")  # a submodule
        elif module in known:
            out.add(module)
    return out


def import_graph(repo: Path) -> dict[str, set[str]]:
    files = modules(repo)
    known = set(files)
    graph = {}
    for name, tree in _trees(files).items():
        is_package = files[name].name == "__init__.py"
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets |= _resolve(name, node, known, is_package)
        graph[name] = targets - {name}
    return graph


def private_imports(repo: Path) -> list[str]:
    """`from bloomtrain.x import _name`: one module reaching for another's private name
    (function-local imports included). What two modules share is public in the one that owns
    it; a dunder (`__version__`) is not private."""
    hits = []
    for name, path in modules(repo).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not (node.level or (node.module or "").startswith("bloomtrain")):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    hits.append(f"{name}:{node.lineno} {a.name}")
    return hits


def definitions(repo: Path, name: str) -> list[str]:
    """Every function or class called `name` in the package, nested ones too: a thing that
    must have one place (the ZeRO state bytes, ...) is found by its name."""
    return [f"{module}:{node.lineno}" for module, tree in _trees(modules(repo)).items()
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.name == name]


PARSING = re.compile(r"\b(ArgumentParser\(|add_argument\(|add_parser\(|add_subparsers\(|"
                     r"parse_args\(|parse_known_args\()")


def argument_parsing(repo: Path) -> list[str]:
    """Lines that build or run an argument parser outside the package's cli modules (a module
    named `cli`): library code takes arguments, commands parse them."""
    hits = []
    for name, path in modules(repo).items():
        if name.split(".")[-1] == "cli":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PARSING.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{name}:{i}")
    return hits


def imports_between_test_modules(repo: Path) -> set[tuple[str, str]]:
    """(test module, test module it imports): a test module (tests/**/test_*.py) taking names
    from another instead of from a support module or a conftest fixture."""
    out = set()
    for path in sorted((repo / "tests").rglob("test_*.py")):
        me = _module_name(path, repo)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = ([f"{node.module}.{a.name}" for a in node.names]
                         if node.module == "tests" else [node.module])
                out |= {(me, n) for n in names if n.split(".")[-1].startswith("test_")}
            elif isinstance(node, ast.Import):
                out |= {(me, a.name) for a in node.names
                        if a.name.startswith("tests.") and
                        a.name.split(".")[-1].startswith("test_")}
    return out


ERROR_NAMES = {"UserError"}


def imports_of_config_for_errors(repo: Path) -> list[str]:
    """Modules that import bloomtrain.config only to raise its errors (which live in the leaf
    bloomtrain.errors), function-local imports included."""
    hits = []
    for name, path in modules(repo).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.ImportFrom) and node.module == "bloomtrain.config"
                    and {a.name for a in node.names} <= ERROR_NAMES):
                hits.append(f"{name}:{node.lineno}")
    return hits


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def composition_sites(repo: Path) -> dict[str, list[str]]:
    """Files (package, tests, benches) that call more than one of the per-parallelism builders."""
    out = {}
    for folder in ("bloomtrain", "tests", "bench"):
        for path in sorted((repo / folder).rglob("*.py")):
            called = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                    if name in COMPOSERS:
                        called.add(name)
            if len(called) > 1:
                out[str(path.relative_to(repo))] = sorted(called)
    return out


def calls_outside(repo: Path, name: str, allowed: str) -> list[str]:
    """Package files other than `allowed` that call `name`."""
    hits = []
    for path in sorted((repo / "bloomtrain").rglob("*.py")):
        rel = str(path.relative_to(repo))
        if rel == allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == name:
                    hits.append(rel)
                    break
    return hits


# torch.distributed's communicating calls: only bloomtrain/parallel/comm.py makes them, after its
# device check (a CPU tensor on an NCCL group fails on a cluster, never on a laptop).
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "broadcast", "broadcast_object_list", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list",
}
COMM_MODULE = "bloomtrain/parallel/comm.py"


def _dist_aliases(tree) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed, and collectives imported from it by name."""
    aliases, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif node.module == "torch.distributed":
                direct |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    return aliases, direct


def direct_collective_calls(repo: Path) -> list[str]:
    """Calls of torch.distributed collectives or p2p outside comm.py, in the package, the tests
    and the benches: `dist.all_reduce(...)`, `torch.distributed.barrier(...)`, or a collective
    imported by name. tests/fixtures/ is left out: its scripts run other systems (DeepSpeed) to
    write the files bloomtrain is checked against, and must not use bloomtrain's code."""
    hits = []
    for folder in ("bloomtrain", "tests", "bench"):
        for path in sorted((repo / folder).rglob("*.py")):
            rel = str(path.relative_to(repo))
            if rel == COMM_MODULE or rel.startswith("tests/fixtures/"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            aliases, direct = _dist_aliases(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                if isinstance(f, ast.Name) and f.id in direct:
                    hits.append(f"{rel}:{node.lineno} {f.id}")
                elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and (
                        (isinstance(f.value, ast.Name) and f.value.id in aliases)
                        or ast.unparse(f.value) == "torch.distributed"):
                    hits.append(f"{rel}:{node.lineno} {ast.unparse(f)}")
    return hits


def parameter_flag_writes(repo: Path) -> list[str]:
    """Places in the package that set attributes on objects named like parameters
    (`p.x = ...`, `param.x = ...`, `setattr(p, ...)`), other than `.data` and `.grad`."""
    hits = []
    names = {"p", "param", "parameter", "tied", "copy", "w", "weight"}
    for name, path in modules(repo).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id in names and t.attr not in ("data", "grad")):
                    hits.append(f"{name}:{node.lineno} {t.value.id}.{t.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in names):
                hits.append(f"{name}:{node.lineno} setattr({node.args[0].id}, ...)")
    return hits


MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard"}


def _frozen_classes(trees) -> tuple[set[str], set[str]]:
    """(classes of the package, those whose instances cannot change: frozen dataclasses,
    NamedTuples, Enums)."""
    classes, frozen = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            classes.add(node.name)
            deco = [ast.unparse(d) for d in node.decorator_list]
            bases = [ast.unparse(b) for b in node.bases]
            if any("frozen=True" in d for d in deco) or any(
                    b in ("NamedTuple", "Enum", "enum.Enum", "Exception") or b.endswith("Error")
                    for b in bases):
                frozen.add(node.name)
    return classes, frozen


def _mutated_names(tree) -> set[str]:
    """Names that the module's functions rebind (`global X`) or change in place (X[k] =,
    del X[k], X.attr =, X += ..., X.append(...) and the other mutators), and class attributes
    they set through the class (`cls.X =`, `Klass.X =`) as `Klass.X`. Statements at the module's
    top level build a table at import; they are not counted."""
    out, classes = set(), {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for node in (n for f in functions for n in ast.walk(f)):
        if isinstance(node, ast.Global):
            out.update(node.names)
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            if isinstance(t, ast.AugAssign):
                t = t.target
            if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                owner = t.value.id
                if isinstance(t, ast.Attribute) and (owner == "cls" or owner in classes):
                    out.add(f"{owner}.{t.attr}")
                else:
                    out.add(owner)
            elif isinstance(node, ast.AugAssign) and isinstance(t, ast.Name):
                out.add(t.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
            out.add(node.func.value.id)
    return out


def mutable_globals(repo: Path) -> list[str]:
    """Module-level state of the package: module globals (and class attributes) that the module
    changes after import, and module globals holding an instance of a package class that can
    change. Read-only tables (dicts and tuples written once) are not state."""
    trees = _trees(modules(repo))
    classes, frozen = _frozen_classes(trees)
    found = []
    for name, tree in trees.items():
        mutated = _mutated_names(tree)
        cls_of = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = (item.targets if isinstance(item, ast.Assign) else
                               [item.target] if isinstance(item, ast.AnnAssign) else [])
                    for t in targets:
                        if isinstance(t, ast.Name):
                            cls_of[f"{node.name}.{t.id}"] = node.name
        for key, klass in cls_of.items():
            attr = key.split(".")[1]
            if key in mutated or f"cls.{attr}" in mutated:
                found.append(f"{name}.{key}")
        for node in tree.body:
            for stmt in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
                    continue
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                call = stmt.value.func if isinstance(stmt.value, ast.Call) else None
                instance = (isinstance(call, ast.Name) and call.id in classes
                            and call.id not in frozen)
                for t in targets:
                    if isinstance(t, ast.Name) and (t.id in mutated or instance):
                        found.append(f"{name}.{t.id}")
    return sorted(set(found))


# The module-level state the package keeps, each with why it cannot be passed explicitly.
MUTABLE_GLOBALS = {
    "bloomtrain.parallel.comm.STATS":
        "communication accounting, never what is computed or sent: the autograd functions' "
        "backward passes, which no argument reaches, count through it",
    "bloomtrain.parallel.comm.INFLIGHT":
        "the op each thread is blocked in, written by every collective wrapper (autograd "
        "backward passes included) and read by the hang watchdog's thread",
    "bloomtrain.parallel.comm._GROUP_DEVICES":
        "the device types each process group serves, read from its backend once (it never "
        "changes); comm.keeps_guard drops Dynamo's guards on it (train.compile)",
    "bloomtrain.train.runlock._HELD":
        "the run directories this process has flock'ed: a lock is per open file, so a second "
        "trainer of the same process (a notebook's rerun, a test's resume) must share the first "
        "one's descriptor rather than be refused by it",
    "bloomtrain.train.watchdog.Watchdog._active":
        "one hang watchdog per process: a second trainer's start stops the first one's thread",
    "bloomtrain.launch._ARRIVALS":
        "torch's rendezvous registry calls our handler factory with its own arguments only: the "
        "store it creates is kept here for the launcher to say which nodes never arrived",
    "bloomtrain.data.preprocess._worker_tokenizer":
        "a preprocessing pool worker's tokenizer, set by the pool's initializer, the one place "
        "multiprocessing gives a worker for state of its own",
}


def reads_of_test_variables(repo: Path) -> list[str]:
    """Places in the package that name a BLOOMTRAIN_TEST_ variable: test-only behaviour belongs to
    the tests, injected from there (tests/faults.py)."""
    hits = []
    for path in sorted((repo / "bloomtrain").rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "BLOOMTRAIN_TEST_" in line:
                hits.append(f"{path.relative_to(repo)}:{i}")
    return hits


def cited_docs(repo: Path) -> dict[str, list[str]]:
    """The `docs/` files that the package, the tests and the benches cite, with where."""
    found: dict[str, list[str]] = {}
    for folder in ("bloomtrain", "tests", "bench"):
        for path in sorted((repo / folder).rglob("*.py")):
            rel = str(path.relative_to(repo))
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for m in re.finditer(r"(?<![\w/])docs/[\w-]+(?:/[\w-]+)*\.[a-z]+", line):
                    found.setdefault(m.group(0), []).append(f"{rel}:{i}")
    return found


def summary(repo: Path) -> dict:
    s = sizes(repo)
    graph = import_graph(repo)
    return {
        "largest_class": s["classes"][0],
        "largest_function": s["functions"][0],
        "classes_over_300": [c for c in s["classes"] if c[1] > 300],
        "functions_over_80": [f for f in s["functions"] if f[1] > 80],
        "import_cycles": cycles(graph),
        "config_imports": sorted(graph.get("bloomtrain.config", ())),
        "composition_sites": composition_sites(repo),
        "parameter_attribute_writes": parameter_flag_writes(repo),
        "direct_collective_calls": direct_collective_calls(repo),
        "mutable_globals": mutable_globals(repo),
        "reads_of_test_variables": reads_of_test_variables(repo),
        "private_imports": private_imports(repo),
    }


if __name__ == "__main__":
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    result = summary(repo)
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))
