"""Plans on models this project did not write: Hugging Face transformers, spectral norm, hand-written modules.

A plan may change memory and time, never results: every test trains with and without a plan (forward, backward,
Adam) and compares losses, gradients, parameters, buffers and optimizer state with ``torch.equal`` — or checks that a
plan that cannot be exact is refused with a clear error.
"""

import copy
import io
import threading

import pytest
import torch
import torch.nn as nn
from helpers.third_party import GPT2_BLOCKS, assert_same, gpt2, train
from helpers.threads import memopt_threads
from torch.utils.checkpoint import checkpoint

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError, ProfileError
from memopt_nb.core.plan import Decision, Plan


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def make_plan(names, strategy, **timing):
    return Plan(decisions=tuple(Decision(n, strategy, **timing) for n in names), method=f"{strategy}_all")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_hf_gpt2_cache_and_padding_mask(transformers, strategy, masked):
    """use_cache=True (the default) returns a KV cache: the recomputation must not append to it a second time."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # padding

    def step(model):
        out = model(input_ids=ids, attention_mask=mask if masked else None, labels=ids)
        cache = out.past_key_values
        return out.loss, lambda: [layer.keys.shape[-2] for layer in cache.layers]  # after backward

    ref = train(lambda: gpt2(transformers), step)
    got = train(lambda: gpt2(transformers), step, lambda m: make_plan(GPT2_BLOCKS, strategy))
    assert_same(ref, got, (strategy, masked))
    assert got["extras"] == ref["extras"] == [[12, 12]] * 3  # the returned cache is as long as without a plan


def test_hf_bert_recompute_and_swap(transformers):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    labels = torch.tensor([0, 1])
    names = ["bert.encoder.layer.0", "bert.encoder.layer.1"]

    def build():
        return transformers.BertForSequenceClassification(cfg)

    def step(model):
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss, None

    ref = train(build, step)
    for strategy in ("recompute", "swap"):
        assert_same(ref, train(build, step, lambda m, s=strategy: make_plan(names, s)), strategy)


def test_model_that_checkpoints_its_own_blocks_is_refused(transformers):
    """Profiling a model that already checkpoints its blocks names them and says how to turn that off."""
    model = gpt2(transformers)
    ids = torch.randint(0, 64, (2, 8))
    for reentrant in (False, True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with pytest.raises(ProfileError, match=r"transformer\.h\.0.*gradient_checkpointing_disable\(\)"):
            memopt.profile(model, ids, loss_fn=lambda out: out.logits.sum(), repeats=1)
    model.gradient_checkpointing_disable()
    with pytest.raises(PlanError, match="gradient_checkpointing_disable"):
        model.gradient_checkpointing_enable()
        with memopt.plan(make_plan(GPT2_BLOCKS, "recompute"), model):
            pass


class SelfCheckpointing(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_hand_written_self_checkpointing_is_refused(reentrant):
    model = SelfCheckpointing(reentrant)
    with pytest.raises(ProfileError, match=r"'blocks\.0'.*checkpoint"):
        memopt.profile(model, torch.randn(4, 16, requires_grad=True), repeats=1)


# ====================================================================== buffers changed in forward
class SNNet(nn.Module):
    def __init__(self, api):
        super().__init__()
        norm = nn.utils.spectral_norm if api == "old" else nn.utils.parametrizations.spectral_norm
        self.blocks = nn.ModuleList(nn.Sequential(norm(nn.Linear(16, 16)), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("api", ["old", "parametrizations"])
@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_spectral_norm_power_iteration_runs_once(api, strategy):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    names = ["blocks.0", "blocks.1", "blocks.2"]
    ref = train(lambda: SNNet(api), lambda m: (m(x), None))
    got = train(lambda: SNNet(api), lambda m: (m(x), None), lambda m: make_plan(names, strategy))
    assert_same(ref, got, (api, strategy))
    prof = memopt.profile(SNNet(api), x, units=names, repeats=1)
    assert all(u.recomputable and "changes buffers" in u.side_effects for u in prof.units)
    assert "state" in prof._repr_html_()


class Counting(nn.Module):
    """Sets plain attributes in forward: a counter and the last input's norm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.last = None

    def forward(self, x):
        self.calls += 1
        self.last = x.detach().norm()
        return torch.tanh(self.lin(x)) * self.calls


def test_plain_attributes_set_in_forward_are_replayed():
    def build():
        return nn.Sequential(Counting(), Counting(), nn.Linear(8, 1))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    step = lambda m: (m(x).sum(), [m[0].calls, m[1].calls])  # noqa: E731
    ref = train(build, step)
    got = train(build, step, lambda m: make_plan(["0", "1"], "recompute"))
    assert_same(ref, got, "attributes")
    assert got["extras"] == ref["extras"] == [[1, 1], [2, 2], [3, 3]]


class Logging(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, log):
        log.append(x.shape[0])
        return torch.tanh(self.lin(x))


class LoggingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Logging(), Logging()

    def forward(self, x, log=None):
        log = [] if log is None else log
        return self.b(self.a(x, log), log).sum()


def test_unit_that_changes_an_argument_is_not_recomputable():
    model = LoggingNet()
    x = torch.randn(4, 8)
    prof = memopt.profile(model, x, units=["a", "b"], repeats=1)
    assert [u.recomputable for u in prof.units] == [False, False]
    assert "argument 1 (list)" in prof.units[0].not_recomputable_reason
    assert "not recomputable" in prof._repr_html_()
    before = [dict(m.__dict__) for m in model.modules()]
    with pytest.raises(PlanError, match=r"recomputes unit 'a'.*not recomputable: changes argument 1 \(list\)"):
        memopt.plan(Plan.uniform(prof, "recompute"), model).apply()  # refused before anything runs
    assert [dict(m.__dict__) for m in model.modules()] == before
    with pytest.raises(PlanError, match=r"unit 'a' changed argument 1 \(list\)"):  # a plan without the profile's
        with memopt.plan(make_plan(["a", "b"], "recompute"), model):  # word: refused at the first forward
            model(x).backward()
    for solver in (memopt.solvers.recompute_all, memopt.solvers.sqrt_n):  # planners never recompute it
        assert "recompute" not in solver(prof).strategies
    log = []
    with memopt.plan(Plan.uniform(prof, "swap"), model):  # swap is fine: it runs the forward once
        model(x, log).backward()
    assert log == [4, 4]


# ====================================================================== checkpoint's own keyword names
class Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, debug=False, early_stop=None, determinism_check=None, context_fn=None, use_reentrant=None,
                preserve_rng_state=None):
        y = self.lin(x)
        scale = 1.0 + sum(v is not None and v is not False for v in (debug, early_stop, determinism_check,
                                                                          context_fn, use_reentrant,
                                                                          preserve_rng_state))
        return torch.tanh(y) * scale + (100.0 if debug else 0.0)


@pytest.mark.parametrize("flag", ["debug", "early_stop", "determinism_check", "context_fn", "use_reentrant",
                                  "preserve_rng_state"])
def test_units_keyword_arguments_reach_the_unit(flag):
    value = {"context_fn": "mine", "determinism_check": "none"}.get(flag, True)

    def build():
        return nn.ModuleDict({"u": Flags(), "v": Flags()})

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    step = lambda m: (m["v"](m["u"](x, **{flag: value})).sum(), None)  # noqa: E731
    ref = train(build, step)
    got = train(build, step, lambda m: make_plan(["u", "v"], "recompute"))
    assert_same(ref, got, flag)


# ====================================================================== lifetime
class Chain(nn.Module):
    def __init__(self, n=4, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


CHAIN = [f"blocks.{i}" for i in range(4)]


def test_backward_after_the_block_starts_no_threads_and_keeps_no_host_memory():
    others = frozenset(memopt_threads())  # another test's parked plan, if any: not this one's
    torch.manual_seed(0)
    model, ref = Chain(), Chain()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(64, 32)
    plan = make_plan(CHAIN, "swap", offload_window=0, prefetch_distance=0)
    losses = []
    for i in range(3):
        try:
            with memopt.plan(plan, model) as applied:
                loss = model(x)
                engine = applied.engine
                if i == 1:
                    raise KeyError("boom")
        except KeyError:
            pass
        assert memopt_threads(others) == []
        loss.backward()  # after the block: the graph still holds offloaded tensors
        losses.append(loss.detach())
        assert memopt_threads(others) == []
        assert engine.stats["offloaded_bytes"] > 0
        for eng in engine._copy.values():
            assert not any(eng.pool._free.values())  # no host buffers kept
    ref(x).backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad * 3, b.grad)


def test_plan_removed_while_another_thread_trains():
    others = frozenset(memopt_threads())
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(32, 32)
    plan = make_plan(CHAIN, "swap", offload_window=1, prefetch_distance=1)
    started, errors, stop = threading.Event(), [], threading.Event()

    def worker():
        try:
            while not stop.is_set():
                model(x).backward()
                started.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            started.set()

    applied = memopt.plan(plan, model).apply()
    th = threading.Thread(target=worker, daemon=True)  # a failure below must not leave pytest waiting on it forever
    th.start()
    try:
        started.wait(30)
        applied.remove()
        for _ in range(3):
            model(x).backward()
    finally:
        stop.set()
        th.join(30)
    assert not errors
    assert memopt_threads(others) == []


def test_swapping_a_saved_tensor_never_changes_its_version_not_even_for_a_moment():
    """The swap engine's pack hook keeps an alias for autograd's in-place check; it must not do an in-place op on the
    saved tensor to make it. ``set_()`` bumped the shared version counter and set it back, and a second thread saving
    the same input in between recorded version 1 and then failed backward (seen in CI)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.inplace = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable:
                self.inplace.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(32, 32)
    with memopt.plan(make_plan(CHAIN, "swap"), model) as applied:
        with Ops() as ops:
            loss = model(x)
        loss.backward()
    assert applied.stats["offloads"] > 0  # the pack hook did run on the saved tensors, x among them
    assert ops.inplace == [] and x._version == 0


def test_deepcopy_inside_the_block_is_an_independent_model():
    torch.manual_seed(0)
    model = Chain()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 32)
    for strategy in ("recompute", "swap"):
        with memopt.plan(make_plan(CHAIN, strategy), model):
            clone = copy.deepcopy(model)
        for m in (clone, twin):
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            for _ in range(3):
                opt.zero_grad()
                m(x).backward()
                opt.step()
        for a, b in zip(twin.parameters(), clone.parameters()):
            assert torch.equal(a, b)
        assert all(p.grad is None for p in model.parameters())  # the clone did not train the original
        twin.load_state_dict(model.state_dict())


def test_torch_save_inside_the_block():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 32)
    with memopt.plan(make_plan(CHAIN, "swap"), model):
        buf = io.BytesIO()
        torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    loaded(x).backward()
    assert all(p.grad is not None for p in loaded.parameters())
    assert all(p.grad is None for p in model.parameters())


# ====================================================================== in-place changes after a unit
class SigmoidUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


class InPlaceCaller(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = SigmoidUnit(), SigmoidUnit()

    def forward(self, x):
        y = self.a(x)
        y.mul_(2)  # sigmoid saved its output for backward: autograd must refuse
        return self.b(y).sum()


@pytest.mark.parametrize("strategy", [None, "swap"])
def test_inplace_change_of_a_saved_tensor_still_raises(strategy):
    model = InPlaceCaller()
    x = torch.randn(4, 8)
    ctx = memopt.plan(make_plan(["a", "b"], strategy), model) if strategy else None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        if ctx:
            with ctx:
                model(x).backward()
        else:
            model(x).backward()


# ====================================================================== torch.compile
def compiled_step(backend):
    compiled = {}

    def step(model):
        if id(model) not in compiled:
            compiled[id(model)] = torch.compile(model, backend=backend)
        return compiled[id(model)](torch.ones(4, 16)).pow(2).mean(), None

    return step


def small_dropout_net():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1)) for _ in range(2)])


@pytest.mark.slow
def test_compiled_with_aot_eager_is_identical():
    torch._dynamo.reset()
    step = compiled_step("aot_eager")
    ref = train(small_dropout_net, step, steps=2)
    got = train(small_dropout_net, step, lambda m: make_plan(["0", "1"], "recompute"), steps=2)
    assert_same(ref, got, "aot_eager")


def test_compiled_with_inductor_is_refused():
    """Inductor cannot give the same results under a plan: refused when it traces a unit, before it compiles."""
    torch._dynamo.reset()
    model = small_dropout_net()
    compiled = torch.compile(model, backend="inductor")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match="backend 'inductor'.*backend='aot_eager'"):
        with memopt.plan(make_plan(["0", "1"], "swap"), model):
            compiled(torch.ones(4, 16)).sum().backward()
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert "forward" not in model[0].__dict__
