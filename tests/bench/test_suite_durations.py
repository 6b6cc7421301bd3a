"""The suite section's duration tables: per-test seconds from pytest's junit XML, summed per file, and the suite's
pytest time in fresh 2-rank torchrun cases measured in the same run. No ranks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cp_harness.bench import suite
from cp_harness.bench.report import suite_table


def test_a_real_junit_report_is_summed_per_file_and_the_slowest_test_comes_first(tmp_path):
    (tmp_path / "test_a.py").write_text(textwrap.dedent("""
        import time, pytest

        @pytest.fixture(scope="module")
        def slow_setup():
            time.sleep(0.3)

        def test_one(slow_setup):
            pass

        def test_two():
            time.sleep(0.1)

        class TestGroup:
            def test_three(self):
                pass
    """))
    (tmp_path / "test_b.py").write_text("def test_quick():\n    pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--junitxml={junit}", str(tmp_path)], cwd=tmp_path, check=True, capture_output=True)
    tests = suite.test_seconds(junit)
    assert set(tests) == {"test_a.py::test_one", "test_a.py::test_two", "test_a.py::test_three",
                          "test_b.py::test_quick"}, tests
    assert tests["test_a.py::test_one"] >= 0.3  # the module fixture's setup counts to the first test using it
    files = suite.by_file(tests)
    assert [f for f, _, _ in files] == ["test_a.py", "test_b.py"]
    assert files[0][2] == 3 and files[0][1] == pytest.approx(sum(v for k, v in tests.items() if "test_a" in k))


def test_fresh_case_equivalents_are_pytest_seconds_over_one_fresh_case_of_the_same_run():
    result = {"pytest_seconds": 300.0}
    assert suite.fresh_case_equivalents(result, {"fresh": {"mean_s": {"wall": 7.5}}}) == pytest.approx(40.0)
    assert suite.fresh_case_equivalents(result, {"fresh": None}) is None
    assert suite.fresh_case_equivalents(result, None) is None


def test_the_suite_table_shows_the_files_and_the_unit():
    result = {"command": "./scripts/test", "returncode": 0, "passed": 3, "failed": 0, "cp_examples": 10,
              "cp_examples_per_size": "N=2: 10", "seconds": 12.0, "pytest_seconds": 10.0,
              "test_seconds_total": 20.0, "by_file": [("tests/x/test_y.py", 15.0, 2), ("tests/test_z.py", 5.0, 1)],
              "slowest": [("tests/x/test_y.py::test_slow", 14.0)], "fresh_case_equivalents": 2.5}
    text = suite_table(result)
    assert "tests/x/test_y.py" in text and "75.0%" in text and "2.5 fresh 2-rank torchrun cases" in text
    assert "tests/x/test_y.py::test_slow" in text
