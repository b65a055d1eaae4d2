"""timm's ResNet-18, ConvNeXt-Atto and ViT-Tiny, module for module (names, nesting, in-place activations, Identity
placeholders and the forward code of timm's ``BasicBlock``, ``ConvNeXtBlock`` and ``Block``), so the tests exercise
what a timm user brings without installing timm (it pulls a CUDA torch here). Random init, small images.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["convnext_atto", "resnet18", "vit_tiny"]


# ---------------------------------------------------------------------- ResNet-18 (timm.models.resnet)
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.drop_block = nn.Identity()
        self.act1 = nn.ReLU(inplace=True)
        self.aa = nn.Identity()
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.se = None
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.drop_block(x)
        x = self.act1(x)
        x = self.aa(x)
        x = self.conv2(x)
        x = self.bn2(x)
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        x += shortcut
        x = self.act2(x)
        return x


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (2, 2, 2, 2), num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or inplanes != planes:
                down = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))
            blocks = [BasicBlock(inplanes, planes, stride, down)] + [BasicBlock(planes, planes) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
            inplanes = planes
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.global_pool(x).flatten(1))


# ---------------------------------------------------------------------- ConvNeXt-Atto (timm.models.convnext)
class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, ls_init_value: float = 1e-6):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim))
        self.shortcut = nn.Identity()
        self.drop_path = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.mlp(x)
        x = x.permute(0, 3, 1, 2)
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        return self.drop_path(x) + self.shortcut(shortcut)


class ConvNeXtStage(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, depth: int, first: bool):
        super().__init__()
        self.downsample = nn.Identity() if first else nn.Sequential(LayerNorm2d(in_chs, eps=1e-6),
                                                                    nn.Conv2d(in_chs, out_chs, 2, stride=2))
        self.blocks = nn.Sequential(*[ConvNeXtBlock(out_chs) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (40, 80, 160, 320), depths: tuple[int, ...] = (2, 2, 6, 2),
                 num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        chs = [dims[0], *dims]
        self.stages = nn.Sequential(*[ConvNeXtStage(chs[i], chs[i + 1], d, i == 0) for i, d in enumerate(depths)])
        self.head = nn.ModuleDict({"global_pool": nn.AdaptiveAvgPool2d(1), "norm": LayerNorm2d(dims[-1], eps=1e-6),
                                   "flatten": nn.Flatten(1), "drop": nn.Dropout(0.0),
                                   "fc": nn.Linear(dims[-1], num_classes)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        h = self.head
        return h["fc"](h["drop"](h["flatten"](h["norm"](h["global_pool"](x)))))


# ---------------------------------------------------------------------- ViT-Tiny (timm.models.vision_transformer)
class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class VisionTransformer(nn.Module):
    def __init__(self, image: int = 96, patch: int = 16, dim: int = 192, depth: int = 12, num_heads: int = 3,
                 num_classes: int = 1000):
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*[Block(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc_norm = nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks(self.pos_drop(x + self.pos_embed))
        x = self.norm(x)
        return self.head(self.head_drop(self.fc_norm(x[:, 0])))


# ---------------------------------------------------------------------- builders: (model, inputs, loss_fn)
def _batch(batch: int, image: int, classes: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(batch, 3, image, image, generator=g), torch.randint(0, classes, (batch,), generator=g)
    return x.to(device), y.to(device)


def resnet18(batch: int = 8, image: int = 64, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    model = ResNet().to(device)
    x, y = _batch(batch, image, 1000, seed, device)
    return model, (x,), lambda out: F.cross_entropy(out, y)


def convnext_atto(batch: int = 4, image: int = 64, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    model = ConvNeXt().to(device)
    x, y = _batch(batch, image, 1000, seed, device)
    return model, (x,), lambda out: F.cross_entropy(out, y)


def vit_tiny(batch: int = 4, image: int = 96, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    model = VisionTransformer(image=image).to(device)
    x, y = _batch(batch, image, 1000, seed, device)
    return model, (x,), lambda out: F.cross_entropy(out, y)
