"""Small but real architectures, built from code (no downloads), sized to train on two CPU cores in seconds.

Each builder returns a :class:`ZooModel` ``(model, inputs, loss_fn, name)``: call ``loss_fn(model(*inputs))`` to get
the training loss. Data is random but seeded, so the same seed gives the same model and batch; ``device="cuda"`` puts
model, inputs and targets on a GPU.

* ``gpt`` — GPT-style decoder: token + position embedding, pre-norm blocks with causal self-attention (explicit softmax,
  attention and residual dropout) and a GELU MLP, LM head, cross-entropy.
* ``resnet`` — ResNet-style CNN for 32×32 images: BasicBlocks with BatchNorm in three stages, cross-entropy.
* ``vit`` — ViT-style encoder: 4×4 patches, class token, pre-norm attention blocks, cross-entropy.
* ``unet`` — U-Net: encoder and decoder blocks with BatchNorm and skip connections, MSE to a target image.
* ``mlp`` — residual MLP blocks with dropout, cross-entropy.

Fixed-state-heavy models (:data:`STATE_HEAVY`), with the layer shapes of well-known image models at a small batch and
image, so that parameters, gradients and Adam state are most of a training step's memory (what whole-step plans are
for). They are built here, not imported: no torchvision or timm needed.

* ``resnet18`` — ResNet-18's shapes (7×7 stem, max-pool, BasicBlocks 64–512 wide, 2 per stage; 11.7 M parameters).
* ``vit_tiny`` — ViT-Tiny's shapes (width 192, 12 blocks, 3 heads, MLP ×4; 5.6 M parameters) on 8×8 patches.
* ``convnext_atto`` — ConvNeXt-Atto's shapes (widths 40–320, blocks 2/2/6/2, 7×7 depthwise convolutions, LayerNorm,
  layer scale; 3.7 M parameters), its MLP as ``Linear`` layers where timm has 1×1 convolutions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import MemoptError

__all__ = ["BUILDERS", "BasicBlock", "CausalSelfAttention", "ConvNeXt", "ConvNeXtBlock", "DoubleConv", "Down", "GPT",
           "LayerNorm2d", "MLP", "MLPBlock", "MODELS", "ResNet", "STATE_HEAVY", "TransformerBlock", "UNet", "Up",
           "ViT", "ZooModel", "build", "convnext_atto", "gpt", "mlp", "resnet", "resnet18", "unet", "vit",
           "vit_tiny"]


class ZooModel(NamedTuple):
    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    name: str


# ---------------------------------------------------------------------- transformer parts
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, causal: bool, max_len: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.causal = causal
        if causal:
            self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.n_heads))
        if self.causal:
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, causal: bool, max_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, causal, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            [TransformerBlock(d_model, n_heads, dropout, True, seq_len) for _ in range(n_layers)]
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, d_model: int, n_layers: int, n_heads: int, classes: int,
                 dropout: float) -> None:
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(3, d_model, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, n + 1, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            [TransformerBlock(d_model, n_heads, dropout, False, n + 1) for _ in range(n_layers)]
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


# ---------------------------------------------------------------------- CNN parts
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int,
                 imagenet_stem: bool = False) -> None:
        super().__init__()
        if imagenet_stem:  # 7×7 stride-2 convolution and a max-pool, as ResNet-18 on ImageNet
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU())
        stages = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks = [BasicBlock(cin, w, 1 if i == 0 else 2)] + [BasicBlock(w, w) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, widths: tuple[int, ...], depths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 4, 4), LayerNorm2d(widths[0]))
        self.downsample = nn.ModuleList([nn.Identity()] + [
            nn.Sequential(LayerNorm2d(widths[i - 1]), nn.Conv2d(widths[i - 1], widths[i], 2, 2))
            for i in range(1, len(widths))])
        self.blocks = nn.ModuleList([ConvNeXtBlock(w) for w, d in zip(widths, depths, strict=True) for _ in range(d)])
        self.stage_of = [i for i, d in enumerate(depths) for _ in range(d)]
        self.norm = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        stage = 0
        for block, s in zip(self.blocks, self.stage_of, strict=True):
            if s != stage:
                stage = s
                x = self.downsample[s](x)
            x = block(x)
        return self.head(self.norm(x.mean((2, 3))))


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Down(nn.Module):
    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        super().__init__()
        self.pool = pool
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2) if self.pool else x)


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = DoubleConv(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        chans = (3,) + widths
        self.down = nn.ModuleList([Down(chans[i], chans[i + 1], pool=i > 0) for i in range(len(widths))])
        self.up = nn.ModuleList([Up(widths[i], widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.out = nn.Conv2d(widths[0], 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        skips.pop()
        for block in self.up:
            x = block(x, skips.pop())
        return self.out(x)


class MLPBlock(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([MLPBlock(width, dropout) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ---------------------------------------------------------------------- builders
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gpt(batch_size: int = 8, seq_len: int = 128, vocab: int = 256, d_model: int = 128, n_layers: int = 6,
        n_heads: int = 4, dropout: float = 0.1, seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    """GPT-style decoder (about 1.2 M parameters at the defaults)."""
    torch.manual_seed(seed)
    model = GPT(vocab, seq_len, d_model, n_layers, n_heads, dropout)
    g = _gen(seed + 1)
    idx = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    target = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    return ZooModel(model.to(device), (idx,),
                    lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)), "gpt")


def resnet(batch_size: int = 32, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2,
           classes: int = 10, seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    """ResNet-style CNN on 32×32 images, BatchNorm throughout."""
    torch.manual_seed(seed)
    model = ResNet(widths, blocks_per_stage, classes)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "resnet")


def vit(batch_size: int = 16, image: int = 32, patch: int = 4, d_model: int = 128, n_layers: int = 6,
        n_heads: int = 4, classes: int = 10, dropout: float = 0.1, seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    """ViT-style encoder on 32×32 images (65 tokens)."""
    torch.manual_seed(seed)
    model = ViT(image, patch, d_model, n_layers, n_heads, classes, dropout)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "vit")


def unet(batch_size: int = 8, widths: tuple[int, ...] = (16, 32, 64), image: int = 32, seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    """U-Net with skip connections and BatchNorm, MSE to a target image."""
    torch.manual_seed(seed)
    model = UNet(widths)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    target = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.mse_loss(out, target), "unet")


def mlp(batch_size: int = 1024, width: int = 128, depth: int = 8, classes: int = 10, dropout: float = 0.1,
        seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    """Residual MLP with LayerNorm, GELU and dropout."""
    torch.manual_seed(seed)
    model = MLP(width, depth, classes, dropout)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, width, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "mlp")


def resnet18(batch_size: int = 4, image: int = 64, classes: int = 1000, seed: int = 0,
             device: str | torch.device = "cpu") -> ZooModel:
    """ResNet-18's shapes (11.7 M parameters) on small images: fixed state far above the activations."""
    torch.manual_seed(seed)
    model = ResNet((64, 128, 256, 512), 2, classes, imagenet_stem=True)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "resnet18")


def vit_tiny(batch_size: int = 4, image: int = 64, patch: int = 8, classes: int = 1000, seed: int = 0,
             device: str | torch.device = "cpu") -> ZooModel:
    """ViT-Tiny's shapes (width 192, 12 blocks, 3 heads) on 64 patches of 8×8."""
    torch.manual_seed(seed)
    model = ViT(image, patch, 192, 12, 3, classes, 0.0)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "vit_tiny")


def convnext_atto(batch_size: int = 4, image: int = 64, classes: int = 1000, seed: int = 0,
                  device: str | torch.device = "cpu") -> ZooModel:
    """ConvNeXt-Atto's shapes (widths 40, 80, 160, 320; 2, 2, 6, 2 blocks)."""
    torch.manual_seed(seed)
    model = ConvNeXt((40, 80, 160, 320), (2, 2, 6, 2), classes)
    g = _gen(seed + 1)
    x = torch.randn(batch_size, 3, image, image, generator=g).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    return ZooModel(model.to(device), (x,), lambda out: F.cross_entropy(out, y), "convnext_atto")


BUILDERS: dict[str, Callable[..., ZooModel]] = {"gpt": gpt, "resnet": resnet, "vit": vit, "unet": unet, "mlp": mlp,
                                                "resnet18": resnet18, "vit_tiny": vit_tiny,
                                                "convnext_atto": convnext_atto}
#: The activation-heavy demo models every test covers.
MODELS = ("gpt", "resnet", "vit", "unet", "mlp")
#: Models whose parameters, gradients and optimizer state dominate the step (whole-step plans).
STATE_HEAVY = ("resnet18", "vit_tiny", "convnext_atto")


def build(name: str, batch_size: int | None = None, seed: int = 0, **kwargs: Any) -> ZooModel:
    """Build a zoo model by name (``memopt.zoo.MODELS`` or ``memopt.zoo.STATE_HEAVY``), optionally at another batch
    size."""
    if name not in BUILDERS:
        raise MemoptError(f"unknown zoo model {name!r}; choose one of {', '.join(BUILDERS)}")
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    return BUILDERS[name](seed=seed, **kwargs)
