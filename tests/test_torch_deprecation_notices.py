"""Issue 35, item 17: the FutureWarnings every TP x sequence-parallel run printed (torch deprecates
all_gather_into_tensor / reduce_scatter_tensor, which megatron-core's mappings call) are hidden by
their exact text; other FutureWarnings still show, and zo_megatron's own collectives use the
successors. The deprecated functions are called for real on a one-rank gloo group."""
import warnings

import pytest
import torch
import torch.distributed as dist

from zo_megatron.parallel.launch_env import find_free_port


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_megatrons_deprecated_collectives_warn_no_more_and_others_still_do(one_rank_group):
    from zo_megatron.parallel import collectives
    from zo_megatron.parallel.megatron_notices import hide_known_megatron_notices

    x, out = torch.arange(4.0), torch.empty(4)
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(out, x)
    if not any(issubclass(w.category, FutureWarning) for w in before):
        pytest.skip(f"torch {torch.__version__} does not deprecate them: nothing to hide")
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        hide_known_megatron_notices()
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(out, x)
        collectives.all_gather(out, x, None)              # ours: the successors, no warning
        collectives.reduce_scatter(out, x, None)
        warnings.warn("some other deprecation", FutureWarning)
    messages = [str(w.message) for w in after if issubclass(w.category, FutureWarning)]
    assert messages == ["some other deprecation"], messages
