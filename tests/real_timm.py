"""timm's own ResNet-18, ConvNeXt-Atto and ViT-Tiny (``timm.create_model(..., pretrained=False)``: random init, no
download) as ``(model, inputs, loss_fn)`` for the tests and benchmarks, at small images so a CPU step is quick.

timm needs torchvision, and the torchvision 0.28.0 wheel pip finds (PyPI's Linux build; the CPU builds are on
download.pytorch.org, which the package registry here does not mirror) is built against CUDA torch: beside the CPU
torch this project pins, its C++ ops (``nms``, ``roi_align``, ...) cannot load, and ``import
torchvision`` stops at the one registration that does not check for them (``register_fake("torchvision::nms")`` and
``qnms``). transformers imports torchvision wherever it is installed, so installed beside it that wheel would break
every transformers model. ``make install`` therefore puts timm and torchvision in a directory of their own,
``<venv>/timm-packages`` (``TIMM_PACKAGES``), which only :func:`import_timm` adds to ``sys.path``; it declares those
two schemas (no kernel: calling them raises) before importing torchvision. The classification models here never call
a torchvision op. Where timm is missing, tests skip, but not under CI (``CI`` set): there a missing timm fails, so the
suite cannot pass without the models it claims to test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["MODELS", "TIMM_PACKAGES", "build", "convnext_atto", "import_timm", "resnet18", "vit_tiny"]

# timm's name and the keyword arguments that size it for a small image
MODELS = {"resnet18": ("resnet18", {}), "convnext_atto": ("convnext_atto", {}),
          "vit_tiny": ("vit_tiny_patch16_224", {"img_size": None})}
_TORCHVISION_OPS_WITHOUT_CHECK = ("nms", "qnms")
_schemas: list = []  # the Library holding the declared schemas must stay alive
#: where make install puts timm and torchvision (see the module docstring)
TIMM_PACKAGES = Path(sys.prefix) / "timm-packages"


def _declare_torchvision_ops() -> None:
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in _TORCHVISION_OPS_WITHOUT_CHECK:
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _schemas.append(lib)


def import_timm() -> ModuleType:
    """``timm``, importing torchvision without its C++ ops where they cannot load (see the module docstring); skips the
    calling test where timm is not installed, unless ``CI`` is set."""
    if TIMM_PACKAGES.is_dir() and str(TIMM_PACKAGES) not in sys.path:
        sys.path.append(str(TIMM_PACKAGES))  # after site-packages: it adds only timm and torchvision
    try:
        import torchvision  # noqa: F401
    except RuntimeError as e:
        if "operator torchvision::" not in str(e) or _schemas:
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _declare_torchvision_ops()
        import torchvision  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
    try:
        import timm
    except ImportError:
        if os.environ.get("CI"):
            raise
        import pytest

        pytest.skip("timm is not installed (make install installs it)")
    return timm


def build(name: str, batch: int, image: int, seed: int = 0, device: str = "cpu", classes: int = 1000, **timm_kwargs):
    """timm's ``name`` (a key of ``MODELS``; ``timm_kwargs`` go to ``timm.create_model``, e.g. ``patch_size``) with
    random init from ``seed``, a batch of random images and labels, and cross-entropy: ``(model, (x,), loss_fn)``."""
    timm = import_timm()
    timm_name, kwargs = MODELS[name]
    kwargs = {k: image if v is None else v for k, v in kwargs.items()} | timm_kwargs
    torch.manual_seed(seed)
    model = timm.create_model(timm_name, pretrained=False, num_classes=classes, **kwargs).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(batch, 3, image, image, generator=g), torch.randint(0, classes, (batch,), generator=g)
    x, y = x.to(device), y.to(device)
    return model, (x,), lambda out: F.cross_entropy(out, y)


def resnet18(batch: int = 8, image: int = 64, seed: int = 0, device: str = "cpu"):
    return build("resnet18", batch, image, seed, device)


def convnext_atto(batch: int = 4, image: int = 64, seed: int = 0, device: str = "cpu"):
    return build("convnext_atto", batch, image, seed, device)


def vit_tiny(batch: int = 4, image: int = 96, seed: int = 0, device: str = "cpu", patch: int = 16):
    return build("vit_tiny", batch, image, seed, device, patch_size=patch)
