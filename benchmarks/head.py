"""Language models whose peak is in the head: how big a batch trains under a fixed budget, and how fast.

Models (transformers, small bodies, their real vocabularies, random init, nothing downloaded, AdamW lr 1e-3,
``labels=`` loop, ``--seq`` tokens per sample):

* ``gpt2``: ``GPT2LMHeadModel``, 4 layers x 256, vocabulary 50257 (head tied to the embeddings);
* ``llama``: ``LlamaForCausalLM``, 4 layers x 256, vocabulary 32000;
* ``qwen2``: ``Qwen2ForCausalLM``, 4 layers x 128, vocabulary 151936 (Qwen2's default; head not tied).

Per model, at one byte budget (:data:`BUDGETS`, emulated with ``memopt.limit_memory``), the largest batch and its
throughput for:

* ``plain``: plain training (real steps, doubling then bisection);
* ``hf ckpt``: the same with transformers' own activation checkpointing (``activation_checkpointing_enable()``), what a
  user would pick: the head and loss stay as they are;
* ``baseline``: the classic baseline that fits the largest batch (``memopt.max_batch``'s);
* ``memopt``: memopt's plan, the head as written (``memopt.max_batch``, exact);
* ``memopt+head``: memopt's plan that may compute the head and loss in chunks (``max_batch(..., head="chunked")``).

Batches are real: plain and checkpointing run a step inside the limit at each batch tried; ``memopt.max_batch``
verifies its answer with real steps under its plan inside the limit (``verify``). Throughputs are samples per second
of real steps at each method's batch (median of ``--steps``), on this CPU: they say little about a GPU.

``--fit``: instead, the fit check at batch 8 x 128 (gpt2, llama): per model and loop (``loss = model(...).loss``, and
the documentation's loop that keeps ``outputs``, profiled with ``keep_outputs=True``), the smallest peak any plan
reaches with the head as written and chunked (activations only / whole-step), then ``memopt.search`` at 50 % and three
AdamW steps under its plan inside ``memopt.limit_memory`` of that budget against plain training without a limit: the
measured peak, whether the first loss is bit-identical, the largest relative loss and absolute parameter difference.

    python benchmarks/head.py                       # all three models (about 30 min on 2 quiet cores)
    python benchmarks/head.py --models gpt2 --seq 64
    python benchmarks/head.py --fit --models gpt2,llama
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import MiB, md_table, set_threads  # noqa: E402

import memopt_nb as memopt  # noqa: E402

#: the byte budget per model: above its state (parameters, gradients, AdamW), where the batch is what it buys
BUDGETS = {"gpt2": 640 * MiB, "llama": 640 * MiB, "qwen2": 1536 * MiB}


def _model(name: str):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(BUDGETS)}")


def builder(name: str, seq: int):
    def build(b: int):
        model = _model(name)  # built anew (same seed, same weights): no second model held beside the step
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(b))
        return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss)
    return build


def _step(model, opt, inputs) -> None:
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _fits(build, b: int, budget: int, ckpt: bool) -> bool:
    gc.collect()
    model, inputs, _ = build(b)
    if ckpt:
        model.activation_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with memopt.limit_memory(budget):
            _step(model, opt, inputs)
            _step(model, opt, inputs)  # the second step holds the optimizer state from the start
        return True
    except torch.OutOfMemoryError:
        return False


def largest(build, budget: int, ckpt: bool, limit: int = 4096) -> int:
    """The largest batch whose steps run inside ``budget`` (doubling, then bisection); 0 if batch 1 does not."""
    if not _fits(build, 1, budget, ckpt):
        return 0
    lo, hi = 1, 2
    while hi <= limit and _fits(build, hi, budget, ckpt):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(build, mid, budget, ckpt) else (lo, mid)
    return lo


def throughput(build, b: int, steps: int, plan=None, ckpt: bool = False) -> float:
    """Samples per second of real steps at batch ``b`` (median over ``steps`` after one untimed)."""
    if not b:
        return 0.0
    gc.collect()
    model, inputs, _ = build(b)
    if ckpt:
        model.activation_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    ctx = memopt.plan(plan, model, optimizer=opt) if plan is not None else _nothing()
    with ctx:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            _step(model, opt, inputs)
            if i:
                times.append(time.perf_counter() - t0)
    return b / statistics.median(times)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(name: str, seq: int, steps: int) -> list[list]:
    build = builder(name, seq)
    budget = BUDGETS[name]
    rows = []
    t0 = time.perf_counter()
    plain = largest(build, budget, ckpt=False)
    ckpt = largest(build, budget, ckpt=True)
    print(f"{name}: plain {plain}, hf ckpt {ckpt} ({time.perf_counter() - t0:.0f} s)", flush=True)
    answers = {}
    for head in (None, "chunked"):
        t1 = time.perf_counter()
        with memopt.limit_memory(budget):
            res = memopt.max_batch(lambda b: build(b), budget=budget,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), head=head)
        answers[head] = res
        print(f"{name} head={head}: batch {res.batch}, baseline {res.baseline.batch} ({res.baseline.method}), "
              f"plan {res.plan.summary() if res.plan else None}, verified {res.verified} "
              f"({time.perf_counter() - t1:.0f} s)", flush=True)
    base = answers[None].baseline
    entries = [("plain", plain, None, False), ("hf ckpt", ckpt, None, True),
               (f"baseline ({base.method})", base.batch or 0, base.plan, False),
               ("memopt", answers[None].batch or 0, answers[None].plan, False),
               ("memopt+head", answers["chunked"].batch or 0, answers["chunked"].plan, False)]
    for label, b, plan, ck in entries:
        tp = throughput(build, b, steps, plan=plan, ckpt=ck)
        rows.append([name, label, b, f"{b / ckpt:.2f}x" if ckpt else "-", f"{tp:.2f}",
                     "yes" if plan is None or plan.exact else "no (chunked head)"])
        print(rows[-1], flush=True)
    return rows


def fit(name: str, steps: int = 3) -> list[list]:
    """The fit check (see the module docstring) for one model, both loops."""
    base = _model(name)
    ids = torch.randint(0, base.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for s in range(steps):
        torch.manual_seed(s)
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    rows = []
    for keep in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss, optimizer=opt,
                              head="chunked", keep_outputs=keep, repeats=1)
        floors = [memopt.solvers.min_peak(prof, offload_state=o, head=h) / prof.peak_bytes
                  for h in (False, True) for o in (False, True)]
        plan = memopt.search(prof, budget="50%")
        mine = copy.deepcopy(base)
        mine_opt = torch.optim.AdamW(mine.parameters(), lr=1e-3)
        losses = []
        with memopt.limit_memory(plan.budget_bytes) as lim, memopt.plan(plan, mine, optimizer=mine_opt):
            for s in range(steps):
                torch.manual_seed(s)
                if keep:
                    outputs = mine(input_ids=ids, labels=ids)
                    loss = outputs.loss
                else:
                    loss = mine(input_ids=ids, labels=ids).loss
                loss.backward()
                mine_opt.step()
                mine_opt.zero_grad()
                losses.append(loss.item())
        drift = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), ref.parameters()))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        rows.append([name, "keeps outputs" if keep else "loss only", f"{prof.peak_bytes / MiB:.1f}",
                     f"{floors[0]:.3f} / {floors[1]:.3f}", f"{floors[2]:.3f} / {floors[3]:.3f}",
                     f"{plan.head['chunks'] if plan.head else 'as written'}",
                     f"{lim.peak_bytes / prof.peak_bytes:.3f} (budget 0.500)", losses[0] == ref_losses[0],
                     f"{rel:.1e}", f"{drift:.1e}"])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2,llama,qwen2")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per throughput")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    ap.add_argument("--fit", action="store_true", help="the fit check at batch 8 x 128 instead (see above)")
    args = ap.parse_args()
    set_threads(args.threads)
    if args.fit:
        rows = [r for name in args.models.split(",") for r in fit(name.strip())]
        print(md_table(["model", "loop", "peak MiB", "floor ÷ peak, as written (act. / whole step)",
                        "chunked (act. / whole step)", "plan's head chunks", "measured peak ÷ peak",
                        "first loss bit-identical", "max rel. loss diff", "max param diff"], rows))
        return
    rows = []
    for name in args.models.split(","):
        rows += run(name.strip(), args.seq, args.steps)
    print()
    print(f"seq {args.seq}; budgets: " + ", ".join(f"{k} {v // MiB} MiB" for k, v in BUDGETS.items()))
    print(md_table(["model", "method", "max batch", "÷ hf ckpt", "samples/s (CPU)", "bit-identical"], rows))


if __name__ == "__main__":
    main()
