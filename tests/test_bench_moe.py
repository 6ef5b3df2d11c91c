"""tools/bench_moe.py (issue 39's benchmark): its parameter counts against transformers' models, a tiny
run of its EP 2 arm through the real job, and its one-line refusals."""
import json
import os
import statistics
import sys

import pytest

from tests.cli import TOOLS, run_tool
from tests.seeds import fresh_seed


def _tool():
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import bench_moe

    return bench_moe


def test_total_and_active_parameters_are_transformers_counts():
    """Total: MixtralForCausalLM's numel (router and every expert); active: less (E - k) experts per
    layer, counted on transformers' own expert tensors; dense: LlamaForCausalLM at FFN k x F."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    bench = _tool()
    a = bench.parse_args(["--layers", "3", "--hidden", "64", "--heads", "4", "--experts", "6", "--topk", "2",
                          "--moe-ffn", "40", "--vocab", "256", "--seq", "32"])
    shape = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)
    mixtral = MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=40, num_local_experts=6,
                                               num_experts_per_tok=2))
    total = sum(p.numel() for p in mixtral.parameters())
    experts = sum(p.numel() for n, p in mixtral.named_parameters() if "layers.0." in n and ".experts." in n)
    assert experts == 6 * 3 * 64 * 40
    assert bench.parameter_counts(a, "moe_ep1") == (total, total - 3 * (6 - 2) * experts // 6)
    assert bench.parameter_counts(a, "moe_ep2") == bench.parameter_counts(a, "moe_ep1")
    llama = LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=2 * 40))
    dense = sum(p.numel() for p in llama.parameters())
    assert bench.parameter_counts(a, "dense") == (dense, dense)


def test_bench_moe_times_the_ep2_job(tmp_path):
    out = tmp_path / "moe.json"
    seed = fresh_seed("bench_moe")
    r = run_tool("bench_moe", "--arms", "moe_ep2", "--layers", "1", "--hidden", "32", "--heads", "2",
                 "--experts", "4", "--moe-ffn", "32", "--vocab", "128", "--seq", "16", "--micro-batch", "2",
                 "--train-iters", "3", "--skip", "1", "--seed", seed, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["arm"] == "moe_ep2" and row["iterations_timed"] == 2
    assert row["min_step_s"] <= row["median_step_s"] <= row["max_step_s"]
    its = row["iterations"]
    assert [i["iteration"] for i in its] == [2, 3]
    for i in its:       # tokens per step: seq x micro-batch x 2 ranks, over the job's own step time
        assert i["tokens_per_s"] * i["step_time_s"] == pytest.approx(16 * 2 * 2, rel=1e-9)
        assert 0 < i["cpu_step_s"] < i["step_time_s"]
    assert row["median_step_s"] == statistics.median(i["step_time_s"] for i in its)
    assert row["tokens_per_s"] == statistics.median(i["tokens_per_s"] for i in its)
    assert row["cpu_step_s"] == statistics.median(i["cpu_step_s"] for i in its)
    assert row["cpu_step_share"] == row["cpu_step_s"] / row["median_step_s"]
    assert row["host_model_state_bytes"] > 0 and row["total_params"] > row["active_params"]
    assert os.path.exists(tmp_path / "moe.png") and "moe_ep2" in r.stdout


@pytest.mark.parametrize("argv, says", [
    (["--arms", "moe_ep3"], "--arms: unknown moe_ep3"),
    (["--experts", "5"], "moe_ep2 needs an even --nproc and --experts"),
    (["--topk", "9"], "--topk 9 must be between 1 and --experts 8"),
    (["--train-iters", "2", "--skip", "2"], "--train-iters 2 must exceed --skip 2"),
])
def test_bad_arguments_are_one_line(argv, says):
    r = run_tool("bench_moe", *argv)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
