"""Small transformers GPT-2 and ViT with their inputs, for plans over fine units (attention, norms and MLP apart)."""

from __future__ import annotations

import torch

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def gpt2_step(model):
    return model(input_ids=IDS, labels=IDS).loss, None


def vit(transformers):
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
LABELS = torch.tensor([0, 2])


def vit_step(model):
    return model(pixel_values=PIXELS, labels=LABELS).loss, None
