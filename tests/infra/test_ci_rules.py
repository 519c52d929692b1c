"""CI's rules for a broken install and for skips (tests/conftest.py), run as pytest runs them: in a
child pytest with a test dependency made unimportable, or on a small test file of skips.

A dependency is blocked by a package of its name first on PYTHONPATH whose import raises
ModuleNotFoundError, as a missing one does; hypothesis' pytest plugin is left out with it (it is
installed with hypothesis and goes when hypothesis does).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_A_SKIP = "In CI a missing test dependency is an error, not a skip"


def child_pytest(args: list[str], tmp_path: Path, *, ci: bool, blocked=(), cwd=ROOT):
    """(exit status, output) of `python -m pytest ARGS` with `blocked` modules unimportable."""
    shim = tmp_path / ("shim-" + "-".join(blocked))
    for name in blocked:
        (shim / name).mkdir(parents=True, exist_ok=True)
        (shim / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BLOOMTRAIN_CI")}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)])
    if ci:
        env["CI"] = "true"
    plugins = ["-p", "no:hypothesispytest"] if "hypothesis" in blocked else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *plugins, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("blocked,modules", [
    ("transformers", ["tests/checkpoint/test_hf.py", "tests/test_generate.py", "tests/serve/test_serve.py"]),
    ("aiohttp", ["tests/serve/test_serve.py"]),
], ids=["transformers", "aiohttp"])
def test_a_missing_test_dependency_fails_ci(tmp_path, blocked, modules):
    rc, out = child_pytest(["--collect-only", *modules], tmp_path, ci=True, blocked=[blocked])
    assert rc not in (0, 5), out  # 5: nothing collected, every module skipped
    for module in modules:
        assert f"ERROR {module} - {module}: could not import '{blocked}'" in out, out
    assert NOT_A_SKIP in out, out


def test_a_missing_hypothesis_fails_ci_before_any_test(tmp_path):
    rc, out = child_pytest(["--collect-only", "tests/test_config.py"], tmp_path, ci=True,
                           blocked=["hypothesis"])
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert "hypothesis is not installed: pip install -e '.[test]'" in out, out


def test_outside_ci_a_missing_dependency_skips_its_modules_and_lists_them(tmp_path):
    # What a contributor without the extras sees: the modules that need them are skipped and
    # listed with the reason; test_config.py (no hypothesis since the fuzzers moved) still runs.
    rc, out = child_pytest(["--collect-only", "tests/checkpoint/test_hf.py", "tests/robustness/test_fuzz.py",
                            "tests/test_config.py"], tmp_path, ci=False,
                           blocked=["transformers", "hypothesis"])
    assert rc == 0, out
    for module, name in (("tests/checkpoint/test_hf.py", "transformers"), ("tests/robustness/test_fuzz.py",
                                                                 "hypothesis")):
        assert f"{module}: could not import '{name}'" in out and "[not on CI_ALLOWED_SKIPS]" in out
    assert "tests/test_config.py::test_every_key_has_a_domain" in out, out


SKIPS = """
import pytest

def test_runs():
    pass

def test_skips_for_a_reason_ci_does_not_allow():
    pytest.skip("the network is down")

@pytest.mark.cuda_only
def test_on_cuda():
    pass
"""


@pytest.mark.parametrize("unlisted", [True, False], ids=["unlisted-skip", "cuda-only-skip"])
def test_ci_fails_on_a_skip_not_on_the_allow_list(tmp_path, unlisted):
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\nmarkers =\n"
                                         "    slow: slow\n    cuda_only: cuda only\n")
    (tmp_path / "test_skips.py").write_text(SKIPS)
    select = [] if unlisted else ["-k", "not reason_ci_does_not_allow"]
    rc, out = child_pytest(["-p", "tests.conftest", "test_skips.py", *select], tmp_path, ci=True,
                           cwd=tmp_path)
    # Every skip is listed with its reason, whether or not CI allows it.
    assert ("test_skips.py::test_on_cuda: CUDA only: run with --device cuda [allowed in CI: "
            "cuda_only]") in out, out
    assert (("test_skips.py::test_skips_for_a_reason_ci_does_not_allow: the network is down "
             "[not on CI_ALLOWED_SKIPS]") in out) == unlisted, out
    assert rc == (pytest.ExitCode.TESTS_FAILED if unlisted else pytest.ExitCode.OK), out
    assert ("CI: 1 skip(s) not on tests/conftest.py's CI_ALLOWED_SKIPS (cuda_only): the run "
            "fails" in out) == unlisted, out
