"""Which tokenizer made a preprocessed dataset: PREFIX.meta.json beside PREFIX.bin/.idx.

Megatron's indexed dataset (.bin/.idx) does not say which tokenizer produced its ids, so a dataset
preprocessed with one tokenizer can be trained with another, silently, as long as the ids fit the
dtype. tools/preprocess_data.py therefore writes, next to the pair:

    {"format": "zo_megatron.dataset_meta", "version": 1, "tokenizer_type": ..., "tokenizer_model": ...,
     "tokenizer_fingerprint": ..., "vocab_size": ..., "eod": ..., "min_token_id": ..., "max_token_id": ...,
     "documents": ..., "tokens": ..., "data_fingerprint": ...}

The recorded max id lets the job check "every id < the model's vocabulary" without reading a large
.bin. The record is trusted only while `data_fingerprint` (sha256 of the .idx, the .bin's size and
modification time) still matches the files beside it: a pair rewritten by another tool, or a .bin
edited in place, falls back to scanning the tokens. Datasets without the file (Megatron-LM's own
preprocessing, older zo_megatron) are scanned as before.
"""
from __future__ import annotations

import hashlib
import json
import os

META_SUFFIX = ".meta.json"
META_FORMAT = "zo_megatron.dataset_meta"
META_VERSION = 1


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def data_fingerprint(idx_path: str, bin_path: str) -> str:
    """sha256 over the .idx bytes and the .bin's size and mtime (a rename keeps both)."""
    h = hashlib.sha256()
    with open(idx_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    st = os.stat(bin_path)
    h.update(f"\n{st.st_size}\n{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def dataset_meta(tokenizer, *, idx_path: str, bin_path: str, min_token_id: int, max_token_id: int,
                 documents: int, tokens: int) -> dict:
    return {"format": META_FORMAT, "version": META_VERSION,
            "tokenizer_type": tokenizer.tokenizer_type,
            "tokenizer_model": getattr(tokenizer, "model_dir", None),
            "tokenizer_fingerprint": tokenizer.fingerprint, "vocab_size": int(tokenizer.vocab_size),
            "eod": int(tokenizer.eod), "min_token_id": int(min_token_id), "max_token_id": int(max_token_id),
            "documents": int(documents), "tokens": int(tokens),
            "data_fingerprint": data_fingerprint(idx_path, bin_path)}


def read_dataset_meta(prefix: str) -> dict | None:
    """The record beside `prefix`, or None when absent, unreadable or no longer describing the pair."""
    try:
        with open(meta_path(prefix), encoding="utf-8") as f:
            meta = json.load(f)
        if (not isinstance(meta, dict) or meta.get("format") != META_FORMAT
                or meta.get("version") != META_VERSION):
            return None
        if meta.get("data_fingerprint") != data_fingerprint(prefix + ".idx", prefix + ".bin"):
            return None
        int(meta["max_token_id"]), int(meta["min_token_id"]), int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta
