"""Session-wide fixtures shared by the test modules."""
import pytest


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A small byte-level BPE Hugging Face tokenizer directory (tests/hf_tokenizer.py), one per session."""
    from tests.hf_tokenizer import make_hf_tokenizer

    return make_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))
