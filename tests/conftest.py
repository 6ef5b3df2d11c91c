"""Session checks for `make test` / `make test-gpu`: a missing requirement fails the run
(tests/requirements_check.py) instead of skipping the tests that need it."""
import pytest

from tests.requirements_check import check_from_environment


def pytest_configure(config):
    problems = check_from_environment()
    if problems:
        raise pytest.UsageError("missing requirements, not running the tests:\n  " + "\n  ".join(problems))
