"""A transfer agent's progress thread pauses between rounds instead of spinning a core."""

import os
import time

import torch

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core.transfer.agent_settings import progress_thread_delay  # noqa: E402
from deepinfer_core.transfer.layout import KVLayout  # noqa: E402
from deepinfer_core.transfer.nixl_agent import NixlKVAgent  # noqa: E402


def test_the_config_keeps_our_pause_while_the_agent_is_built():
    from deepinfer_core.transfer.nixl_variant import api as nixl_api

    api = nixl_api()

    base = api.nixlBind.nixlAgentConfig
    with progress_thread_delay(250):
        config = api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what nixl's Python agent sets
        assert config.pthrDelay == 250
    assert api.nixlBind.nixlAgentConfig is base
    assert base().pthrDelay == 0


def test_an_idle_agent_uses_almost_no_cpu():
    buf = torch.zeros(2, 8, 16, 4)
    agent = NixlKVAgent("idle", buf, KVLayout.of({"architectures": ["Idle"]}, buf, 16))
    try:
        before, t0 = os.times(), time.monotonic()
        time.sleep(1.5)
        after, t1 = os.times(), time.monotonic()
    finally:
        agent.close()
    cores = ((after.user + after.system) - (before.user + before.system)) / (t1 - t0)
    assert cores < 0.3, f"an idle agent used {cores:.2f} of a core (a spinning progress thread uses ~1)"
