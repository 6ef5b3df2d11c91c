"""--apply-layernorm-1p (Megatron-LM's zero-centred gamma): every norm scales by 1 + weight, the weight
starting at 0; a checkpoint exports to Hugging Face as ordinary norms with weight 1 + w, exactly."""
import pytest
import torch

from tests.harness import run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed
from tests.test_convert_llama import _our_logits, close, hf_logits, quiet
from tests.test_pretrain import TINY, _single


def test_zero_centred_norms_equal_their_float64_definition():
    from types import SimpleNamespace

    from zo_megatron.model.norms import LayerNorm, RMSNorm

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(sequence_parallel=False, layernorm_zero_centered_gamma=True)
    x = torch.randn(3, 5, 48, generator=g)
    for cls in (LayerNorm, RMSNorm):
        norm = cls(config, 48, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48, generator=g) * 0.3)
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.randn(48, generator=g) * 0.3)
        xd, w = x.double(), norm.weight.detach().double()
        if cls is LayerNorm:
            ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
            ref = ref * (1 + w) + norm.bias.detach().double()
        else:
            ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * (1 + w)
        torch.testing.assert_close(norm(x).double(), ref, rtol=1e-5, atol=1e-5, msg=f"{cls.__name__} seed={seed}")


def test_a_1p_llama_trains_and_exports_to_transformers_exactly(tmp_path):
    """A Llama-shaped run with --apply-layernorm-1p saves zero-centred norm weights (they start at 0);
    to-hf writes 1 + w into LlamaForCausalLM's RMSNorms, whose logits equal our model's on the
    checkpoint at every position."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.errors import UserError

    ck = tmp_path / "ck"
    llama = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
             "--num-query-groups", "2", "--apply-layernorm-1p"]
    r = _single(["--zero-offload", "--fp32", *TINY, *llama, "--train-iters", "3", "--save", str(ck),
                 "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(HF_VOCAB_SIZE)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    reader = CheckpointReader(str(ck))
    assert reader.model_meta["layernorm_zero_centered_gamma"] is True
    norms = {k: v for k, v in reader.read_weights().items() if k.endswith("layernorm.weight")}
    assert norms and all(v.abs().max() < 0.2 for v in norms.values())          # zero-centred, moved by training
    assert any(v.abs().max() > 0 for v in norms.values())
    with pytest.raises(UserError, match="NullTokenizer .*: pass --tokenizer-model DIR"):
        convert.to_hf(str(ck), str(tmp_path / "no_tok"), log=quiet)      # ids only: the user names the text's
    convert.to_hf(str(ck), str(tmp_path / "hf"), tokenizer_model=make_hf_tokenizer(tmp_path / "tok"), log=quiet)
    seed = fresh_seed()
    tokens = torch.randint(0, HF_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(seed))
    ours, _ = run_world(_our_logits, 1, str(ck), tokens, timeout=120)[0]     # a rank of its own: a process group
    close(ours, hf_logits(str(tmp_path / "hf"), tokens)[..., :ours.shape[-1]])
