"""The package's structure, as its contracts say: small units, no import cycles (function-local
imports included), config.py a leaf, the layout below parallel/, errors from bloomtrain.errors,
module state only where allow-listed, no test hooks in the package, no attribute flags on
Parameters, and one place where tensor, pipeline and ZeRO parallelism compose
(bloomtrain/parallel/parallelize.py). The figures come from tests/structure.py, which prints
them for any checkout."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import helpers
from tests.structure import (MUTABLE_GLOBALS, argument_parsing, calls_outside, cited_docs,
                             composition_sites, cycles, definitions, direct_collective_calls,
                             import_graph, imports_of_config_for_errors, mutable_globals,
                             parameter_flag_writes, private_imports, reads_of_test_variables, sizes,
                             imports_between_test_modules)

REPO = Path(__file__).resolve().parents[2]


def test_no_class_over_250_lines_and_no_function_over_60():
    s = sizes(REPO)
    assert [c for c in s["classes"] if c[1] > 250] == []
    assert [f for f in s["functions"] if f[1] > 60] == []


def test_no_import_cycle_and_config_is_a_leaf():
    graph = import_graph(REPO)
    assert cycles(graph) == []
    assert graph["bloomtrain.errors"] == set()
    assert graph["bloomtrain.config"] <= {"bloomtrain.errors"}
    # The input readers serve both the tokenizer trainer and the preprocessor.
    assert graph["bloomtrain.data.sources"] <= {"bloomtrain.errors", "bloomtrain.utils",
                                                "bloomtrain.data.indexed"}


def test_the_import_scan_counts_function_local_imports(tmp_path):
    pkg = tmp_path / "bloomtrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("from bloomtrain import b\n")
    (pkg / "b.py").write_text("def f():\n    from bloomtrain.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def g():\n    from .. import a\n")
    graph = import_graph(tmp_path)
    assert graph["bloomtrain.b"] == {"bloomtrain.sub.c"}
    assert cycles(graph) == [["bloomtrain.a", "bloomtrain.b", "bloomtrain.sub.c"]]


def test_no_module_imports_another_modules_private_names():
    """What two modules share is public in the one that owns it (import_config's bash reader
    took its lexer's _ASSIGNMENT and _arith; the tensor plan rng.py's fork helper)."""
    assert private_imports(REPO) == []


def test_the_private_import_scan_finds_them(tmp_path):
    pkg = tmp_path / "bloomtrain"
    pkg.mkdir()
    (pkg / "a.py").write_text("_X = 1\n__version__ = '1'\n")
    (pkg / "b.py").write_text("from bloomtrain.a import _X, __version__\n")
    (pkg / "c.py").write_text("def f():\n    from .a import _X\n")
    assert private_imports(tmp_path) == ["bloomtrain.b:1 _X", "bloomtrain.c:2 _X"]


def test_the_layout_imports_nothing_from_parallel():
    """Data flows config -> layout -> parallelize: the layout's rules (partitions, micro-batches,
    schedules) are what parallel/ reads, never the other way round."""
    graph = import_graph(REPO)
    assert sorted(m for m in graph["bloomtrain.layout"] if m.startswith("bloomtrain.parallel")) \
        == []


def test_the_optimizer_maths_imports_nothing_from_parallel():
    """bloomtrain.optim is AdamW, the clip, the loss scale and the LR schedule on tensors and
    numbers; the optimizer that steps the ZeRO engine's buffers lives beside them in
    parallel/zero/ (Megatron-Core's DistributedOptimizer sits beside its buffers too)."""
    graph = import_graph(REPO)
    optim = sorted(m for m in graph if m == "bloomtrain.optim" or
                   m.startswith("bloomtrain.optim."))
    assert len(optim) >= 4
    assert {m: sorted(t for t in graph[m] if t.startswith("bloomtrain.parallel"))
            for m in optim} == {m: [] for m in optim}


# Things with one place, by name: the planner, formula() and the engine's report read the same
# model of a rank's ZeRO state bytes; load_model, serve and eval the same sharded loader, built on
# the Config-free core of parallelize; every model the same cut of the ALiBi slopes; eval and
# serve's tp workers the same command channel (rank 0 drives, the others follow).
ONE_PLACE = {"state_bytes": "bloomtrain.parallel.zero.memory",
             "load_sharded": "bloomtrain.checkpoint.load",
             "shard_model": "bloomtrain.parallel.parallelize",
             "local_alibi_slopes": "bloomtrain.model.bloom",
             "Commands": "bloomtrain.parallel.commands"}


@pytest.mark.parametrize("name", sorted(ONE_PLACE))
def test_one_definition_of_each_shared_model(name):
    assert [d.split(":")[0] for d in definitions(REPO, name)] == [ONE_PLACE[name]]


def test_the_alibi_slopes_are_cut_in_one_function():
    """No module cuts the slopes per tp rank itself (they were cut in four places)."""
    cuts = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "bloomtrain").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if "slopes" in line and ".chunk(" in line]
    assert [c.split(":")[0] for c in cuts] == ["bloomtrain/model/bloom.py"], cuts


def test_the_definition_scan_finds_a_second_one(tmp_path):
    pkg = tmp_path / "bloomtrain"
    (pkg / "planner").mkdir(parents=True)
    (pkg / "planner" / "__init__.py").write_text("")
    (pkg / "memory.py").write_text("def state_bytes(rules):\n    return {}\n")
    (pkg / "planner" / "model.py").write_text(
        "class Model:\n    def state_bytes(self):\n        return 0\n")
    assert definitions(tmp_path, "state_bytes") == ["bloomtrain.memory:1",
                                                    "bloomtrain.planner.model:2"]


def test_only_cli_modules_parse_arguments():
    """Every command's parser lives in a cli module next to its package (data/cli.py,
    checkpoint/cli.py, report/cli.py, bloomtrain/cli.py for demo and generate, ...); library
    modules take arguments, as Python callers give them."""
    assert argument_parsing(REPO) == []


def test_the_parsing_scan_finds_a_parser_in_library_code(tmp_path):
    pkg = tmp_path / "bloomtrain" / "data"
    pkg.mkdir(parents=True)
    (pkg / "cli.py").write_text("def register(sub):\n    sub.add_parser('x')\n")
    (pkg / "tokenizer.py").write_text("def register(sub):\n    p = sub.add_parser('t')\n"
                                      "    p.add_argument('--n')\n")
    assert argument_parsing(tmp_path) == ["bloomtrain.data.tokenizer:2",
                                          "bloomtrain.data.tokenizer:3"]


# Test folders that are not a package of bloomtrain (DESIGN.md's layout; README, Tests: where a
# test for X lives): whole jobs (system/: end to end, chaos, partitions, the README's blocks),
# suites that cut across everything (robustness/: fuzzing, untrusted files, a full disk), and the
# tests of the test infrastructure and the repository's rules (infra/).
TEST_FOLDERS_BEYOND_THE_PACKAGE = {"system", "robustness", "infra"}


def test_tests_mirror_the_package():
    """Every test package under tests/ is a bloomtrain package's tests, or one of the three
    folders beyond it; every test module sits in one or is a top-level module's (tests/test_X.py
    for bloomtrain/X.py)."""
    tests, pkg = REPO / "tests", REPO / "bloomtrain"
    folders = {p.name for p in tests.iterdir() if (p / "__init__.py").is_file()}
    packages = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    assert folders - TEST_FOLDERS_BEYOND_THE_PACKAGE <= packages, folders - packages
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    assert top <= {p.stem for p in pkg.glob("*.py")}, top


def test_no_test_module_imports_another():
    """A test module takes what it shares from support modules (tests/helpers.py, reference.py,
    serving.py, pipeline_cases.py, layouts.py, domains.py, zero_runs.py, runs.py,
    hf_reference.py) and fixtures from conftest.py, never from another test module: importing
    one would also collect its tests twice and tie two suites' fixtures together."""
    found = imports_between_test_modules(REPO)
    assert not found, f"move what these share into a support module or conftest.py: {found}"


def test_the_test_import_scan_finds_them(tmp_path):
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("from tests.test_b import make\n")
    (tmp_path / "tests" / "data" / "test_c.py").write_text(
        "from tests import test_a as a, helpers\nfrom tests.helpers import make_cfg\n")
    assert imports_between_test_modules(tmp_path) == {("tests.test_a", "tests.test_b"),
                                             ("tests.data.test_c", "tests.test_a")}


def test_errors_come_from_the_errors_module():
    """UserError lives in bloomtrain.errors, a leaf; the config is imported for its sections and
    domains only (the top-level CLI may take both from it)."""
    assert [h for h in imports_of_config_for_errors(REPO) if not h.startswith("bloomtrain.cli:")] \
        == []


def test_one_place_composes_tensor_pipeline_and_zero():
    assert composition_sites(REPO) == {
        "bloomtrain/parallel/parallelize.py": ["ZeroEngine", "apply_tensor_parallel",
                                               "build_pipeline_chunks"]}
    for builder in ("apply_tensor_parallel", "build_pipeline_chunks", "ZeroEngine"):
        assert calls_outside(REPO, builder, "bloomtrain/parallel/parallelize.py") == [], builder


def test_every_collective_goes_through_comm():
    """The package, the tests and the benches communicate only through parallel/comm.py, whose
    wrappers check each tensor's device against the group's backend (checkpoint commit and
    barriers included)."""
    assert direct_collective_calls(REPO) == []


def test_the_collective_scan_finds_direct_calls(tmp_path):
    (tmp_path / "bloomtrain" / "train").mkdir(parents=True)
    (tmp_path / "bloomtrain" / "train" / "loop.py").write_text(
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed import all_reduce as ar\n"
        "dist.barrier()\ntorch.distributed.broadcast(t, 0)\nar(t)\n"
        "dist.P2POp(dist.isend, t, 1)\ndist.get_rank()\n")
    for folder in ("tests", "bench"):
        (tmp_path / folder).mkdir()
    assert direct_collective_calls(tmp_path) == [
        "bloomtrain/train/loop.py:4 dist.barrier", "bloomtrain/train/loop.py:5 "
        "torch.distributed.broadcast", "bloomtrain/train/loop.py:6 ar"]


def test_no_attribute_flags_on_parameters():
    assert parameter_flag_writes(REPO) == []


@pytest.mark.parametrize("parallel", [
    {"tp": 2, "pp": 2, "zero_stage": 1, "sequence_parallel": True},
    {"pp": 2, "zero_stage": 3, "pp_schedule": "interleaved", "num_virtual_stages": 2,
     "pp_partition": "uniform"},
])
def test_parameters_carry_nothing_but_their_values(parallel):
    """Whatever the layout, a rank's Parameters have no instance attributes: what they are is
    in the specs, held beside them."""
    from bloomtrain.layout import ParallelLayout
    from bloomtrain.topology import Topology
    cfg = helpers.config(parallel=parallel)
    layout = ParallelLayout.from_config(cfg.parallel, 8)
    for rank in (0, 7):
        parts = helpers.build(cfg, Topology.describe_rank(layout, rank), device="meta")
        named = parts.named_parameters()
        assert named and all(vars(p) == {} for _, p in named)
        assert {n for n, _ in named} == set(parts.specs)
        assert all(isinstance(p, torch.nn.Parameter) for _, p in named)


def test_every_package_directory_is_a_package():
    # setuptools' find_packages ships only directories with an __init__.py: a non-editable
    # `pip install` would lose any other.
    missing = [str(d.relative_to(REPO)) for d in (REPO / "bloomtrain").rglob("*")
               if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()]
    assert missing == []


def test_the_project_cites_only_files_it_contains():
    """The facts the code relies on (BLOOM's shapes and logged figures, the formulas) are in
    docs/, and every docs/ file cited exists."""
    cited = cited_docs(REPO)
    assert {c: where for c, where in cited.items() if not (REPO / c).exists()} == {}
    assert "docs/bloom_facts.md" in cited


def test_each_choice_is_declared_once_and_its_owners_cover_it():
    """The choices of a config key are its Literal type in bloomtrain.config; the tables that
    implement them are keyed by exactly those names."""
    import typing

    from bloomtrain import config
    from bloomtrain.model.attention import ATTENTION_IMPLS
    from bloomtrain.parallel.pipeline.schedules import SCHEDULES
    from bloomtrain.parallel.zero.stages import STAGES
    from bloomtrain.devices import DTYPE_NAMES, torch_dtype
    assert set(SCHEDULES) == set(typing.get_args(config.PipelineSchedule))
    assert set(STAGES) == set(typing.get_args(config.ZeroStage))
    assert set(ATTENTION_IMPLS) | {"auto"} == set(typing.get_args(config.Attention))
    assert DTYPE_NAMES == typing.get_args(config.Precision)
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.bfloat16, torch.float16, torch.float32]


def test_no_module_state_outside_the_allow_list():
    """Module globals (and class attributes) that change after import are state every caller
    shares; the package keeps only those named, with why, in tests/structure.py."""
    assert mutable_globals(REPO) == sorted(MUTABLE_GLOBALS)
    assert all(len(reason) > 40 for reason in MUTABLE_GLOBALS.values())


def test_the_state_scan_finds_module_state(tmp_path):
    (tmp_path / "bloomtrain").mkdir()
    (tmp_path / "bloomtrain" / "m.py").write_text(
        "import dataclasses\n"
        "TABLE = {'a': 1}\n"                   # a table, read only: not state
        "BUILT = {}\n"
        "for k in 'ab':\n    BUILT[k] = k\n"  # built at import: not state
        "CACHE = {}\n"
        "COUNT = 0\n"
        "class Counter:\n    n = 0\n"
        "    @classmethod\n    def start(cls):\n        cls.n += 1\n"
        "@dataclasses.dataclass(frozen=True)\nclass Point:\n    x: int = 0\n"
        "ORIGIN = Point()\n"                   # a frozen value: not state
        "SHARED = Counter()\n"
        "def f(key):\n    global COUNT\n    COUNT = 1\n    CACHE.setdefault(key, 1)\n")
    assert mutable_globals(tmp_path) == ["bloomtrain.m.CACHE", "bloomtrain.m.COUNT",
                                         "bloomtrain.m.Counter.n", "bloomtrain.m.SHARED"]


def test_no_test_variables_read_by_the_package(tmp_path):
    """Test-only behaviour (tests/faults.py) is injected by the tests, not read by the package."""
    assert reads_of_test_variables(REPO) == []
    (tmp_path / "bloomtrain").mkdir()
    (tmp_path / "bloomtrain" / "m.py").write_text(
        "import os\nSLEEP = os.environ.get('BLOOMTRAIN_TEST_SLEEP')\n")
    assert reads_of_test_variables(tmp_path) == ["bloomtrain/m.py:2"]
