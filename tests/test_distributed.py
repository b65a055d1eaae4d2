"""More than one device: DDP and FSDP2 on 2 CPU ranks (gloo), launched by torchrun like a user would.

The 2-rank runs are `examples/ddp_train.py` itself (the README's command), so the example is what is tested.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb import distributed as mdist
from memopt_nb.core.errors import ProfileError, WrapOrderError
from memopt_nb.core.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def _torchrun(tmp: Path, *args: str) -> list[dict]:
    """Rows of both ranks; each row gets ``params``: that rank's parameters after training without and with the plan."""
    out = tmp / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "ddp_train.py"), "--json", str(out), "--save-params", str(tmp), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    for r in rows:
        r["params"] = torch.load(tmp / f"rank{r['rank']}.pt")
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Rows of both ranks, for DDP and for FSDP2 (4 GPT blocks, batch 4 per rank, 3 steps, a mixed plan)."""
    return {s: _torchrun(tmp_path_factory.mktemp(s), *(["--fsdp"] if s == "fsdp" else [])) for s in ("ddp", "fsdp")}


@pytest.mark.slow  # torchrun, 2 ranks
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_mixed_plan_on_two_ranks_trains_like_no_plan(runs, sharding):
    rows = runs[sharding]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert "keep 1" in r["plan"] and "recompute 1" in r["plan"] and "swap 2" in r["plan"]
        assert r["swap"]["offloaded_bytes"] > 0  # the swap units really offloaded on this rank
        assert r["losses"] == r["ref_losses"]
        # the parameters themselves, not the example's verdict on them: bit for bit equal on every rank
        ref, got = r["params"]["no_plan"], r["params"]["plan"]
        assert len(ref) > 0 and ref.keys() == got.keys()
        unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert unequal == [], (sharding, r["rank"], unequal)
        assert r["params_equal"]
        assert r["peak_plan"] < r["peak_no_plan"]
    assert rows[0]["losses"] != rows[1]["losses"]  # each rank trained on its own batch


@pytest.mark.slow  # torchrun, 2 ranks
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_per_rank_prediction_within_the_readme_figure(runs, sharding):
    """README: per-rank peaks predicted by ``per_rank`` + ``simulate`` never more than 0.05% under the measured one,
    and at most 0.1% over it. Two CI runs measured an FSDP2 rank without a plan 6,250 bytes (0.03%)
    above its prediction — not a multiple of 4, so no tensor of the model: a byte buffer of the process group alive
    at the peak on some runs; other runs are exact."""
    for r in runs[sharding]:
        for key in ("plan", "no_plan"):
            measured, predicted = r[f"peak_{key}"], r[f"predicted_{key}"]
            assert measured - predicted <= 5e-4 * measured, (sharding, r["rank"], key, measured, predicted)
            assert predicted - measured <= 1e-3 * measured, (sharding, r["rank"], key, measured, predicted)


@pytest.mark.slow  # torchrun, 2 ranks
def test_fsdp_peak_below_ddp_by_about_the_sharded_state(runs):
    ddp, fsdp = runs["ddp"][0], runs["fsdp"][0]
    sharded = fsdp["state_plain"] - fsdp["state_rank"]  # parameters, gradients, optimizer state: half on each rank
    assert sharded > 0.4 * fsdp["state_plain"]
    for key in ("peak_no_plan", "peak_plan"):
        saved = ddp[key] - fsdp[key]
        # measured 0.979× the sharded state: DDP also holds its gradient buckets, FSDP2 its all-gathered units
        assert 0.9 * sharded <= saved <= 1.05 * sharded, (key, saved, sharded, saved / sharded)


# ---------------------------------------------------------------- one process, world size 1: the order rules
@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _small():
    zm = memopt.zoo.build("gpt", batch_size=2, seq_len=16, d_model=32, n_layers=3)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, repeats=1)
    return zm, prof, Plan.from_strategies(prof, ["swap", "recompute", "keep"])


def test_wrapped_or_sharded_models_cannot_be_profiled(group):

    zm, prof, plan = _small()
    ddp = nn.parallel.DistributedDataParallel(zm.model)
    with pytest.raises(WrapOrderError, match="plain model"):
        memopt.profile(ddp, *zm.inputs, loss_fn=zm.loss_fn)
    sharded = mdist.fully_shard_units(memopt.zoo.build("gpt", batch_size=2, seq_len=16, d_model=32, n_layers=3).model,
                                      plan)
    with pytest.raises(WrapOrderError, match="fully_shard"):
        memopt.profile(sharded, *zm.inputs, loss_fn=zm.loss_fn)
    assert isinstance(WrapOrderError("x"), ProfileError)


def test_plan_applies_through_ddp_and_sharding_inside_a_plan_raises(group):
    from torch.distributed.fsdp import fully_shard

    zm, prof, plan = _small()
    ddp = nn.parallel.DistributedDataParallel(zm.model)
    with memopt.plan(plan, ddp) as applied:  # names resolve through DDP's "module." prefix
        zm.loss_fn(ddp(*zm.inputs)).backward()
    assert applied.stats["offloaded_bytes"] > 0

    fresh = memopt.zoo.build("gpt", batch_size=2, seq_len=16, d_model=32, n_layers=3)
    with memopt.plan(plan, fresh.model):
        fully_shard(fresh.model.get_submodule(plan.units[0]))
        with pytest.raises(WrapOrderError, match="shard first"):
            fresh.model(*fresh.inputs)


def test_fsdp_fingerprint_uses_the_plain_class(group):
    zm, prof, plan = _small()
    sharded = mdist.fully_shard_units(zm.model, plan)
    unit = sharded.get_submodule(plan.units[0])
    assert type(unit).__name__.startswith("FSDP")
    assert mdist.plain_module_type(unit) is type(memopt.zoo.build("gpt", n_layers=1).model.get_submodule("blocks.0"))
    plan.validate(sharded)  # the plan made for the plain model is valid for its sharded form


# ---------------------------------------------------------------- per-rank accounting: arithmetic on a profile
def test_per_rank_accounting(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    same = mdist.per_rank(prof, 4, None)
    assert same.peak_bytes == prof.peak_bytes and same.meta["per_rank"]["world_size"] == 4
    p2, p4 = mdist.per_rank(prof, 2, "fsdp"), mdist.per_rank(prof, 4, "fsdp")
    for q, n in ((p2, 2), (p4, 4)):
        assert q.param_bytes == pytest.approx(prof.param_bytes / n, rel=0.02)
        assert q.optimizer_state_bytes == pytest.approx(prof.optimizer_state_bytes / n, rel=0.02)
    assert p4.peak_bytes < p2.peak_bytes < prof.peak_bytes
    ddp = mdist.per_rank(prof, 2, "ddp", bucket_bytes=1000)
    assert ddp.peak_bytes == prof.peak_bytes + 1000  # buckets live through the whole step
    keep = Plan.uniform(p2, "keep")
    assert memopt.simulate(p2, keep).peak_bytes == p2.peak_bytes
    with pytest.raises(ProfileError, match="sharding must be one of"):
        mdist.per_rank(prof, 2, "zero3")
    with pytest.raises(ProfileError, match="world_size"):
        mdist.per_rank(prof, 0, "fsdp")
    with pytest.raises(ProfileError, match="already per rank"):
        mdist.per_rank(p2, 2, "fsdp")
    assert "per_rank" not in prof.meta  # the plain profile is left as it was


def _ddp_model(name: str) -> memopt.zoo.ZooModel:
    if name == "gpt":
        return memopt.zoo.build("gpt", batch_size=2, seq_len=16, d_model=32, n_layers=3)
    transformers = pytest.importorskip("transformers")  # a model this project did not write
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                  n_positions=32))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return memopt.zoo.ZooModel(model, (ids,), lambda out: out.logits.float().square().mean(), "hf-gpt2")


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_cuda_meter_counts_ddp_buckets_no_tensor_reaches(group, name):
    """DDP allocates its gradient buckets when it wraps the model, before measure() starts its meter, and no tensor
    of the model holds them; the CUDA meter took them for other memory (on an H200 with NCCL, DDP's measured peak
    read 3.3 MiB, the buckets, below the per-rank prediction). measure() now names them to the meter."""
    from memopt_nb.runtime.measure import _ddp_buckets_untracked

    zm = _ddp_model(name)
    assert _ddp_buckets_untracked(zm.model) == 0  # not DDP
    ddp = nn.parallel.DistributedDataParallel(zm.model)
    zm.loss_fn(ddp(*zm.inputs)).backward()  # the first step rebuilds the buckets
    grads = sum(p.numel() * p.element_size() for p in zm.model.parameters() if p.requires_grad)
    assert _ddp_buckets_untracked(ddp) == mdist.ddp_bucket_bytes(ddp) >= grads  # separate from the gradients

    view = nn.parallel.DistributedDataParallel(_ddp_model(name).model, gradient_as_bucket_view=True)
    zm.loss_fn(view(*zm.inputs)).backward()
    assert _ddp_buckets_untracked(view) == 0  # the gradients are the buckets, and tracked through the model
    for p in view.parameters():
        p.grad = None
    assert _ddp_buckets_untracked(view) == mdist.ddp_bucket_bytes(view)


def test_fsdp1_is_refused_by_profile_and_plan_saying_to_use_fsdp2(group):
    """README: "FSDP1 is refused": a model FSDP1-wrapped (flat parameters, renamed modules) cannot be profiled or
    planned, and the error names FSDP2's fully_shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    zm, prof, plan = _small()
    fsdp1 = FSDP(memopt.zoo.build("gpt", batch_size=2, seq_len=16, d_model=32, n_layers=3).model,
                 device_id=torch.device("cpu"))
    with pytest.raises(WrapOrderError, match="FSDP1"):
        memopt.profile(fsdp1, *zm.inputs, loss_fn=zm.loss_fn)
    with pytest.raises(WrapOrderError, match="fully_shard"):
        memopt.plan(plan, fsdp1).apply()
