"""Does a chunked LM head train like the head as written? Loss curves side by side, and how far they drift.

A transformers ``GPT2LMHeadModel`` with its real vocabulary (50257; 2 layers x 64, random init) learns a synthetic
next-token task it can learn (each sequence counts up from a random start among the first ``--tokens`` ids:
``t[i+1] = t[i] + 1`` mod ``--tokens``) for ``--steps`` AdamW
steps (lr 1e-3), twice from the same initial weights and batches: plain, and under a plan whose only change is the
head computed in ``--chunks`` chunks (``Plan.head``; every unit kept). In fp32 and with the model in bf16 (no
autocast: the loss still casts the logits to fp32, as transformers does).

Printed: the loss of both runs every ``--every`` steps, the largest relative difference of the losses over the run,
the first step's (the loss is bit-identical at equal weights), and the largest absolute difference of any parameter
after the last step.

    python benchmarks/head_curve.py                 # 200 steps, fp32 and bf16 (about 3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import md_table, set_threads  # noqa: E402

import memopt_nb as memopt  # noqa: E402


def batches(tokens: int, steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, tokens, (steps, batch, 1), generator=g)
    return list((starts + torch.arange(seq)) % tokens)


def train(model, data, plan=None) -> tuple[list[float], torch.nn.Module]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    ctx = memopt.plan(plan, model, optimizer=opt) if plan is not None else None
    if ctx is not None:
        ctx.apply()
    try:
        for ids in data:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if ctx is not None:
            ctx.remove()
    return losses, model


def run(dtype: torch.dtype, args) -> tuple[list[list], list[float], list[float]]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = transformers.GPT2LMHeadModel(cfg).to(dtype)
    data = batches(args.tokens, args.steps, args.batch, args.seq)
    plain_losses, plain = train(copy.deepcopy(base), data)
    chunked_model = copy.deepcopy(base)
    prof = memopt.profile(chunked_model, input_ids=data[0], labels=data[0], loss_fn=lambda o: o.loss,
                          optimizer=torch.optim.AdamW(chunked_model.parameters(), lr=1e-3), repeats=1)
    plan = dataclasses.replace(memopt.Plan.uniform(prof, "keep"), head={"module": "lm_head", "chunks": args.chunks})
    chunked_losses, chunked = train(chunked_model, data, plan)
    rel = [abs(a - b) / abs(b) for a, b in zip(chunked_losses, plain_losses)]
    param = max((p.float() - q.float()).abs().max().item() for p, q in zip(chunked.parameters(), plain.parameters()))
    name = str(dtype).replace("torch.", "")
    row = [name, args.steps, f"{plain_losses[0]:.6f}", f"{rel[0]:.1e}", f"{max(rel):.1e}",
           f"{plain_losses[-1]:.4f} / {chunked_losses[-1]:.4f}", f"{param:.1e}"]
    return [row], plain_losses, chunked_losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="the ids the task uses (of the 50257)")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)
    rows, curves = [], []
    for dtype in (torch.float32, torch.bfloat16):
        r, plain, chunked = run(dtype, args)
        rows += r
        curves.append((str(dtype).replace("torch.", ""), plain, chunked))
    print(md_table(["dtype", "steps", "first loss", "first step rel. diff", "max rel. loss diff",
                    "last loss plain / chunked", "max param diff"], rows))
    print()
    marks = list(range(0, args.steps, args.every)) + [args.steps - 1]
    head = ["step"] + [f"{d} {k}" for d, _, _ in curves for k in ("plain", "chunked")]
    table = [[s + 1] + [f"{c[s]:.4f}" for _, p, q in curves for c in (p, q)] for s in marks]
    print(md_table(head, table))


if __name__ == "__main__":
    main()
