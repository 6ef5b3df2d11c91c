"""A small Hugging Face tokenizer for offline tests, trained here (no download, no shipped binary).

    from tests.hf_tokenizer import make_hf_tokenizer
    tok_dir = make_hf_tokenizer(tmp_path / "tok")      # -> the directory, as a str
    AutoTokenizer.from_pretrained(tok_dir)             # loads offline, no remote code

A byte-level BPE (the `tokenizers` library's trainer, Llama-3 / GPT-2 style pre-tokenizer) with
HF_VOCAB_SIZE entries, trained on the first HF_TRAIN_DOCS addresses of the embedded SOTU corpus, with
special tokens <s> (BOS, id 0) and </s> (EOS, id 1). Like Llama's config it adds BOS in front of
every text (a TemplateProcessing post-processor, add_bos_token true) and no EOS: so tok(text).input_ids
starts with 0, and the data pipeline appends EOS = 1 after each document. Training is deterministic
and runs once per process (~1 s); later calls only write the cached files. The pytest fixture
`hf_tokenizer_dir` (tests/conftest.py) gives one directory per session.
"""
from __future__ import annotations

import json
import os

HF_VOCAB_SIZE = 2000
HF_TRAIN_DOCS = 20
BOS, EOS = "<s>", "</s>"

_CACHE: dict[str, str] = {}   # file name -> content, filled by the first call in this process


def _train() -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from zo_megatron.data.corpus import iter_corpus_documents

    texts = []
    for i, (_, text) in enumerate(iter_corpus_documents()):
        if i >= HF_TRAIN_DOCS:
            break
        texts.append(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=HF_VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False}
    special = {"bos_token": BOS, "eos_token": EOS}
    return {"tokenizer.json": tok.to_str(pretty=False),
            "tokenizer_config.json": json.dumps(config, indent=1),
            "special_tokens_map.json": json.dumps(special, indent=1)}


def make_hf_tokenizer(directory, *, without: tuple[str, ...] = (), config_update: dict | None = None) -> str:
    """Write the test tokenizer's files into `directory` (created) and return it as a str.

    without: file names to leave out (bad-input tests); config_update: keys merged into
    tokenizer_config.json (None values delete a key)."""
    if not _CACHE:
        _CACHE.update(_train())
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    for name, content in _CACHE.items():
        if name in without:
            continue
        if name == "tokenizer_config.json" and config_update:
            cfg = json.loads(content)
            for k, v in config_update.items():
                cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
            content = json.dumps(cfg, indent=1)
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(content)
    return directory
