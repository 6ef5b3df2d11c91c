"""zo_megatron's data layer: tokenizers (bundled GPT-2 BPE, Hugging Face directories), text -> Megatron indexed dataset
preprocessing, the embedded SOTU corpus, megatron-core GPT datasets and data-parallel batching.

    from zo_megatron.data import build_tokenizer, default_data_prefix, build_gpt_datasets, dp_batches

Importing this package is cheap: megatron-core (seconds to import) and torch are loaded only by
the functions that need them.
"""

from zo_megatron.data.errors import DataError
from zo_megatron.data.tokenizer import GPT2Tokenizer, HuggingFaceTokenizer, Tokenizer, build_tokenizer

_LAZY = {
    "PreprocessResult": "zo_megatron.data.preprocess",
    "default_data_prefix": "zo_megatron.data.corpus",
    "default_cache_dir": "zo_megatron.data.corpus",
    "extract_corpus": "zo_megatron.data.corpus",
    "iter_corpus_documents": "zo_megatron.data.corpus",
    "build_gpt_datasets": "zo_megatron.data.datasets",
    "build_mock_gpt_datasets": "zo_megatron.data.datasets",
    "validate_data_prefix": "zo_megatron.data.datasets",
    "parse_data_path": "zo_megatron.data.datasets",
    "DatasetInfo": "zo_megatron.data.datasets",
    "DPBatches": "zo_megatron.data.datasets",
    "dp_batches": "zo_megatron.data.datasets",
}

__all__ = ["DataError", "GPT2Tokenizer", "HuggingFaceTokenizer", "Tokenizer", "build_tokenizer", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
