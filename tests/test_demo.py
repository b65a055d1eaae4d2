import functools

import memopt_nb as memopt
from memopt_nb.__main__ import main
from memopt_nb.demo import run_demo


def test_demo_prints_the_figures_and_matches_the_loss():
    lines = []
    res = run_demo("mlp", budget_fraction=0.6, steps=2, planner=functools.partial(memopt.search, total_timesteps=3000),
                   out=lines.append)
    text = "\n".join(lines)
    for label in ("unoptimized peak (measured)", "budget:", "measured peak under plan", "step time ratio",
                  "loss matched"):
        assert label in text
    assert res["loss_matched"] is True
    assert res["measured_peak"] <= res["budget"] < res["unoptimized_peak"]
    assert res["predicted_peak"] == res["measured_peak"]  # CPU memory is deterministic and the model is exact here
    assert res["plan"].method == "memopt-ppo"


def test_cli_reports_user_errors(capsys):
    assert main(["demo", "--model", "nope"]) == 2
    assert "unknown zoo model" in capsys.readouterr().err
