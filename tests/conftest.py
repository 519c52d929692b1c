"""Shared pytest fixtures and options: `--device`, the test tiers, the CI rules for skips and
missing dependencies, the fuzzers' profiles and the session's rank pool.

`--device`: `python -m pytest -m device --device cuda tests/` runs the single-process tests that
take the `device` fixture (models, optimizer, generation, HF parity) on a GPU. A test that takes
the fixture is marked `device` automatically, so `-m device` selects exactly the tests that honour
the option; the other tests (multi-rank gloo, data, CLI) stay on the CPU whatever it says.
`--device cuda` on a machine without CUDA is a usage error, not a skip: a run asked to check the
GPU that skipped every test would pass while checking nothing. A test marked `cuda_only` is
skipped unless the device is CUDA.

Tiers: `python -m pytest -q -m "not slow" tests` is the fast tier (every module keeps real tests
in it, multi-rank ones at world 2); `python -m pytest -q tests` is the full suite CI runs. The
hypothesis fuzzers run the `fast` profile (50 random examples) when slow tests are deselected and
the `full` one (500, derandomized: CI sees the same cases every run) otherwise;
`--hypothesis-profile NAME` picks one explicitly.

CI (`BLOOMTRAIN_CI=1`, which .ci/run sets, or `CI=true`): a test dependency that does not import
is an error, not a skip, and the run fails when any test is skipped for a reason not on
`CI_ALLOWED_SKIPS`. Every run lists its skips, with their reasons, at the end.
"""
from __future__ import annotations

import fnmatch
import os
import re
import signal
import warnings
from pathlib import Path

import pytest
import torch

from tests import dist as rank_dist

# The skips CI accepts, by marker: name -> why such a test cannot run there. Not the network
# namespaces of tests/netns.py (multi-node and partition tests): CI runs as root on a machine
# that has them, so their skip fails CI like any other.
CI_ALLOWED_SKIPS = {
    "cuda_only": "needs a CUDA device (FlexAttention's backward, the compiled flex path); "
                 "bench/gpu.sh runs them with -m device --device cuda",
}
MODULES_KEY = pytest.StashKey[set]()

# The slow tier: node ids (fnmatch patterns) left out of the fast tier, -m "not slow". Each module
# keeps real tests in the fast tier, multi-rank ones at world 2; what goes here is the rest of a
# parametrized matrix, worlds above 2, and whole jobs launched as processes. A pattern that stops
# matching a collected test is an error in CI (a warning elsewhere), so that a renamed test cannot
# drift into the fast tier unseen.
SLOW: list[str] = [
    # whole jobs launched as processes: the launcher, kills, restarts, nodes, CLIs
    "tests/system/test_chaos.py::*",
    "tests/system/test_restart.py::*",
    "tests/infra/test_gpu_script.py::test_every_section_ran_and_left_numbers",
    "tests/system/test_lost_rank.py::test_a_rank_killed_mid_step_ends_the_job_cleanly_and_names_it",
    "tests/system/test_multinode.py::test_two_nodes_on_one_machine_match_one_process",
    "tests/system/test_multinode.py::test_a_node_that_never_arrives_fails_the_other_with_a_clear_message",
    # nodes in network namespaces (the fast tier keeps the refused loopback advertisement)
    "tests/system/test_partition.py::test_two_nodes_train_as_one_node_and_a_slow_one_is_named",
    "tests/system/test_partition.py::test_a_short_cut_heals_by_itself_bit_for_bit",
    "tests/system/test_partition.py::test_a_flapping_link_does_no_more_harm_than_one_cut",
    "tests/system/test_partition.py::test_a_long_cut_is_detected_on_every_node_and_stops_them*",
    "tests/system/test_partition.py::test_after_a_long_cut_the_job_reforms_and_ends_bit_for_bit",
    "tests/system/test_partition.py::test_a_cut_during_a_save_is_never_read_as_a_checkpoint",
    "tests/train/test_watchdog.py::test_a_rank_stuck_in_a_step_ends_the_job_with_every_ranks_report",
    "tests/system/test_train_parallel.py::test_cli_nproc4_pp4_1f1b_matches_nproc1",
    "tests/checkpoint/test_checkpoint.py::test_preemption_signal_saves_and_exits_cleanly[[]SIGUSR1[]]",
    "tests/checkpoint/test_checkpoint.py::test_kill_switch_saves_and_exits",
    "tests/checkpoint/test_checkpoint.py::test_a_second_ctrl_c_quits_at_once_without_a_partial_checkpoint",
    "tests/planner/test_plan.py::test_cli_json_and_table",
    "tests/serve/test_serve.py::test_cli_tp2_equals_tp1_and_sigterm_drains",
    "tests/serve/test_serve.py::test_cli_front_end_failures_end_the_server",
    # more than 2 ranks (the fast tier keeps these modules' world-2 cases)
    "tests/parallel/test_zero.py::*[[]dp4*",
    "tests/parallel/test_zero.py::test_tensor_and_pipeline_composition_and_norm_counting",
    "tests/parallel/test_tensor_parallel.py::*[[]tp4*",
    "tests/parallel/test_pipeline.py::*[[]world4[]]",
    "tests/parallel/test_pipeline.py::*[[]world8[]]",
    "tests/parallel/test_pipeline_zb.py::*[[]world4[]]",
    "tests/parallel/test_pipeline_zb.py::*[[]world8[]]",
    "tests/parallel/test_pipeline_zb.py::test_trainer_matches_plain_loop[[]4-*",
    "tests/parallel/test_pipeline_zb.py::test_trainer_matches_plain_loop[[]8-*",
    "tests/parallel/test_pipeline_zb.py::test_first_stage_holds_exactly_1f1b_memory",
    "tests/checkpoint/test_checkpoint.py::test_reshard_between_parallel_layouts*",
    "tests/checkpoint/test_checkpoint.py::test_reshard_from_single_process[[]1.1.1->2.2.2z1[]]",
    "tests/checkpoint/test_checkpoint.py::test_reshard_from_single_process[[]1.1.1->tp2.dp2.z3[]]",
    "tests/system/test_resume.py::test_crash_and_resume_is_bitwise_equal[[]tp2.pp2.dp2-z3[]]",
    "tests/system/test_train_parallel.py::test_3d_tp2_pp2_dp2_matches_single_process*",
    "tests/system/test_train_parallel.py::test_other_compositions_match_single_process*",
    "tests/system/test_train_reference.py::test_layout_matches_plain_loop[[]4-*",
    "tests/system/test_train_reference.py::test_layout_matches_plain_loop[[]8-*",
    "tests/planner/test_plan.py::test_comm_bytes_per_step_equal_the_comm_counters",
    "tests/train/test_monitors.py::test_straggler_named_only_when_slowed",
    "tests/train/test_monitors.py::test_memory_peak_per_interval_and_rank",
    "tests/train/test_monitors.py::test_grad_stats_dp4_zero3_match_one_process",
    "tests/train/test_monitors.py::test_grad_stats_tp2_pp2_match_one_process",
    "tests/parallel/test_compress.py::test_int8_reduction_bytes_on_a_training_step*",
    "tests/parallel/test_compress.py::test_int8_weight_gather_bytes_zero3",
    "tests/parallel/test_compress.py::test_int8_reduction_composes[[]tp2-sp.dp2-z1[]]",
    "tests/parallel/test_compress.py::test_int8_reduction_composes[[]pp2.dp2-z2[]]",
    "tests/parallel/test_compress.py::test_secondary_shard_is_bitwise_and_keeps_backward_gathers_in_the_node*",
    "tests/parallel/test_compress.py::test_secondary_shard_with_tensor_parallelism",
    "tests/parallel/test_compress.py::test_secondary_shard_with_pipeline_parallelism",
    "tests/parallel/test_compress.py::test_reshard_with_error_feedback_follows_the_rule",
    # the rest of a matrix whose world-2 cases stay fast
    "tests/parallel/test_compress.py::test_resume_with_error_feedback_is_bitwise[[]2[]]",
    "tests/system/test_resume.py::test_crash_and_resume_is_bitwise_equal[[]tp2-sp[]]",
    "tests/parallel/test_compile.py::test_compiled_matches_eager_through_the_trainer*",
    # child pytest runs (~4 s each): the fast tier keeps a missing transformers and hypothesis in
    # CI and an unlisted skip
    "tests/infra/test_ci_rules.py::test_a_missing_test_dependency_fails_ci[[]aiohttp[]]",
    "tests/infra/test_ci_rules.py::test_outside_ci_a_missing_dependency_skips_its_modules_and_lists_them",
    "tests/infra/test_ci_rules.py::test_ci_fails_on_a_skip_not_on_the_allow_list[[]cuda-only-skip[]]",
]
# Test modules whose only tests are whole multi-process jobs with kills (~100 s each on a loaded
# 2-core machine): the fast tier reaches the same code (the launcher, SIGKILL and a bitwise
# resume) through test_lost_rank, test_resume and test_train_parallel's CLI test.
FAST_EXEMPT = {"tests/system/test_chaos.py", "tests/system/test_restart.py"}


def in_ci() -> bool:
    return (os.environ.get("BLOOMTRAIN_CI", "") not in ("", "0")
            or os.environ.get("CI", "").lower() == "true")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="torch device for the tests marked `device` (cpu or cuda[:N]); "
                          "default cpu")


def pytest_configure(config):
    # A run started where SIGINT is ignored (a non-interactive shell's `cmd &`, nohup-like
    # wrappers) passes the ignore on to every child it starts, and bloomtrain, like any program,
    # keeps an inherited ignore: the Ctrl-C tests would then wait on a job that never stops.
    # Any handler here resets to the default in the children's exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "device: a single-process test that runs on --device "
                                       "(applied to every test that takes the device fixture)")
    config.pluginmanager.register(SkipLedger(), "bloomtrain-skip-ledger")
    _load_fuzz_profile(config)
    name = config.getoption("--device")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"--device {name}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {name}: choose cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: torch.cuda.is_available() is False here "
                                f"(torch {torch.__version__}); run without --device to test on "
                                f"the CPU")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {name}: this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)")


def fast_tier(config) -> bool:
    """Whether the run's -m expression leaves the slow tests out."""
    return re.search(r"\bnot\s+slow\b", config.option.markexpr or "") is not None


def _load_fuzz_profile(config) -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:
        if in_ci():
            raise pytest.UsageError("hypothesis is not installed: pip install -e '.[test]' "
                                    "(in CI a missing test dependency is an error)") from None
        return
    # too_slow: input generation runs on a 2-core machine shared with other jobs, where its speed
    # varies several-fold; the health check would fail runs at random, not on a bug.
    common = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("full", max_examples=500, derandomize=True, **common)
    settings.register_profile("fast", max_examples=50, print_blob=True, **common)
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("fast" if fast_tier(config) else "full")


@pytest.hookimpl(tryfirst=True)  # markers first: -m deselects by them afterwards
def pytest_collection_modifyitems(config, items):
    cuda = torch.device(config.getoption("--device")).type == "cuda"
    allowed = config.pluginmanager.get_plugin("bloomtrain-skip-ledger").allowed
    slow = {p: 0 for p in SLOW}
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
        for pattern in slow:
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.slow)
                slow[pattern] += 1
        for name in CI_ALLOWED_SKIPS:
            if item.get_closest_marker(name):
                allowed[item.nodeid] = name
        if item.get_closest_marker("cuda_only") and not cuda:
            item.add_marker(pytest.mark.skip(reason="CUDA only: run with --device cuda"))
    config.stash[MODULES_KEY] = {item.nodeid.split("::")[0] for item in items}
    stale = [p for p, n in slow.items() if not n and p.split("::")[0] in config.stash[MODULES_KEY]]
    if stale:
        message = (f"tests/conftest.py SLOW names no collected test: {stale}; update it to the "
                   f"test's new name")
        if in_ci():
            raise pytest.UsageError(message)
        warnings.warn(message)


def pytest_collection_finish(session):
    """The fast tier keeps a test of every module (when it runs them all)."""
    config = session.config
    if not fast_tier(config) or config.getoption("keyword") or config.getoption("deselect"):
        return
    left = (config.stash.get(MODULES_KEY, set()) - FAST_EXEMPT
            - {i.nodeid.split("::")[0] for i in session.items})
    if left:
        raise pytest.UsageError(f"the fast tier (-m 'not slow') has no test of {sorted(left)}: "
                                f"take one test of each out of tests/conftest.py's SLOW")


# ---- skips: listed always, refused in CI ---------------------------------------------------------

def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _missing_dependency(report) -> None:
    """In CI, pytest.importorskip's skip becomes a failure that says what to install."""
    if in_ci() and report.skipped and _skip_reason(report).startswith("could not import"):
        report.outcome = "failed"
        report.longrepr = (f"{report.nodeid}: {_skip_reason(report)}\nIn CI a missing test "
                           f"dependency is an error, not a skip: pip install -e '.[test]'")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _missing_dependency(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _missing_dependency(report)
    return report


class SkipLedger:
    """Every skip of the run with its reason, listed at the end; in CI the run fails when one is
    not allowed (CI_ALLOWED_SKIPS, by marker)."""

    def __init__(self):
        self.skips: list[tuple[str, str]] = []
        self.allowed: dict[str, str] = {}   # nodeid -> the allow-list entry that covers it

    def _record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, _skip_reason(report)))

    def pytest_collectreport(self, report):
        self._record(report)

    def pytest_runtest_logreport(self, report):
        self._record(report)

    def unallowed(self) -> list[tuple[str, str]]:
        return [(n, r) for n, r in self.skips if n not in self.allowed]

    def pytest_sessionfinish(self, session, exitstatus):
        if in_ci() and self.unallowed() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.skips:
            return
        tr = terminalreporter
        tr.section("skips")
        for nodeid, reason in self.skips:
            tag = (f"allowed in CI: {self.allowed[nodeid]}" if nodeid in self.allowed
                   else "not on CI_ALLOWED_SKIPS")
            tr.write_line(f"{nodeid}: {reason} [{tag}]")
        bad = self.unallowed()
        if bad and in_ci():
            tr.write_line(f"CI: {len(bad)} skip(s) not on tests/conftest.py's CI_ALLOWED_SKIPS "
                          f"({', '.join(CI_ALLOWED_SKIPS)}): the run fails", red=True)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device single-process tests build their models on. They bring results back with
    `.cpu()` to compare them, so a reference (HF, torch's AdamW, a constant) can stay on the
    CPU and check the device's kernels against it."""
    return torch.device(request.config.getoption("--device"))


# Scripts from the languages and symbol ranges byte-level BPE must round-trip exactly.
MULTILINGUAL_TEXT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "数据并行、张量并行和流水线并行。你好，世界！\n"
    "Привет, мир! Съешь же ещё этих мягких французских булок.\n"
    "مرحبا بالعالم، هذا نص عربي للاختبار.\n"
    "Emoji 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🎉\n"
    "def f(x):\n\treturn x * 2   \n\n"
    "Combining: e\u0301 a\u0308 n\u0303\n"
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE trained once per session on a few multilingual lines (vocab <= 500)."""
    from bloomtrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tokenizer")
    corpus = root / "corpus.txt"
    corpus.write_text(MULTILINGUAL_TEXT * 20, encoding="utf-8")
    train_tokenizer([corpus], vocab_size=500, output_dir=root / "tok")
    return root / "tok"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """The serving tests' model: (HF reference model, its save_pretrained directory holding the
    session's tokenizer too); tests/serving.py's save_tiny_hf. A module may define its own."""
    import shutil

    from tests.serving import VOCAB, save_tiny_hf

    path = tmp_path_factory.mktemp("serve") / "tiny"
    ref = save_tiny_hf(path, VOCAB)
    for f in Path(tiny_tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return ref, path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The tokenizer of `model_dir`."""
    from bloomtrain.data.tokenizer import load_tokenizer
    return load_tokenizer(model_dir[1])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A synthetic Megatron .bin/.idx corpus (tests/synthetic.py), one per test module; its
    prefix."""
    from tests.synthetic import write_synthetic_dataset
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "synth_text_document")


@pytest.fixture(scope="module")
def one_thread():
    """Pin torch to one intra-op thread for a module of tiny-tensor tests. With two threads on a
    shared 2-core machine, OpenMP's spin-waiting made single tiny calls 30-300x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ---- the rank pool -------------------------------------------------------------------------------

POOL_KEY = pytest.StashKey[rank_dist.RankPool]()


@pytest.fixture(scope="session", autouse=True)
def rank_pool(request):
    """The session's rank pool (tests/dist.py): every run_ranks call of the run submits to it.
    It starts no process until a test asks for ranks."""
    pool = rank_dist.RankPool()
    request.config.stash[POOL_KEY] = pool
    with rank_dist.use_pool(pool):
        yield pool
    pool.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    pool = config.stash.get(POOL_KEY, None)
    if pool is None or not pool.runs:
        return
    tr.section("rank pool")
    tr.write_line(f"{pool.runs} multi-rank runs on {pool.started} worker processes started")
    for line in pool.incidents:
        tr.write_line(line)
