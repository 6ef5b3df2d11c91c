"""Impossible layouts fail with one clear line before any process-group work."""
import pytest
import torch.distributed as dist

from zo_megatron.errors import ConfigError
from zo_megatron.model import GPTConfig
from zo_megatron.parallel import init_parallel, validate_parallel_config


@pytest.mark.parametrize("world,tp,heads,hidden,fragment", [
    (4, 3, 12, 768, "world size 4 is not divisible by --tensor-parallel 3"),
    (8, 8, 12, 768, "--num-attention-heads 12 is not divisible by --tensor-parallel 8"),
    (16, 16, 12, 768, "--tensor-parallel 16 exceeds --num-attention-heads 12"),
    (2, 2, 12, 770, "--hidden-size 770 is not divisible by --num-attention-heads 12"),
    (2, 0, 12, 768, "--tensor-parallel must be >= 1"),
])
def test_bad_layouts(world, tp, heads, hidden, fragment):
    with pytest.raises(ConfigError) as exc:
        validate_parallel_config(world, tp, heads, hidden)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


def test_init_parallel_refuses_before_creating_groups(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: reaching the rendezvous would hang
    with pytest.raises(ConfigError, match="world size 3 is not divisible by --tensor-parallel 2"):
        init_parallel(2, num_attention_heads=4, hidden_size=64)
    assert not dist.is_initialized()


def test_model_config_errors():
    with pytest.raises(ConfigError, match="not divisible by --num-attention-heads"):
        GPTConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ConfigError, match="label smoothing"):
        GPTConfig(label_smoothing=0.1)
    with pytest.raises(ConfigError, match="precision"):
        GPTConfig(precision="fp8")


def test_vocab_padding_rule():
    cfg = GPTConfig(vocab_size=50257)
    assert [cfg.padded_vocab_size(t) for t in (1, 2, 4, 16)] == [50304, 50432, 50688, 51200]
