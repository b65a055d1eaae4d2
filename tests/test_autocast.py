"""Mixed precision: ``profile(..., autocast=torch.bfloat16)`` predicts a loop whose forward and loss run under
``torch.autocast`` and whose backward and optimizer step run outside, as training loops are written.

Autocast keeps a cache of the low-precision copies of the parameters from their first use until its block is left.
A profile made inside ``torch.autocast`` would run backward and the optimizer step under it as well, the cache living
through backward: there every recomputed or swapped unit measured above the prediction (``nn.TransformerEncoder``
+1.4 KB…+17.7 KB, transformers Swin +122 KB of 1.1 MB under a whole-step plan). Such a call is refused; with
``autocast=`` every plan below trains bit-identically and peaks exactly where the simulator says, on the zoo GPT,
transformers GPT-2 and models built from torch's own layers.
"""

import helpers.torch_layers as layers
import helpers.whole_step as ws
import pytest
import torch
from helpers import tolerances

import memopt_nb as memopt
from memopt_nb.core.errors import ProfileError
from memopt_nb.core.plan import Plan

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _zoo_gpt():
    return memopt.zoo.build("gpt", seed=0, **ws.SMALL["gpt"])


_ZOO_GPT = _zoo_gpt()  # its inputs and loss (each build makes the same)

# name: (build, positional inputs, keyword inputs, loss)
MODELS = {
    "hf_gpt2": (_gpt2, (), {"input_ids": IDS, "labels": IDS}, lambda out: out.loss),
    "zoo_gpt": (lambda: _zoo_gpt().model, _ZOO_GPT.inputs, {}, _ZOO_GPT.loss_fn),
    "self_attention": layers.MODELS["self_attention"],
    "lstm": layers.MODELS["lstm"],
}


def _on(device: str, obj):
    return {k: _on(device, v) for k, v in obj.items()} if isinstance(obj, dict) else \
        tuple(_on(device, v) for v in obj) if isinstance(obj, tuple) else obj.to(device)


def _inputs(name: str, device: str = "cpu"):
    build, args, kwargs, loss_fn = MODELS[name]
    return _on(device, args), _on(device, kwargs)


def _train(name: str, plan: Plan | None, dtype: torch.dtype, steps: int = 3, device: str = "cpu"):
    """``steps`` steps of a fresh model, forward and loss under autocast, backward and Adam's step outside."""
    build, _, _, loss_fn = MODELS[name]
    args, kwargs = _inputs(name, device)
    torch.manual_seed(0)
    model = build().to(device)

    def forward_loss(m):
        with torch.autocast(device, dtype=dtype):
            return loss_fn(m(*args, **kwargs))

    return ws.train_loop(model, ws.OPTIMIZERS["adam"](model.parameters()), plan, forward_loss, steps)


_CACHE: dict = {}


def _profile(name: str, dtype: torch.dtype = torch.bfloat16):
    if (name, dtype) not in _CACHE:
        build, args, kwargs, loss_fn = MODELS[name]
        torch.manual_seed(0)
        model = build()
        opt = ws.OPTIMIZERS["adam"](model.parameters())
        prof = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1, autocast=dtype,
                              selective=True, **kwargs)
        _CACHE[name, dtype] = (model, opt, prof)
    return _CACHE[name, dtype]


def _cpu_lstm_runs_under(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN has an LSTM kernel for ``dtype`` under autocast: without AVX-512 (seen on an AVX2-only
    EPYC) the plain step already fails with "could not create a primitive descriptor for the LSTM forward
    propagation primitive", before memopt is involved."""
    lstm = torch.nn.LSTM(4, 4)
    try:
        with torch.autocast("cpu", dtype=dtype):
            out, _ = lstm(torch.zeros(2, 1, 4))
        out.float().sum().backward()
    except RuntimeError as exc:
        if "primitive descriptor" in str(exc):
            return False
        raise
    return True


@pytest.mark.parametrize(("name", "dtype"), [("hf_gpt2", torch.bfloat16), ("zoo_gpt", torch.bfloat16),
                                             ("self_attention", torch.float16), ("lstm", torch.bfloat16)])
def test_every_kind_of_plan_trains_bit_identically_and_peaks_where_predicted(name, dtype):
    if name == "lstm" and not _cpu_lstm_runs_under(dtype):
        pytest.skip(f"this CPU's oneDNN has no LSTM kernel under {dtype} autocast (plain training fails too)")
    model, opt, prof = _profile(name, dtype)
    build, args, kwargs, loss_fn = MODELS[name]
    assert prof.meta["autocast"] == {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    plans = layers._plans(prof, opt)
    plans["selective"] = Plan.from_strategies(prof, ["selective" if u.save_sets else "recompute" for u in prof.units])
    ref = _train(name, None, dtype)
    for what, plan in plans.items():
        got = _train(name, plan, dtype)
        ws._assert_same_training(ref, got, stepped=what == "whole_step")
        m = memopt.measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, autocast=dtype,
                           **kwargs)
        assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes, (what, m.peak_bytes)


def test_the_autocast_profile_sees_the_low_precision_step():
    """What the forward saves in bfloat16 is less than in float32: the fp32 profile does not describe the AMP loop."""
    model, opt, amp = _profile("hf_gpt2")
    build, args, kwargs, loss_fn = MODELS["hf_gpt2"]
    fp32 = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1, **kwargs)
    assert fp32.meta["autocast"] is None
    assert sum(u.saved_bytes for u in amp.units) < sum(u.saved_bytes for u in fp32.units)
    assert "under autocast bfloat16" in repr(amp)
    assert memopt.ModelProfile.from_json(amp.to_json()).meta["autocast"] == "bfloat16"


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()))


def test_profile_or_measure_inside_autocast_is_refused_with_nothing_changed():
    model, opt, _ = _profile("zoo_gpt")
    build, args, kwargs, loss_fn = MODELS["zoo_gpt"]
    before = _state(model, opt)
    rng = torch.get_rng_state()
    for call in (memopt.profile, memopt.measure):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ProfileError, match="inside torch.autocast"
                                                                         ) as info:
            call(model, *args, loss_fn=loss_fn, optimizer=opt)
        assert "autocast=torch.bfloat16" in str(info.value)
    after = _state(model, opt)
    assert before[1] == after[1] and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("bad", ["fp8", torch.float32, 16, True])
def test_a_bad_autocast_value_says_what_works(bad):
    model, opt, _ = _profile("zoo_gpt")
    build, args, kwargs, loss_fn = MODELS["zoo_gpt"]
    for call in (memopt.profile, memopt.measure):
        with pytest.raises(ProfileError, match=r"autocast must be None, torch\.bfloat16 or torch\.float16"):
            call(model, *args, loss_fn=loss_fn, autocast=bad)


def test_the_profile_magic_takes_autocast(ipython_shell):
    from IPython.core.error import UsageError

    ip = ipython_shell
    ip.run_line_magic("load_ext", "memopt_nb")
    try:
        build, args, kwargs, loss_fn = MODELS["zoo_gpt"]
        torch.manual_seed(0)
        ip.user_ns.update(amp_model=build(), amp_x=args[0], amp_loss=loss_fn)
        ip.run_line_magic("memopt_profile", "amp_model amp_x --loss amp_loss --repeats 1 --autocast bf16 -q "
                                            "-o amp_prof")
        assert ip.user_ns["amp_prof"].meta["autocast"] == "bfloat16"
        with pytest.raises(UsageError, match="autocast must be"):
            ip.run_line_magic("memopt_profile", "amp_model amp_x --repeats 1 --autocast int8 -q")
    finally:
        ip.run_line_magic("unload_ext", "memopt_nb")


# ---------------------------------------------------------------------- CUDA (skipped here; one GPU run verifies it)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_plans_bit_identical_and_peak_as_predicted(dtype):  # pragma: no cover - needs a GPU
    """transformers GPT-2 on CUDA under autocast: every kind of plan bit-identical; the measured peak within the
    caching allocator's allowance of the prediction (``tolerances.cuda_allows``, as ``benchmarks/cuda_check.py``)."""
    torch.manual_seed(0)
    model = _gpt2().cuda()
    opt = ws.OPTIMIZERS["adam"](model.parameters())
    args, kwargs = _inputs("hf_gpt2", "cuda")
    loss_fn = MODELS["hf_gpt2"][3]
    prof = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1, autocast=dtype, **kwargs)
    ref = _train("hf_gpt2", None, dtype, device="cuda")
    for what, plan in layers._plans(prof, opt).items():
        ws._assert_same_training(ref, _train("hf_gpt2", plan, dtype, device="cuda"), stepped=what == "whole_step")
        m = memopt.measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, autocast=dtype, **kwargs)
        sim = memopt.simulate(prof, plan).peak_bytes
        print(f"CUDA autocast {dtype} {what}: measured {m.peak_bytes} B, predicted {sim} B")
        assert abs(m.peak_bytes - sim) <= tolerances.cuda_allows(sim), (what, m.peak_bytes, sim)


def _steps(model, args, kwargs, loss_fn, dtype, n=2):
    for _ in range(n):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(*args, **kwargs))
        loss.backward()


def test_a_loop_in_another_precision_than_the_profile_is_warned_about_once():
    """The plan trains the same either way; its peak was predicted for the profile's precision, so a loop in another
    one is told (once, at its first training forward: an evaluation under no_grad before it is not one)."""
    import warnings

    build, args, kwargs, loss_fn = MODELS["zoo_gpt"]
    torch.manual_seed(0)
    model = build()
    opt = ws.OPTIMIZERS["adam"](model.parameters())
    amp = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1, autocast="bf16")
    fp32 = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1)
    loaded = Plan.from_json(Plan.uniform(amp, "recompute").to_json())
    assert loaded.meta["autocast"] == "bfloat16" and Plan.uniform(fp32, "swap").meta["autocast"] is None
    cases = [(Plan.uniform(amp, "recompute"), None, "made from a profile under autocast bfloat16, but the model's "
              "forward runs without autocast"),
             (Plan.uniform(fp32, "swap"), torch.bfloat16, "made from a profile without autocast, but the model's "
              "forward runs under autocast bfloat16"),
             (loaded, torch.float16, "under autocast bfloat16, but the model's forward runs under autocast float16")]
    for plan, dtype, message in cases:
        with memopt.plan(plan, model), pytest.warns(UserWarning, match=message) as record:
            with torch.no_grad():
                model(*args)
            _steps(model, args, kwargs, loss_fn, dtype)
        assert len([w for w in record if "made from a profile" in str(w.message)]) == 1
    for plan, dtype in ((Plan.uniform(amp, "recompute"), torch.bfloat16), (Plan.uniform(fp32, "swap"), None),
                        (Plan.from_strategies(amp, ["keep"] * amp.n_units, meta={"note": "x"}), torch.bfloat16)):
        with memopt.plan(plan, model), warnings.catch_warnings():
            warnings.simplefilter("error")
            _steps(model, args, kwargs, loss_fn, dtype)
    opt.zero_grad()


def test_the_evaluation_harness_measures_in_the_loops_precision():
    """``evaluate(..., autocast=)``: profiles, measurements and gradient accumulation run the forward under autocast;
    every measured plan peaks where its autocast profile predicted."""
    def builder(batch):
        zm = memopt.zoo.build("gpt", seed=0, **{**ws.SMALL["gpt"], "batch_size": batch})
        return zm.model, zm.inputs, zm.loss_fn

    ev = memopt.evaluate(builder, budget="100%", batch_sizes=[1, 2], reference_batch=2, steps=1, autocast="bf16",
                         methods=("none", "recompute_all", "swap_all", "grad_accum"))
    assert ev.autocast == "bfloat16" and "under autocast bfloat16" in repr(ev) and ev.to_dict()["autocast"]
    measured = [(m, p.predicted_peak_bytes, peak) for m, r in ev.methods.items() if m != "grad_accum"
                for p, peak in zip(r.plans, r.peak_bytes, strict=True) if p is not None]
    assert len(measured) == 6 and all(p.meta["autocast"] == "bfloat16" for r in ev.methods.values() for p in r.plans
                                       if p is not None)
    assert all(pred == peak for _, pred, peak in measured), measured
    assert all(t is not None for t in ev.methods["grad_accum"].step_time)  # accumulation measured in bf16 too
