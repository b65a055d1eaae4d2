"""The zoo's fixed-state-heavy models have the shapes they are named after, and their state dominates the step."""

import pytest
import torch

import memopt_nb as memopt


# published parameter counts: torchvision resnet18 exactly (same layers); ViT-Ti/16 5.7 M and ConvNeXt-Atto 3.7 M at
# 224 px (ours differ only in the patch embedding and position table of 64 px inputs)
@pytest.mark.parametrize("name, params, tolerance", [("resnet18", 11_689_512, 0), ("vit_tiny", 5.7e6, 0.03),
                                                     ("convnext_atto", 3.7e6, 0.01)])
def test_state_heavy_models_have_their_namesakes_shapes(name, params, tolerance):
    z = memopt.zoo.build(name, batch_size=2)
    assert abs(sum(p.numel() for p in z.model.parameters()) - params) <= tolerance * params
    loss = z.loss_fn(z.model(*z.inputs))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in z.model.parameters())


@pytest.mark.slow
def test_state_heavy_models_are_state_heavy():
    z = memopt.zoo.build("convnext_atto")
    opt = torch.optim.Adam(z.model.parameters())
    prof = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt, repeats=1)
    fixed = prof.param_bytes + prof.grad_bytes + prof.optimizer_state_bytes
    assert fixed >= 0.8 * prof.peak_bytes


def test_unknown_zoo_name_lists_every_model():
    with pytest.raises(memopt.MemoptError, match="resnet18, vit_tiny, convnext_atto"):
        memopt.zoo.build("resnet50")
