"""The emulated device's count checked by a meter this project did not write: torch's
``torch.distributed._tools.mem_tracker.MemTracker`` counts the same training step beside the project's meter (the one
``profile`` and ``measure`` use) and ``memopt.limit_memory``, under no plan, recompute, swap and a whole-step plan, on
the zoo, HF GPT-2 and Llama, and timm's ConvNeXt-Atto (``benchmarks/independent_meter.py`` runs the step; its table
is in benchmarks/RESULTS.md).

What each count includes, and so what must agree:

* MemTracker and the meter follow every storage an operator outputs, plus the model, optimizer and inputs they are
  given. Told of the storages the swap and state engines make outside any operator (``note_device_storage``, which
  MemTracker cannot see by itself), MemTracker's peak is the meter's to the byte.
* Without MemTracker the meter's peak is the simulator's prediction. MemTracker's module hooks (``ModTracker``) are
  part of the step they watch: where they change its peak, both meters see the same change, pinned in
  :data:`HOOK_EFFECT`.
* Not told, MemTracker counts at most the meter's peak, and exactly it where the plan makes no such storage (no plan,
  recompute).
* ``limit_memory`` also counts a tensor an operator only reads: the labels a loss function holds, where no operator
  outputs a view of them (``cross_entropy(out, y)``). It exceeds the meter by at most those bytes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

#: (model, plan): the meter's peak with MemTracker's module hooks installed minus without, bytes; pinned so that any
#: change shows. On the zoo U-Net's uniform swap plan the hooks (``ModTracker`` alone does it too) add 1 KiB.
HOOK_EFFECT = {("unet", "swap"): 1024}


@pytest.fixture(scope="module")
def im():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling _common
    try:
        spec = importlib.util.spec_from_file_location("independent_meter_under_test",
                                                      ROOT / "benchmarks" / "independent_meter.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclass looks its module up there
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("independent_meter_under_test", None)
        sys.path.remove(str(ROOT / "benchmarks"))


def _check(rows: list[dict]) -> dict[str, dict]:
    by_plan = {r["plan"]: r for r in rows}
    assert set(by_plan) == {"none", "recompute", "swap", "whole step"}
    for r in rows:
        assert r["memtracker"] == r["meter"], r
        assert r["meter_plain"] == r["predicted"], r
        assert r["meter"] - r["meter_plain"] == HOOK_EFFECT.get((r["model"], r["plan"]), 0), r
        assert 0 <= r["limit"] - r["meter"] <= r["label_bytes"], r
        assert 0 <= r["limit_plain"] - r["meter_plain"] <= r["label_bytes"], r
        assert r["memtracker_alone"] <= r["meter_alone"], r
    for plan in ("none", "recompute"):
        assert by_plan[plan]["memtracker_alone"] == by_plan[plan]["meter_alone"], by_plan[plan]
    return by_plan


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "vit", "unet"])
def test_memtracker_counts_the_zoo_step_to_the_byte(im, name):
    by_plan = _check(im.cross_check(name))
    if name == "gpt":  # the swap plan's peak holds storages brought back from the host store: MemTracker alone misses
        r = by_plan["swap"]
        assert r["memtracker_alone"] < r["meter_alone"], r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "timm-convnext_atto"])
def test_memtracker_counts_a_transformers_or_timm_step_to_the_byte(im, name):
    _check(im.cross_check(name))
