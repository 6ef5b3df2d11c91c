"""Session checks and fixtures shared by the test modules.

`make test` / `make test-gpu`: a missing requirement fails the run (tests/requirements_check.py)
instead of skipping the tests that need it.
"""
import pytest

from tests.requirements_check import check_from_environment


def pytest_configure(config):
    problems = check_from_environment()
    if problems:
        raise pytest.UsageError("missing requirements, not running the tests:\n  " + "\n  ".join(problems))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A small byte-level BPE Hugging Face tokenizer directory (tests/hf_tokenizer.py), one per session."""
    from tests.hf_tokenizer import make_hf_tokenizer

    return make_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))
