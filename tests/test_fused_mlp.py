"""The MLP kernel choice (``models.fused_mlp``): refused before the run where it cannot run, wired
into the model's layers where chosen, and (on a GPU with quack) equal to the plain MLP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gen_helpers import local_model
from shardflow.config.load import load_config
from shardflow.models import fused_mlp
from shardflow.models.tiny import make_tiny_checkpoint
from shardflow.runtime.validate import check_config


def plain_swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def test_kernel_choice_and_its_errors(monkeypatch):
    cpu = torch.device("cpu")
    assert fused_mlp.choose("torch", cpu, torch.bfloat16, 64, 96, False) is None
    assert fused_mlp.choose("auto", cpu, torch.float32, 64, 96, False) is None  # no quack on a CPU
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        fused_mlp.choose("fast", cpu, torch.float32, 64, 96, False)
    monkeypatch.setattr(fused_mlp, "quack_available", lambda: False)
    with pytest.raises(ValueError, match="'quack' needs quack's kernels .*not installed"):
        fused_mlp.choose("quack", cpu, torch.float32, 64, 96, False)
    monkeypatch.setattr(fused_mlp, "quack_available", lambda: True)
    with pytest.raises(ValueError, match=r"'quack' does not run here \(cpu, torch.float32, hidden 64, "
                                         r"intermediate 96\): it needs a Hopper"):
        fused_mlp.choose("quack", cpu, torch.float32, 64, 96, False)


def test_quack_without_its_package_is_refused_when_the_settings_are_checked(monkeypatch):
    monkeypatch.setattr(fused_mlp, "quack_available", lambda: False)
    base = {"models": {"actor": {"path": "a"}}, "data": {"path": "d.jsonl"}, "generation": {"samples_per_prompt": 4}}
    with pytest.raises(ValueError, match="models.actor.mlp_kernel 'quack' needs quack's kernels"):
        check_config(load_config(None, ["models.actor.mlp_kernel=quack"], base=base))
    check_config(load_config(None, ["models.actor.mlp_kernel=torch"], base=base))


def test_the_chosen_kernel_runs_in_every_layer_with_the_layers_weights(tmp_path, monkeypatch):
    """With a fused SwiGLU chosen, each layer's MLP runs it on its own gate, up and down weights
    (in that order): the stand-in here is the plain math, so outputs and gradients stay the
    plain model's, and every layer's call is counted."""
    path = tmp_path / "ckpt"
    make_tiny_checkpoint(path, "qwen3")
    model = local_model(str(path))
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, -1)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, positions).float().square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = loss_and_grads()
    calls = []

    def stand_in(x, gate, up, down):
        calls.append((gate.shape, up.shape, down.shape))
        return plain_swiglu(x, gate, up, down)

    monkeypatch.setattr(fused_mlp, "quack_runs", lambda *args: True)
    monkeypatch.setattr(fused_mlp, "swiglu_quack", stand_in)
    model.set_mlp_kernel("auto")
    got_loss, got_grads = loss_and_grads()
    layers = len(model.model.layers)
    inter, hidden = model.shard.intermediate_size, model.cfg.hidden_size
    assert calls == [((inter, hidden), (inter, hidden), (hidden, inter))] * layers
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=0, msg=name)
    model.set_mlp_kernel("torch")
    calls.clear()
    loss_and_grads()
    assert calls == []


@pytest.mark.skipif(not (torch.cuda.is_available() and fused_mlp.quack_available()), reason="needs a GPU and quack")
def test_quack_swiglu_matches_the_plain_mlp_on_the_gpu():
    """bf16 against float32: forward and every gradient within bf16's rounding of the products."""
    device = torch.device("cuda")
    if not fused_mlp.quack_runs(device, torch.bfloat16, 256, 512, False):
        pytest.skip("quack does not run on this GPU")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1000, 256, device=device, generator=g)
    weights = [torch.randn(o, i, device=device, generator=g) * i ** -0.5 for o, i in ((512, 256), (512, 256), (256, 512))]
    grad = torch.randn(1000, 256, device=device, generator=g)
    leaves = [t.bfloat16().requires_grad_() for t in (x, *weights)]
    ref = [t.clone().requires_grad_() for t in (x, *weights)]
    fused_mlp.swiglu_quack(*leaves).backward(grad.bfloat16())
    out = fused_mlp.swiglu_quack(*[t.detach() for t in leaves])
    want = plain_swiglu(*ref)
    want.backward(grad)
    assert (out.float() - want).norm() / want.norm() < 1e-2
    for got, expected in zip(leaves, ref):
        assert (got.grad.float() - expected.grad).norm() / expected.grad.norm() < 2e-2
