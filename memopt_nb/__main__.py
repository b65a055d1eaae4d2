"""Command line: ``python -m memopt_nb demo`` (the main job on a built-in model) and ``python -m memopt_nb bench``.

While a long call runs (profiling, measuring, ...) progress lines go to standard error once it has taken ~5 s
(:class:`memopt_nb.core.progress.ProgressLines`; ``MEMOPT_NB_PROGRESS=off`` turns them off).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memopt_nb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="profile a built-in model, plan under a budget, train under the plan")
    demo.add_argument("--model", default="gpt", help="zoo model: gpt, resnet, vit, unet, mlp; resnet18, vit_tiny, "
                      "convnext_atto (default gpt; vit_tiny with --whole-step)")
    demo.add_argument("--budget", type=float, default=0.6, help="budget as a fraction of the unoptimized peak")
    demo.add_argument("--steps", type=int, default=3, help="training steps to compare")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--whole-step", action="store_true",
                      help="a fixed-state-heavy model (default vit_tiny) whose parameters + gradients + Adam state are "
                           "2.2x the budget, under a plan that also places optimizer state, gradients and parameters")
    bench = sub.add_parser("bench", help="run the evaluation suite and write results/bench.{md,json,png}")
    bench.add_argument("--quick", action="store_true", help="a small suite for CI")
    bench.add_argument("--out", default="results", help="output folder")
    args = parser.parse_args(argv)
    from .core.errors import MemoptError
    from .core.progress import ProgressLines, listening, progress_mode

    try:
        with listening(None if progress_mode() == "off" else ProgressLines()):
            return _command(args)
    except MemoptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    """Run the command ``args`` name; its exit status."""
    if args.command == "demo":
        from .harness.demo import run_demo, run_whole_step_demo

        if args.whole_step:
            model = args.model if args.model != "gpt" else "vit_tiny"
            res = run_whole_step_demo(model, steps=args.steps, seed=args.seed)
            return 0 if res["matched"] and res["within_budget"] else 1
        res = run_demo(args.model, args.budget, args.steps, args.seed)
        return 0 if res["loss_matched"] else 1
    from .harness.bench import run_bench  # noqa: PLC0415

    run_bench(quick=args.quick, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
