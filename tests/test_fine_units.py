"""``units="fine"``: blocks split into their submodules where that lowers the largest unit.

What must hold: units never nest and run in forward order; the split only happens where it lowers the largest unit
and keeps what the parent saves inside units; the floor does not rise; plans over the finer units train bit-identically
on models this project did not write (transformers GPT-2 with its KV cache and dropout, ViT); the table shows the tree.
"""

import pytest
import torch
from helpers.fine_units import IDS, LABELS, PIXELS, gpt2_step, vit, vit_step
from helpers.third_party import assert_same, gpt2, train

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.errors import ProfileError
from memopt_nb.core.plan import Decision, Plan
from memopt_nb.profiling.units import FINE_MAX_CHILD


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def fine_profile(build, **inputs):
    torch.manual_seed(0)
    model = build()
    return memopt.profile(model, loss_fn=lambda out: out.loss, units="fine", repeats=1, **inputs)


def test_fine_units_split_gpt2_blocks_into_attention_mlp_and_norms(transformers):
    blocks = fine_profile(lambda: gpt2(transformers), input_ids=IDS, labels=IDS)
    names = [u.name for u in blocks.units]
    for a in names:  # never nested
        assert not any(b != a and b.startswith(a + ".") for b in names), a
    assert "transformer.h.0" in blocks.meta["split"] and blocks.meta["split"]["transformer.h.0"] == "GPT2Block"
    assert {"transformer.h.0.ln_1", "transformer.h.0.ln_2"} <= set(names)
    assert any(n.startswith("transformer.h.0.attn") for n in names)
    assert any(n.startswith("transformer.h.0.mlp") for n in names)
    assert {"transformer.h.0", "transformer.h.1"} <= set(blocks.meta["split"])  # no cap: every block is split
    assert all(blocks.meta["split_why"][b].startswith("split into") for b in blocks.meta["split"])
    coarse = memopt.profile(gpt2(transformers), loss_fn=lambda out: out.loss, repeats=1, input_ids=IDS, labels=IDS)
    assert [u.name for u in coarse.units] == ["transformer.h.0", "transformer.h.1"]
    # every split lowered the largest unit: the largest fine unit saves at most FINE_MAX_CHILD of the largest block
    assert max(u.saved_bytes for u in blocks.units) <= FINE_MAX_CHILD * max(u.saved_bytes for u in coarse.units)
    # and the floor of activation plans is no higher (finer units can do everything blocks can, and more)
    assert solvers.min_peak(blocks, offload_state=False) <= solvers.min_peak(coarse, offload_state=False)


def test_hierarchy_rows_put_each_split_module_above_its_units(transformers):
    prof = fine_profile(lambda: gpt2(transformers), input_ids=IDS, labels=IDS)
    rows = prof.hierarchy()
    assert [i for _, _, i in rows if i is not None] == list(range(prof.n_units))  # every unit once, in order
    split = prof.meta["split"]
    assert sorted(n for _, n, i in rows if i is None) == sorted(split)
    for k, (depth, name, index) in enumerate(rows):
        if index is not None:
            parents = [n for _, n, i in rows[:k] if i is None and name.startswith(n + ".")]
            assert depth == len(parents)
    html = prof._repr_html_()
    assert "GPT2Block, split into the units below" in html
    assert html.count("also measured whole") == len(prof.merges) > 0  # search_depths may plan them as one unit
    assert html.count("<tr>") >= prof.n_units + len(split)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "vit"])
def test_plans_over_fine_units_train_bit_identically(transformers, model):
    build, step, inputs = ((lambda: gpt2(transformers), gpt2_step, dict(input_ids=IDS, labels=IDS)) if model == "gpt2"
                           else (lambda: vit(transformers), vit_step, dict(pixel_values=PIXELS, labels=LABELS)))
    prof = fine_profile(build, **inputs)
    names = [u.name for u in prof.units]
    assert prof.meta["split"], "the small model was split"
    ref = train(build, step)
    cycles = {"recompute": ["recompute"], "swap": ["swap"], "mixed": ["recompute", "swap", "keep"]}
    for what, cycle in cycles.items():
        plan = Plan(decisions=tuple(Decision(n, cycle[i % len(cycle)]) for i, n in enumerate(names)), method=what)
        assert_same(ref, train(build, step, lambda m, p=plan: p), (model, what))


def test_fine_is_refused_by_name_only_where_it_cannot_apply():
    with pytest.raises(ProfileError, match="'fine'"):
        memopt.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), torch.randn(2, 4),
                       units=3.5)


class Glue(torch.nn.Module):
    """A block whose own code (between its children) saves most of its activations: splitting it would leave those
    outside every unit, so ``fine`` keeps it whole."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h) * torch.sigmoid(h) * torch.sin(h))  # three saved tensors in the block's own code


class Split(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a, self.act, self.b = torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_fine_splits_only_blocks_whose_children_hold_what_they_save():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Split(), Glue(), Split(), Glue())
    prof = memopt.profile(model, torch.randn(8, 16), units="fine", repeats=1)
    names = [u.name for u in prof.units]
    assert names == ["0.a", "0.act", "0.b", "1", "2.a", "2.act", "2.b", "3"]
    assert prof.meta["split"] == {"0": "Split", "2": "Split"}
    assert prof.meta["units_rule"] == "fine"
    why = prof.meta["split_why"]
    assert why["0"] == why["2"] == "split into 3 units"
    assert why["1"].startswith("kept whole: its children save") and "no plan would manage" in why["1"]
    assert why["3"].startswith("kept whole")


class Padded(torch.nn.Module):
    """A block with children that save nothing and hold nothing (timm's ``ls1``/``drop_path1`` when disabled)."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.act, self.b = torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        self.ls, self.drop = torch.nn.Identity(), torch.nn.Dropout(p=0.0)

    def forward(self, x):
        return self.drop(self.ls(self.b(self.act(self.a(x)))))


@pytest.mark.slow
def test_fine_has_no_unit_cap_and_leaves_children_that_do_nothing_out():
    """Forty blocks of three working children each: 120 fine units (more than the old cap of 64), none of them the
    Identity or p=0 Dropout children, which give a plan nothing to decide."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Padded() for _ in range(40)))
    prof = memopt.profile(model, torch.randn(4, 16), units="fine", repeats=1)
    names = [u.name for u in prof.units]
    assert len(names) == 120
    assert not any(n.endswith((".ls", ".drop")) for n in names)
    assert set(prof.meta["split"]) == {str(i) for i in range(40)}
    assert prof.meta["split_why"]["0"] == ("split into 3 units (2 children that save and hold nothing, or do not run "
                                          "once with a gradient, left out)")


def test_fine_stops_at_the_unit_cap(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["memopt_nb.profiling.units"], "FINE_MAX_UNITS", 6)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Split() for _ in range(4)))
    names = [u.name for u in memopt.profile(model, torch.randn(8, 16), units="fine", repeats=1).units]
    assert names == ["0.a", "0.act", "0.b", "1", "2", "3"]


def test_the_magic_reads_units_fine():
    pytest.importorskip("IPython")
    from memopt_nb.notebook.magics import _parse_units

    assert _parse_units("fine") == "fine" and _parse_units("'fine'") == "fine" and _parse_units("auto") == "auto"
    assert _parse_units("h.0,h.1") == ["h.0", "h.1"]
