"""A model whose training state exceeds the device: the largest batch and the throughput of memopt's plan against
"offload everything" and a torchao-style offloaded optimizer, at limits of 0.5x and 0.25x the model's training state.

    PYTHONPATH=$PWD python benchmarks/bigger_model.py            # transformers Llama 134M (12 x 768, vocab 32000)
    PYTHONPATH=$PWD python benchmarks/bigger_model.py --layers 4  # the same width and vocabulary, 4 layers (quick)
    PYTHONPATH=$PWD python benchmarks/bigger_model.py --sizes    # memopt.max_model: Llama depths within 1 GiB

The model is a stock ``transformers.LlamaForCausalLM`` (random init, no download; its embedding and head are not
tied) trained with AdamW at sequence 128. Its units are the embedding, each decoder layer and the LM head, so that the
plan may move the state of the embedding and the head too (a third of the parameters).
It is profiled on this machine at batches 1 and 2 (no limit: the host holds it) and every other batch is on the line
through them (:class:`memopt_nb.harness.maxbatch.BatchProfiles`). Per device (this CPU as the emulated device, and
two GPU presets, whose times are the profile's rescaled) and per limit, each method's largest batch is found by
bisection with the simulator:

* **memopt**: the planner's floor (``solvers.min_peak``) within the limit; its plan is the exact optimum there;
* **offload everything**: ``solvers.offload_everything`` (optimizer state, gradients and parameters of every unit on
  the host, activations swapped or recomputed: ZeRO-Offload / FSDP2 ``CPUOffloadPolicy``);
* **torchao-style**: ``solvers.state_offload`` (optimizer state and gradients on the host, parameters resident: the
  placement of torchao's ``CPUOffloadOptimizer(offload_gradients=True)``; the step runs on the device here, where
  torchao runs it on the CPU).

Throughput is the most samples per second each method's plans reach at a power of two below its largest batch or at
that batch (throughput first, as Liu et al. judge), predicted. On the emulated device memopt's answer is
then profiled at that batch (measured, not on the line), planned again, and one step is run under the plan inside
``memopt.limit_memory`` at the limit: the measured peak is printed beside the prediction.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import MiB, md_table

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.errors import BudgetError
from memopt_nb.harness.maxbatch import BatchProfiles

GPUS = ("a100-40gb", "h100-80gb")
SEQ = 128


def units(n_layer: int) -> list[str]:
    return ["model.embed_tokens", *[f"model.layers.{i}" for i in range(n_layer)], "lm_head"]


def llama(n_layer: int, hidden: int = 768, vocab: int = 32000):
    import transformers

    transformers.logging.set_verbosity_error()

    def build(batch: int):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2048,
                                       num_hidden_layers=n_layer, num_attention_heads=12, num_key_value_heads=12,
                                       max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, vocab, (batch, SEQ))
        return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss), torch.optim.AdamW(model.parameters())

    return build


def fits(method: str, prof, budget: int, device) -> bool:
    if method == "memopt":
        return solvers.min_peak(prof, device, offload_state=True) <= budget
    fn = solvers.offload_everything if method == "offload everything" else solvers.state_offload
    try:
        return fn(prof, budget, device).feasible
    except BudgetError:
        return False


def largest(method: str, bp: BatchProfiles, budget: int, device, cap: int = 4096) -> int:
    """The largest batch (0: none) whose profile on the line fits ``method`` within ``budget``."""
    if not fits(method, bp.at(1), budget, device):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(method, bp.at(hi), budget, device):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(method, bp.at(mid), budget, device) else (lo, mid)
    return lo


def plan_at(method: str, prof, budget: int, device, time_limit: float):
    if method == "memopt":
        return solvers.optimal(prof, budget, device, time_limit=time_limit, offload_state=True)
    fn = solvers.offload_everything if method == "offload everything" else solvers.state_offload
    return fn(prof, budget, device)


def best_throughput(method: str, bp: BatchProfiles, top: int, budget: int, device, time_limit: float):
    """The most samples/s ``method``'s plans reach at any power of two below ``top`` or at ``top`` (None: none fits)."""
    best = None
    for b in sorted({*(2**k for k in range(top.bit_length()) if 2**k < top), top} if top else ()):
        plan = plan_at(method, bp.at(b), budget, device, time_limit)
        if plan.feasible:
            best = max(best or 0.0, b / plan.predicted_step_time)
    return best


def batch_table(n_layer: int, time_limit: float) -> None:
    build = llama(n_layer)
    bp = BatchProfiles(build, options={"units": units(n_layer)})
    t0 = time.perf_counter()
    for b in (1, 2):
        bp.profiled(b)
    bp.fit(1, 2)
    p1 = bp.at(1)
    state = p1.param_bytes + p1.grad_bytes + p1.optimizer_state_bytes
    params = p1.param_bytes // 4
    print(f"Llama {n_layer} x 768, vocab 32000: {params / 1e6:.1f} M parameters, training state "
          f"{state / MiB:.0f} MiB, unplanned peak at batch 1 {p1.peak_bytes / MiB:.0f} MiB "
          f"(profiles {time.perf_counter() - t0:.0f} s)")
    rows, ratios = [], []
    for device in (None, *GPUS):
        for frac in (0.5, 0.25):
            budget = int(frac * state)
            got = {}
            for method in ("memopt", "offload everything", "torchao-style"):
                b = largest(method, bp, budget, device)
                got[method] = (b, best_throughput(method, bp, b, budget, device, time_limit))
            name = memopt.Simulator(p1, device).device.name
            base = got["offload everything"][1]
            ratio = got["memopt"][1] / base if got["memopt"][1] and base else None
            if ratio:
                ratios.append(ratio)
            rows.append([name, f"{frac}x ({budget / MiB:.0f})",
                         *[f"{got[m][0] or '-'} / {got[m][1]:.2f}" if got[m][1] else f"{got[m][0] or '-'} / -"
                           for m in got], f"{ratio:.2f}" if ratio else "-"])
            if device is None:
                rows.append(["↳ measured", "", verify(build, got["memopt"][0], budget, time_limit), "", "", ""])
    print(md_table(["device", "limit (MiB)", "memopt: max batch / samples/s", "offload everything",
                    "torchao-style", "memopt ÷ offload everything"], rows, "llrrrr"))
    if ratios:
        print(f"memopt's throughput ÷ offload everything's: min {min(ratios):.2f}, max {max(ratios):.2f}")


def verify(build, batch: int, budget: int, time_limit: float) -> str:
    """memopt's answer profiled at its batch, planned, and one step run inside the limit."""
    if not batch:
        return "-"
    model, kwargs, loss_fn, opt = build(batch)
    prof = memopt.profile(model, loss_fn=loss_fn, optimizer=opt, repeats=1, units=units(len(model.model.layers)),
                          **kwargs)
    try:
        plan = solvers.optimal(prof, budget, time_limit=time_limit, offload_state=True)
    except BudgetError as e:
        return f"batch {batch}: no plan on its measured profile ({str(e)[:60]})"
    with memopt.limit_memory(budget):
        m = memopt.measure(model, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
    ok = "within" if m.peak_bytes <= budget else "OVER"
    return (f"batch {batch}: peak {m.peak_bytes / MiB:.0f} MiB {ok} the limit (predicted "
            f"{plan.predicted_peak_bytes / MiB:.0f}), step {m.step_time:.1f} s (predicted "
            f"{plan.predicted_step_time:.1f} s)")


def size_table(time_limit: float) -> None:
    """memopt.max_model on the emulated device within 1 GiB: Llama (768 wide, vocab 32000) by depth, batch 4 x 128.
    (A 24 GB preset's answer would need models of billions of parameters built on this host: out of its reach.)"""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32]

    def build(n: int):
        return llama(n)(4)

    t0 = time.perf_counter()
    r = memopt.max_model(build, sizes, budget="1GiB", time_limit=time_limit,
                         units=lambda model: units(len(model.model.layers)))
    print(r.summary())
    print(md_table(["layers", "M parameters", "state MiB", "unplanned peak MiB", "floor MiB", "fits (plain / "
                    "offload everything / memopt)", "measured peak MiB"],
                   [[x.size, f"{x.params / 1e6:.1f}", f"{x.state_bytes / MiB:.0f}", f"{x.peak_bytes / MiB:.0f}",
                     f"{x.floor_bytes / MiB:.0f}", " / ".join("yes" if x.fits[m] else "no" for m in
                                                             ("plain", "offload_everything", "memopt")),
                     f"{x.measured_peak_bytes / MiB:.0f}" if x.measured_peak_bytes else ""] for x in r.rows]))
    print(f"({time.perf_counter() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.sizes:
        size_table(args.time_limit)
    else:
        batch_table(args.layers, args.time_limit)


if __name__ == "__main__":
    main()
