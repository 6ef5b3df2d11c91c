"""Issue 34, 2.7: NVLink SHARP's buffers are not in the memory plan, so the job turns NVLS off
unless the user asked for it (a default may only use memory the plan shows is free)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import os, sys
sys.path.insert(0, %r)
import zo_megatron.training.loop as loop
seen = {}
def stop(argv=None):
    seen["nvls"] = os.environ.get("NCCL_NVLS_ENABLE")
    raise SystemExit(0)
loop.parse_args = stop                       # pretrain() parses right after its environment defaults
try:
    loop.pretrain(["--tensor-parallel", "1"])
except SystemExit:
    pass
print("NVLS", seen["nvls"])
""" % ROOT


def _probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    if env_value is not None:
        env["NCCL_NVLS_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_job_turns_nvls_off_by_default_and_keeps_the_users_choice():
    assert _probe(None) == "NVLS 0"
    assert _probe("1") == "NVLS 1"
