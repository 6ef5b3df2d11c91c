#!/usr/bin/env python3
"""Tokenize text / JSONL into a Megatron indexed dataset (PREFIX_text_document.bin/.idx).

Megatron-LM-compatible flags; see `python tools/preprocess_data.py --help` and
zo_megatron/data/preprocess.py. Also installed as the `zo-preprocess-data` command.
"""

import os
import sys

if __name__ == "__main__":
    try:
        import zo_megatron.data.preprocess  # noqa: F401
    except ImportError:  # run from a source checkout without `pip install -e .`
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from zo_megatron.data.preprocess import main

    sys.exit(main())
