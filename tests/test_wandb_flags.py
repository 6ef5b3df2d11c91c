"""Megatron-LM's W&B flags reach wandb.init: --wandb-project, --wandb-exp-name, --wandb-save-dir and
--wandb-entity (which was refused: Megatron-LM's scripts pass it). wandb is not a dependency; a stand-in
module records what the job gives wandb.init."""
import sys
import types

from zo_megatron.training.arguments import parse_args


def test_the_wandb_flags_reach_wandb_init(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None,
                                                                         finish=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from zo_megatron.training import components

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                       "--lr", "1e-3", "--train-iters", "4", "--wandb-project", "proj", "--wandb-exp-name", "run-7",
                       "--wandb-save-dir", str(tmp_path / "wb"), "--wandb-entity", "my-team"])
    ps = types.SimpleNamespace(rank=0)
    monkeypatch.setattr("zo_megatron.training.user_report.run_header", lambda a, p: {"kind": "header"})
    components.build_metrics(args, ps)
    assert len(calls) == 1
    kw = calls[0]
    assert (kw["project"], kw["name"], kw["dir"], kw["entity"]) == ("proj", "run-7", str(tmp_path / "wb"), "my-team")
    assert kw["config"]["wandb_entity"] == "my-team" and kw["config"]["train_iters"] == 4
