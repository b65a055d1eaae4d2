"""The emulated device's count against torch's own: one training step under a plan, counted at once by this project's
meter (``runtime/memory.py``, the one ``profile`` and ``measure`` use), by ``memopt.limit_memory``, and by
``torch.distributed._tools.mem_tracker.MemTracker`` (torch's module-and-phase memory tracker; it works on the CPU),
beside the simulator's prediction from the profile.

MemTracker and the meter both follow every storage an operator outputs, with weak references; they share no code.
Each is told of the tensors that exist before the step as ``measure`` tells its meter: the model, the optimizer and
the inputs. The limit also counts any tensor an operator reads, so it counts the labels a loss function holds even
where no operator outputs a view of them (``cross_entropy(out, y)``): it may exceed the meter by at most their bytes.

MemTracker never sees the storages the swap and state engines make outside any operator (``torch.UntypedStorage(n)``:
a tensor brought back from the host store, a state slot refilled), which the project's meters hear of through
``note_device_storage``. The column "MemTracker told" passes it those same notices and nothing else; "MemTracker
alone" does not. MemTracker's module hooks (``ModTracker``) are part of the step they watch: each step is also
counted without MemTracker, as ``measure`` counts it, beside the prediction. The plans are the uniform recompute
and swap plans on the profile's units and a whole-step plan moving optimizer state, gradients and parameters
(``MIXED`` below).

    python benchmarks/independent_meter.py            # the zoo, HF GPT-2 and Llama, timm's ConvNeXt-Atto
    python benchmarks/independent_meter.py --models gpt,mlp

``tests/test_independent_meter.py`` asserts the agreement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import md_table
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

import memopt_nb as memopt
from memopt_nb.core.plan import Plan, optimizer_fingerprint
from memopt_nb.runtime.memory import _LISTENERS, meter_for
from memopt_nb.runtime.step import training_step

#: per unit, cycled: (strategy, optimizer state, gradients, parameters) of the whole-step plan
MIXED = [("recompute", "offload", "offload", "resident"), ("swap", "resident", "resident", "offload"),
         ("keep", "offload", "offload", "offload"), ("recompute", "resident", "offload", "offload")]
PLANS = ("none", "recompute", "swap", "whole step")
ZOO = {"mlp": dict(batch_size=8, width=32, depth=4),
       "gpt": dict(batch_size=2, seq_len=16, d_model=32, n_layers=4, n_heads=2, vocab=64),
       "resnet": dict(batch_size=4, widths=(8, 16), blocks_per_stage=2),
       "vit": dict(batch_size=4, d_model=32, n_layers=4, n_heads=2),
       "unet": dict(batch_size=2, widths=(8, 16), image=16)}
MODELS = (*ZOO, "hf-gpt2", "hf-llama", "timm-convnext_atto")


@dataclasses.dataclass
class Case:
    """A step to count: ``loss_fn(model(*args, **kwargs))``, and the tensors the loss function holds (labels)."""

    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    labels: list[torch.Tensor]

    @property
    def inputs(self) -> list[torch.Tensor]:
        return [*self.args, *(v for v in self.kwargs.values() if isinstance(v, torch.Tensor))]


def _closure_tensors(fn: Callable) -> list[torch.Tensor]:
    cells = getattr(fn, "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]


def build(name: str) -> Case:
    """The model ``name`` (one of ``MODELS``) with seed 0: small enough for seconds per step."""
    if name in ZOO:
        z = memopt.zoo.build(name, seed=0, **ZOO[name])
        return Case(z.model, z.inputs, {}, z.loss_fn, _closure_tensors(z.loss_fn))
    if name.startswith("hf-"):
        import transformers

        torch.manual_seed(0)
        if name == "hf-gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_layer=2,
                                                                         n_embd=64, n_head=4))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64))
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        kwargs = {"input_ids": ids, "labels": ids}
        return Case(model, (), kwargs, lambda out: out.loss, [])  # the labels are an input
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import real_timm

    model, inputs, loss_fn = real_timm.build(name.removeprefix("timm-"), batch=2, image=32)
    return Case(model, inputs, {}, loss_fn, _closure_tensors(loss_fn))


class _TellMemTracker:
    """Passes MemTracker the notices the project's meters get of storages made outside any operator."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker

    def note(self, st: torch.UntypedStorage) -> None:
        with torch._C._DisableTorchDispatch():
            t = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
        self.tracker._track(_MemRefType.ACT, t)
        self.tracker._update_peak_stats(None)


def _step(case: Case, opt: torch.optim.Optimizer) -> None:
    """The step ``profile`` and ``measure`` run (the loss is alive until the optimizer has stepped)."""
    training_step(case.model, case.args, case.loss_fn, opt, kwargs=case.kwargs)


def count(name: str, plan: Plan | None, tracker: str) -> dict[str, int]:
    """One warm-up step, then one step counted by the meter and the limit at once (all under ``plan``), and by
    MemTracker unless ``tracker`` is ``"none"``: ``"told"`` passes it the storages the engines make outside operators,
    ``"alone"`` does not."""
    case = build(name)
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    applied = memopt.plan(plan, case.model, optimizer=opt) if plan is not None else contextlib.nullcontext()
    with applied:
        _step(case, opt)  # the optimizer's state exists, the plan's state placements are in force
        gc.collect()
        mt = MemTracker() if tracker != "none" else None
        if mt is not None:
            mt.track_external(case.model, opt, *case.inputs)
        meter = meter_for("cpu")
        meter.track(case.model, opt, *case.inputs)
        listener = _TellMemTracker(mt)
        if tracker == "told":
            _LISTENERS.append(listener)
        try:
            with mt if mt is not None else contextlib.nullcontext(), memopt.limit_memory(1 << 40) as lim, meter:
                _step(case, opt)
        finally:
            if tracker == "told":
                _LISTENERS.remove(listener)
    out = {"meter": meter.peak, "limit": lim.peak_bytes, "label_bytes": sum(t.nbytes for t in case.labels)}
    if mt is not None:
        out["memtracker"] = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return out


def plans_for(name: str) -> tuple[memopt.ModelProfile, dict[str, Plan | None]]:
    """The profile of ``name`` (units as profile picks them) and the four plans on it."""
    case = build(name)
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    prof = memopt.profile(case.model, *case.args, model_kwargs=case.kwargs, loss_fn=case.loss_fn, optimizer=opt,
                          repeats=1)
    keep = Plan.uniform(prof, "keep")
    rows = (MIXED[i % len(MIXED)] for i in range(len(keep.units)))
    decisions = tuple(dataclasses.replace(d, strategy=s, optimizer=o, grads=g, params=q)
                      for d, (s, o, g, q) in zip(keep.decisions, rows, strict=True))
    whole = keep.with_meta(decisions=decisions, optimizer_fingerprint=optimizer_fingerprint(opt))
    return prof, {"none": None, "recompute": Plan.uniform(prof, "recompute"), "swap": Plan.uniform(prof, "swap"),
                  "whole step": whole}


def cross_check(name: str, plan_names: tuple[str, ...] = PLANS) -> list[dict[str, Any]]:
    """Per plan: the predicted peak; the meter's, the limit's and MemTracker's with MemTracker told; MemTracker's and
    the meter's with MemTracker alone; the meter's and the limit's without MemTracker (``_plain``)."""
    prof, plans = plans_for(name)
    out = []
    for pn in plan_names:
        plan = plans[pn]
        told, alone, plain = (count(name, plan, tracker=t) for t in ("told", "alone", "none"))
        predicted = memopt.simulate(prof, plan if plan is not None else memopt.solvers.none(prof)).peak_bytes
        out.append({"model": name, "plan": pn, "predicted": predicted, **told, "memtracker_alone": alone["memtracker"],
                    "meter_alone": alone["meter"], "meter_plain": plain["meter"], "limit_plain": plain["limit"]})
    return out


def _cell(r: dict[str, Any]) -> str:
    """MemTracker told, ``=`` where the meter, and the prediction and the meter without MemTracker, are the same bytes
    (else the differences), and the limit's excess over the meter where it has one."""
    same = r["predicted"] == r["meter"] == r["memtracker"] == r["meter_plain"]
    out = f"{r['memtracker']:,}" + (" =" if same else f" (meter {r['meter'] - r['memtracker']:+,}, "
                                                      f"predicted {r['predicted'] - r['memtracker']:+,}, "
                                                      f"without MemTracker {r['meter_plain'] - r['memtracker']:+,})")
    return out + (f" L{r['limit'] - r['meter']:+,}" if r["limit"] != r["meter"] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        res = {r["plan"]: r for r in cross_check(name)}
        alone = [f"{res[p]['memtracker_alone'] - res[p]['meter_alone']:+,}" for p in ("swap", "whole step")]
        rows.append([name, *(_cell(res[p]) for p in PLANS), " / ".join(alone)])
        print(*res.values(), sep="\n", flush=True)
    print(md_table(["model", *(f"{p}: MemTracker told" for p in PLANS), "MemTracker alone − meter (swap / whole)"],
                   rows))
    print("bytes at the step's peak; '=': predicted = meter = MemTracker told = meter without MemTracker, to the byte; "
          "'L+n': limit_memory counted n bytes more than the meter (labels only an operator reads)")


if __name__ == "__main__":
    main()
