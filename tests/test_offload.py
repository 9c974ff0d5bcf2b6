"""Offloading a frozen model frees its parameters' memory and brings back the same values."""

from __future__ import annotations

import pytest
import torch

from shardflow.models.checkpoint import load_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.offload import HostOffload, has_storage
from shardflow.parallel.world import World


def test_offload_and_restore_keep_values_and_parameter_identity(checkpoints):
    path = checkpoints.get("qwen2_pad", "qwen2", vocab_size=130)
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    model = load_model(path, Layout((0,)), world)[0]
    params = dict(model.named_parameters())
    original = {n: p.detach().clone() for n, p in params.items()}
    ids = torch.randint(3, 100, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        before = model(ids, positions)
    total = sum(p.numel() * p.element_size() for p in params.values())

    offload = HostOffload(model)
    assert offload.offload().bytes_copied == total
    assert not any(has_storage(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload()
    assert offload.restore().bytes_copied == total
    assert all(params[n] is p for n, p in model.named_parameters())
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids, positions), before)

    # Unchanged since the last copy: offloading again copies nothing.
    assert offload.offload().bytes_copied == 0
    offload.restore()
    # Changed in place (as a reallocation into it would): that parameter is copied again.
    with torch.no_grad():
        params["model.norm.weight"].add_(1.0)
    stats = offload.offload()
    assert stats.bytes_copied == params["model.norm.weight"].numel() * 4
    offload.restore()
    assert torch.equal(params["model.norm.weight"], original["model.norm.weight"] + 1.0)
