"""No plan depends on the clock: the default search (and, with ``--optimal``, the exact planner) gives the same plan on
a quiet machine and with two processes burning the CPU beside it.

Models: the zoo GPT and a transformers GPT-2 (random init, no download; d_model 64, batch 2 x 32, Adam) profiled with
``units="fine"`` (the zoo GPT splits a block into 4 units, GPT-2 into 7): 6 / 4 layers (24 / 28 units) and 42 / 24
layers (168 units each). Per case: ``memopt.search(prof, "50%", seed=0)`` with every default, run quiet, then with two
CPU burners (``python -c "while True: pass"``) running beside it; whether the plans are equal (decisions, placements,
predicted step time), the seconds of each, what ended the polish's MILPs and the predicted step time.

    python benchmarks/solver_determinism.py                    # all four cases
    python benchmarks/solver_determinism.py --cases zoo_gpt-24 --optimal
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb.harness.load import cpu_burners  # noqa: E402

#: name -> (model, layers); the number after the dash is the fine units it gives
CASES = {"zoo_gpt-24": ("zoo", 6), "hf_gpt2-28": ("hf", 4), "zoo_gpt-168": ("zoo", 42), "hf_gpt2-168": ("hf", 24)}


def fine_profile(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "zoo":
        m = memopt.zoo.gpt(batch_size=2, seq_len=32, vocab=128, d_model=64, n_layers=layers, n_heads=4)
        model, inputs, loss_fn = m.model, m.inputs, m.loss_fn
    else:
        import transformers

        config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_layer=layers, n_embd=64, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        inputs, loss_fn = (ids,), (lambda out: out.logits.float().logsumexp(-1).mean())
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)


def timed(fn, prof):
    t0 = time.perf_counter()
    plan = fn(prof)
    return plan, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--optimal", action="store_true", help="the exact planner (solvers.optimal at 50 %%) too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    planners = {"search": lambda p: memopt.search(p, "50%", seed=0)}
    if args.optimal:
        planners["optimal"] = lambda p: memopt.solvers.optimal(p, "50%")
    print("| case | units | planner | plans equal | seconds quiet / loaded | what ended the MILPs | step ms |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        prof = fine_profile(*CASES[name])
        for label, fn in planners.items():
            quiet, quiet_s = timed(fn, prof)
            with cpu_burners():
                loaded, loaded_s = timed(fn, prof)
            same = loaded == quiet and loaded.predicted_step_time == quiet.predicted_step_time
            stops = sorted({*(quiet.meta.get("polish_placement_stops") or []),
                            *(loaded.meta.get("polish_placement_stops") or []),
                            *[p.meta[k] for p in (quiet, loaded) for k in ("solver_stop",) if k in p.meta]})
            print(f"| {name} | {prof.n_units} | {label} | {'yes' if same else 'NO'} | {quiet_s:.1f} / {loaded_s:.1f} "
                  f"| {', '.join(stops) or 'no MILP'} | {quiet.predicted_step_time * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
