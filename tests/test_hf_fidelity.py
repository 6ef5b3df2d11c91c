"""Issue 35, "Hugging Face fidelity" (items 10-13, 15): what transformers does with a config is what
the conversion does, or the conversion refuses in one line.

Tiny random models that transformers builds from configs made here (nothing downloaded); the
reference is transformers' own forward pass (fp32, eager attention), compared element by element
with our model built from the converted checkpoint, at a sequence length where a sliding window
binds (SEQ > WINDOW).
"""
import json
import os

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, POS, VOCAB = 32, 4, 2, 48, 2, 64, 97
WINDOW, SEQ = 16, 40


def quiet(_line):
    pass


def common(**over):
    return {**dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS,
                   rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, attention_dropout=0.0,
                   tie_word_embeddings=False), **over}


def make_hf(directory, cfg, seed: int) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(str(directory))
    return str(directory)


def edit_config(directory, **changes):
    """config.json of `directory` with `changes` (None deletes a key), as a file of another
    transformers version or hand-edited config would say it."""
    path = os.path.join(directory, "config.json")
    cfg = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"))


def hf_logits(directory, tokens) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def _our_logits(rank, ck, tokens):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.config import ARCH_FIELDS
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import init_parallel

    reader = CheckpointReader(ck)
    cfg = GPTConfig(**{k: reader.model_meta[k] for k in ARCH_FIELDS}, precision="fp32")
    init_parallel(1)
    model = build_gpt_model(cfg, 0, 1, 1)
    load_full_params(model, reader.read_weights(), 0, 1, cfg.vocab_size)
    with torch.no_grad():
        return model(tokens).float()[..., :cfg.vocab_size].clone()


def our_logits(ck, tokens):
    return run_world(_our_logits, 1, ck, tokens, timeout=120)[0]


def close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def tokens_for(seed, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, seq), generator=g)


# ---------------------------------------------------------------- item 10: layer_types


def test_layer_types_are_read_only_by_the_families_whose_model_reads_them(tmp_path):
    """transformers' Mistral ignores `layer_types` and slides every layer when sliding_window is set;
    Qwen2 reads it. A Mistral config whose layer_types say full attention with a window below
    max_position_embeddings is not a full-attention model (old code: converted as one, logits 1.29
    relative off at seq 40); a Qwen2 config with use_sliding_window but only full-attention layer
    types is one (converted, logits equal transformers')."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.errors import UserError

    seed = fresh_seed("layer_types")
    tokens = tokens_for(seed)
    full = ["full_attention"] * LAYERS

    mistral = make_hf(tmp_path / "mistral", transformers.MistralConfig(**common(sliding_window=WINDOW)), seed)
    edit_config(mistral, layer_types=full)
    assert transformers.AutoConfig.from_pretrained(mistral).layer_types == full     # the file says it; Mistral
    with pytest.raises(UserError, match=f"sliding_window={WINDOW}"):                # slides anyway
        convert.from_hf(mistral, str(tmp_path / "mistral_ck"), tensor_parallel=1, log=quiet)
    assert not os.path.exists(tmp_path / "mistral_ck")

    qwen2 = make_hf(tmp_path / "qwen2", transformers.Qwen2Config(**common(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, layer_types=full)), seed + 1)
    convert.from_hf(qwen2, str(tmp_path / "qwen2_ck"), tensor_parallel=1, log=quiet)
    close(our_logits(str(tmp_path / "qwen2_ck"), tokens), hf_logits(qwen2, tokens))


# ---------------------------------------------------------------- item 12 (c): use_sliding_window


def test_a_qwen2_config_read_as_transformers_4x_reads_it_slides_only_with_use_sliding_window(tmp_path, monkeypatch):
    """transformers 4.x's Qwen2Config keeps sliding_window when use_sliding_window is false (and older
    4.x has no layer_types); its model does not slide then (DeepSeek-R1-Distill-Qwen's config:
    use_sliding_window false, sliding_window 4096). Old code: refused, with the advice to set
    use_sliding_window false, which the config already says. Here the installed transformers'
    config object is made to hold what 4.x's holds."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.hf import FAMILIES

    seed = fresh_seed("qwen2 4.x use_sliding_window")
    qwen2 = make_hf(tmp_path / "qwen2", transformers.Qwen2Config(**common(use_sliding_window=False)), seed)
    edit_config(qwen2, sliding_window=WINDOW, max_window_layers=0, layer_types=None, transformers_version="4.45.0")
    family = FAMILIES["Qwen2ForCausalLM"]
    read = family.read_config

    def as_4x(cfg_json, where):
        cfg = read(cfg_json, where)
        cfg.sliding_window, cfg.layer_types = cfg_json["sliding_window"], None    # 4.x's attributes
        return cfg

    monkeypatch.setattr(family, "read_config", as_4x)
    convert.from_hf(qwen2, str(tmp_path / "ck"), tensor_parallel=1, log=quiet)
    tokens = tokens_for(seed)
    close(our_logits(str(tmp_path / "ck"), tokens), hf_logits(qwen2, tokens))
    # and with use_sliding_window true, 4.x's layers from max_window_layers on slide: refused
    edit_config(qwen2, use_sliding_window=True, max_window_layers=1)
    from zo_megatron.errors import UserError
    with pytest.raises(UserError, match=f"sliding_window={WINDOW} .* in layers 1 of Qwen2ForCausalLM"):
        convert.from_hf(qwen2, str(tmp_path / "ck2"), tensor_parallel=1, log=quiet)
