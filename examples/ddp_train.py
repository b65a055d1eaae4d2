"""Train a zoo model on several ranks under a memory plan, with DDP or FSDP2.

    torchrun --nproc_per_node=2 examples/ddp_train.py            # DistributedDataParallel
    torchrun --nproc_per_node=2 examples/ddp_train.py --fsdp     # FSDP2: fully_shard on every unit, then the root

CPU with the gloo backend (CUDA with NCCL when there is a GPU per rank). Every rank builds the same model and
trains on its own batch. Rank 0 profiles the plain model and makes a mixed plan (keep / recompute / swap) or
loads one (``--plan plan.json``, e.g. searched with ``memopt.search(memopt.distributed.per_rank(prof, 2, "fsdp"),
...)``); every rank receives it, wraps or shards its model, and trains under ``with memopt.plan(p, model):``.
Printed per rank: the measured peak with and without the plan, what ``memopt.distributed.per_rank`` and the
simulator predicted, and whether the parameters after training equal those of the same training without a plan.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import memopt_nb as memopt
except ImportError:  # run from a checkout that is not installed: the package is next to examples/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import memopt_nb as memopt

from memopt_nb import distributed as mdist
from memopt_nb.core.plan import Plan

# a mixed plan: repeated over the units
PATTERN = ["swap", "recompute", "keep", "swap", "recompute", "keep"]


def build(args: argparse.Namespace, rank: int, device: torch.device) -> memopt.zoo.ZooModel:
    """The same model on every rank (seed 0), each rank's own batch (seed 1 + rank)."""
    kw = dict(batch_size=args.batch_size, device=device)
    if args.model == "gpt":
        kw.update(seq_len=64, d_model=128, n_layers=4)
    model = memopt.zoo.build(args.model, seed=0, **kw).model
    data = memopt.zoo.build(args.model, seed=1 + rank, **kw)
    return memopt.zoo.ZooModel(model, data.inputs, data.loss_fn, data.name)


def wrap(model: torch.nn.Module, units: Plan, fsdp: bool, device: torch.device) -> torch.nn.Module:
    if fsdp:
        return mdist.fully_shard_units(model, units)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def train(zm: memopt.zoo.ZooModel, model: torch.nn.Module, plan: Plan | None, steps: int, rank: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1000 + rank)  # dropout masks: per rank, the same with and without the plan
    losses = []

    def loop() -> None:
        for _ in range(steps):
            loss = zm.loss_fn(model(*zm.inputs))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())

    if plan is None:
        loop()
    else:
        with memopt.plan(plan, model):  # applied after wrapping / sharding: the order that works
            loop()
    return losses


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by plain name: a DDP replica's, or its FSDP2 shards (both runs shard alike)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[name.removeprefix("module.")] = t.detach().cpu().clone()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--model", default="gpt", choices=memopt.zoo.MODELS)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plan", help="a plan file (Plan.save) to use instead of the built-in mixed pattern")
    ap.add_argument("--json", help="rank 0 writes the per-rank figures here")
    ap.add_argument("--save-params", metavar="DIR", help="each rank writes its parameters after training without and "
                    "with the plan to DIR/rank<r>.pt ({'no_plan': {...}, 'plan': {...}}), to compare them elsewhere")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
        sharding = "fsdp" if args.fsdp else "ddp"

        # 1. profile and plan the plain model (rank 0), send the plan to every rank
        zm = build(args, rank, device)
        plan = None
        if rank == 0:
            opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
            prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
            if args.plan:
                plan = Plan.load(args.plan)
                plan.validate(zm.model)  # made for this model and these units, or a clear error now
            else:
                plan = Plan.from_strategies(prof, (PATTERN * prof.n_units)[: prof.n_units], method="mixed")
        plan = mdist.broadcast_plan(plan, src=0, model=zm.model)

        # 2. the same training without and with the plan, each on a fresh replica wrapped / sharded
        ref_model = wrap(build(args, rank, device).model, plan, args.fsdp, device)
        ref_losses = train(zm, ref_model, None, args.steps, rank)
        ref = local_params(ref_model)
        model = wrap(zm.model, plan, args.fsdp, device)
        losses = train(zm, model, plan, args.steps, rank)
        got = local_params(model)
        diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
        exact = all(torch.equal(ref[k], got[k]) for k in ref)
        if args.save_params:
            torch.save({"no_plan": ref, "plan": got}, Path(args.save_params) / f"rank{rank}.pt")

        # 3. per-rank peak: measured on each rank, and predicted from the plain profile
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        base = memopt.measure(model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=1)
        under = memopt.measure(model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=1)
        if rank == 0:
            ddp_kw = {} if args.fsdp else {"ddp": model}
            rank_prof = mdist.per_rank(prof, world, sharding, **ddp_kw)
            state = [q.param_bytes + q.grad_bytes + q.optimizer_state_bytes for q in (prof, rank_prof)]
            predicted = [memopt.simulate(rank_prof, plan).peak_bytes, rank_prof.peak_bytes, *state]
        else:
            predicted = [None] * 4
        dist.broadcast_object_list(predicted, src=0)

        row = {"rank": rank, "sharding": sharding, "plan": plan.summary(), "peak_no_plan": base.peak_bytes,
               "peak_plan": under.peak_bytes, "predicted_plan": predicted[0], "predicted_no_plan": predicted[1],
               "state_plain": predicted[2], "state_rank": predicted[3],
               "params_equal": exact, "max_param_diff": diff, "losses": losses, "ref_losses": ref_losses,
               "swap": {k: under.swap_stats.get(k, 0) for k in ("offloaded_bytes", "on_demand")}}
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            fb = memopt.format_bytes
            print(f"{sharding.upper()} on {world} ranks ({backend}), zoo '{args.model}', {plan.summary()}")
            for r in rows:
                err = (r["predicted_plan"] - r["peak_plan"]) / r["peak_plan"]
                err0 = (r["predicted_no_plan"] - r["peak_no_plan"]) / r["peak_no_plan"]
                print(f"  rank {r['rank']}: peak {fb(r['peak_plan'])} under the plan, predicted "
                      f"{fb(r['predicted_plan'])} ({err:+.1%}); no plan {fb(r['peak_no_plan'])}, predicted "
                      f"{fb(r['predicted_no_plan'])} ({err0:+.1%}); parameters after {args.steps} steps "
                      f"{'match exactly' if r['params_equal'] else 'DIFFER'} the no-plan run "
                      f"(max |diff| {r['max_param_diff']:.1e})")
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
        ok = all(r["params_equal"] or r["max_param_diff"] < 1e-5 for r in rows)
        # every rank's collectives done, and FSDP2's state (it references asynchronous gloo work) gone before the
        # group is: without this, gloo aborted the process at exit in 3 of 6 FSDP2 runs ("terminate called ...")
        dist.barrier()
        del model, ref_model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
