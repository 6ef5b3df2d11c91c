"""tests/fp32_bounds.py keeps its power: the floor it takes from torch's own fp32 error never
hides a wrong run. On a fresh draw, fp32 torch runs that are wrong by a learning rate 0.1% off,
one dropped update, or one bias left alone fail it; torch's fp32 run itself passes. The floor
is the largest error of fp32_spread's runs (the init and inits moved by one ulp), as the engine
tests use it."""
import pytest
import torch

from tests import test_offload_engine as T
from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")


def _init(seed):
    from zo_megatron.checkpoint.hf.gpt2 import from_hf

    torch.manual_seed(seed)
    hc = transformers.GPT2Config(vocab_size=T.VOCAB, n_positions=T.SEQ, n_embd=T.HIDDEN, n_layer=T.LAYERS,
                                 n_head=T.HEADS)
    sd = dict(transformers.GPT2LMHeadModel(hc).float().state_dict())
    return {n: t.clone() for n, t in from_hf(sd, T.LAYERS, T.HEADS).items()}


def test_the_bounds_pass_torch_fp32_and_fail_wrong_runs(monkeypatch):
    seed = fresh_seed("fp32 bounds power")
    init = _init(seed)
    ref64 = T._reference(init, seed, 1)[2]
    # every run now, before the monkeypatch below changes what T._reference computes (the spread is
    # lazy): the wrong runs are held to the whole spread, as an engine that misses the first run's is
    spread = list(fp32_spread(lambda start: T._reference(start, seed, 1, dtype=torch.float32)[2], init))
    torch32 = spread[0]
    assert_fp32_weights_match(torch32, ref64, spread)

    wrong = {"dropped update": T._reference(init, seed, 1, skip_step=T.STEPS - 1, dtype=torch.float32)[2]}
    real_lr = T._lr
    monkeypatch.setattr(T, "_lr", lambda step: real_lr(step) * 1.001)
    wrong["lr x 1.001"] = T._reference(init, seed, 1, dtype=torch.float32)[2]
    bias = "gpt.decoder.layers.0.self_attention.linear_proj.bias"
    wrong["a bias never updated"] = {**torch32, bias: init[bias]}
    for why, final in wrong.items():
        with pytest.raises(AssertionError):
            assert_fp32_weights_match(final, ref64, spread)
            pytest.fail(f"{why}: passed")
