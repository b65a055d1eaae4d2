"""``memopt.max_batch``: the largest batch any plan fits under a budget, and the batch that trains fastest.

The answer is found without profiling every batch unplanned. The model is profiled at three small batches
(``probe``, default 2, 4 and 8); the line through the two largest, checked on the third
(:func:`memopt_nb.profile_fallback.extrapolate`), gives the profile at any batch. Plain training fits up to the largest
batch whose extrapolated unplanned peak is within the budget; when that batch is well above the probes, the model is
profiled again there and at its half (both fit unplanned) so that the line, and above all its times, come from batches
near the answer. The largest batch any plan fits is then the largest whose smallest reachable peak
(:func:`memopt_nb.solvers.min_peak`, the planner's floor) is within the budget (doubling, then bisection), and a plan is
made for it (the exact optimum by default); on the device the model is on, real steps at that batch under the
plan check it (``verify``), stepping down to a batch that runs where they do not (a model whose training state
exceeds the budget: plans for the budget less a margin, since such a peak barely moves with the batch). Throughput is
predicted at each power of two up to that batch and at the batch itself; the best one is
:attr:`MaxBatch.best_batch` (throughput first); batches within the profiled times' spread of it are named too
(:attr:`MaxBatch.within_noise`: the profile cannot tell them apart). Plain training and the best classic baseline
(recompute-all, sqrt(n), swap-all, Capuchin, every-k-th-layer checkpointing) get the same numbers side by side.

What it is given is checked before it costs a run: the optimizer the user trains with is required (the builder's, or
``optimizer=`` as a class, a function of the parameters or an optimizer object), since its state is in every peak and
a plan that moves state applies to it only; and a builder whose step does not grow with the batch (one that ignores
its argument) is refused at the probes, where extrapolation would otherwise find that every batch fits.
"""

from __future__ import annotations

import gc
import html
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import planners as solvers
from ..core.budget import format_bytes, is_share, resolve_budget
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, MemoptError, PlanError
from ..core.plan import DEFAULT_STRATEGIES, Plan
from ..core.progress import advance, stage, task
from ..planners.checks import default_budget
from ..planners.rl.search import search
from ..profiling.fallback import extrapolate
from ..profiling.profile import profile
from ..runtime.measure import measure
from ..sim.simulator import simulate

__all__ = ["NO_OPTIMIZER", "BatchAnswer", "BatchProfiles", "MaxBatch", "OptimizerArg", "max_batch", "optimizer_maker"]

#: the largest batch :func:`max_batch` considers
MAX_BATCH_LIMIT = 1 << 20
#: predicted throughputs closer than this (relative) are never told apart, however steady the profiled times were;
#: on the CPU (the emulated device) the larger :data:`CPU_NOISE_FLOOR`: there a step's time moves by 10 % or more from
#: one profile to the next, more than one profile's repeats show
NOISE_FLOOR = 0.03
CPU_NOISE_FLOOR = 0.10


@dataclass
class BatchAnswer:
    """One way of training (plain, the best classic baseline, memopt's plans) at its largest and its fastest batch.

    Attributes:
        method: ``"none"`` (plain training), a baseline's name, or the planner (``"optimal"``, ``"memopt-ppo"``).
        batch: the largest batch it fits under the budget (``None``: not even the smallest batch tried).
        plan: its plan at ``batch``; step_time: predicted seconds per step there; throughput: samples per second.
        best_batch, best_plan, best_step_time, best_throughput: the same at the batch with the highest predicted
            throughput among the batches tried that fit.
    """

    method: str
    batch: int | None = None
    plan: Plan | None = None
    step_time: float | None = None
    throughput: float | None = None
    best_batch: int | None = None
    best_plan: Plan | None = None
    best_step_time: float | None = None
    best_throughput: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("method", "batch", "step_time", "throughput", "best_batch",
                                              "best_step_time", "best_throughput")}


@dataclass
class MaxBatch:
    """What :func:`max_batch` found: memopt's answer, with plain training and the best classic baseline beside it.

    ``batch``, ``plan``, ``step_time``, ``throughput`` and the ``best_*`` attributes are memopt's (:attr:`memopt`);
    :attr:`plain` and :attr:`baseline` hold the same for plain training and for the classic baseline that fits the
    largest batch. :attr:`optimizer` names the optimizer's class the plans were made for. Apply the plan to the
    model built at that batch, with an optimizer like the one given: ``model, inputs, loss_fn = builder(res.batch)``,
    ``opt = torch.optim.AdamW(model.parameters())``, then ``with memopt.plan(res.plan, model, optimizer=opt):``.
    """

    memopt: BatchAnswer
    plain: BatchAnswer
    baseline: BatchAnswer
    budget_bytes: int
    device: str
    probes: list[int]
    profiled: list[int]
    throughputs: dict[str, dict[int, float]] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    verified: dict[str, Any] = field(default_factory=dict)
    optimizer: str = ""
    #: the relative spread of the profiled step times (at least :data:`NOISE_FLOOR`, on the CPU
    #: :data:`CPU_NOISE_FLOOR`): predicted throughputs closer
    #: than this to the best cannot be told apart from it
    noise: float = 0.0
    _at: Callable[[int], Any] | None = field(default=None, repr=False)

    @property
    def within_noise(self) -> list[int]:
        """The other batches whose predicted throughput (memopt's plans) is within :attr:`noise` of the best batch's:
        the profile's times cannot tell them from :attr:`best_batch`, so any of them is as good an answer."""
        tp, best = self.throughputs.get(self.memopt.method, {}), self.memopt.best_throughput
        if not best:
            return []
        return sorted(b for b, t in tp.items() if b != self.best_batch and t >= best * (1.0 - self.noise))

    @property
    def batch(self) -> int | None:
        return self.memopt.batch

    @property
    def plan(self) -> Plan | None:
        return self.memopt.plan

    @property
    def step_time(self) -> float | None:
        return self.memopt.step_time

    @property
    def throughput(self) -> float | None:
        return self.memopt.throughput

    @property
    def best_batch(self) -> int | None:
        return self.memopt.best_batch

    @property
    def best_plan(self) -> Plan | None:
        return self.memopt.best_plan

    @property
    def best_throughput(self) -> float | None:
        return self.memopt.best_throughput

    def profile_at(self, batch: int) -> Any:
        """The (extrapolated) profile at ``batch``, as the answer was computed from it."""
        if self._at is None:
            raise MemoptError("this result has no profiles (it was loaded); run memopt.max_batch again")
        return self._at(int(batch))

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "device": self.device, "probes": self.probes,
                "profiled": self.profiled, "memopt": self.memopt.to_dict(), "plain": self.plain.to_dict(),
                "baseline": self.baseline.to_dict(), "seconds": self.seconds, "notes": list(self.notes),
                "verified": dict(self.verified), "optimizer": self.optimizer}

    def _rows(self) -> list[tuple[str, BatchAnswer]]:
        return [("plain training", self.plain), (f"best classic baseline ({self.baseline.method})", self.baseline),
                (f"memopt ({self.memopt.method})", self.memopt)]

    def summary(self) -> str:
        """One line: at this budget, batch N fits with a plan; plain training fits M."""
        plain = self.plain.batch
        near = self.within_noise
        tie = (f", batch{'es' if len(near) > 1 else ''} {', '.join(map(str, near))} within noise of it (the profiled "
               f"times vary by {self.noise:.0%})" if near else "")
        return (f"at {format_bytes(self.budget_bytes)} on {self.device}: batch {_b(self.batch)} fits with a plan "
                f"({_ratio(self.batch, plain)} plain training's {_b(plain)}); the fastest is batch "
                f"{_b(self.best_batch)} at {_f(self.best_throughput)} samples/s{tie} (plain training: "
                f"{_f(self.plain.best_throughput)} at batch {_b(self.plain.best_batch)})")

    def __repr__(self) -> str:
        lines = [f"MaxBatch({self.summary()})",
                 f"  {'':34s} {'max batch':>9s} {'step ms':>9s} {'samples/s':>10s} {'best batch':>10s} "
                 f"{'samples/s':>10s}"]
        for name, a in self._rows():
            lines.append(f"  {name:34s} {_b(a.batch):>9s} {_ms(a.step_time):>9s} {_f(a.throughput):>10s} "
                         f"{_b(a.best_batch):>10s} {_f(a.best_throughput):>10s}")
        lines.append(f"  profiled at batches {', '.join(map(str, self.profiled))}; predicted from them "
                     f"({self.seconds:.1f} s){self._for()}")
        if self.verified:
            lines.append(f"  batch {self.verified['batch']} run under its plan: measured peak "
                         f"{format_bytes(self.verified['peak_bytes'])} of {format_bytes(self.budget_bytes)}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("", "max batch", "step (ms)", "samples/s", "best batch",
                                                 "samples/s at best"))
        rows = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{_b(a.batch)}</td><td>{_ms(a.step_time)}</td>"
            f"<td>{_f(a.throughput)}</td><td>{_b(a.best_batch)}</td><td>{_f(a.best_throughput)}</td></tr>"
            for name, a in self._rows())
        notes = "".join(f"<br><i>{html.escape(n)}</i>" for n in self.notes)
        return (f"<p><b>{html.escape(self.summary())}</b></p><table><tr>{head}</tr>{rows}</table>"
                f"<p>Profiled at batches {', '.join(map(str, self.profiled))}; every other batch predicted from them "
                f"({self.seconds:.1f} s){html.escape(self._for())}.{notes}</p>")

    def _for(self) -> str:
        return f"; planned for {self.optimizer}" if self.optimizer else ""


def _b(x: int | None) -> str:
    return "-" if x is None else str(x)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _ratio(a: int | None, b: int | None) -> str:
    return f"{a / b:.2f}x" if a and b else "vs"


#: what ``optimizer=`` may be: a class, a function of the parameters, or an optimizer to take class and settings from
OptimizerArg = (type[torch.optim.Optimizer] | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
                | torch.optim.Optimizer | None)

_OPTIMIZER_FORMS = ("a torch.optim class (optimizer=torch.optim.AdamW), a function of the parameters "
                    "(optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)) or your optimizer itself "
                    "(optimizer=opt: its class and parameter groups' settings)")


def optimizer_maker(optimizer: OptimizerArg) -> Callable[[torch.nn.Module], torch.optim.Optimizer] | None:
    """``optimizer=`` of :func:`max_batch` as a function ``model -> optimizer`` (``None`` for ``None``): a class or a
    function is called on ``model.parameters()``; an optimizer instance gives its class and its parameter groups'
    settings, its groups matched to the new model's parameters by shape in order (an optimizer over another build of
    the same model). Anything else is refused with a :class:`~memopt_nb.errors.MemoptError` naming what works."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return lambda model: _like(optimizer, model)
    if (isinstance(optimizer, type) and not issubclass(optimizer, torch.optim.Optimizer)) or not callable(optimizer):
        raise MemoptError(f"optimizer= is {_what(optimizer)}; give {_OPTIMIZER_FORMS}")

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        try:
            opt = optimizer(model.parameters())
        except Exception as exc:
            raise MemoptError(f"optimizer=: calling it on the model's parameters raised {type(exc).__name__}: "
                              f"{exc}; give {_OPTIMIZER_FORMS}") from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise MemoptError(f"optimizer= must make a torch.optim.Optimizer from the parameters; it made "
                              f"{_what(opt)}. Give {_OPTIMIZER_FORMS}")
        return opt

    return make


def _what(obj: Any) -> str:
    name = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    return f"the class {name}" if isinstance(obj, type) else f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _like(template: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``template``'s class over ``model``, with ``template``'s parameter groups and their settings:
    each of the model's parameters, in order, joins the first group whose next parameter has its shape (a parameter
    no group expects, e.g. a frozen one, joins none)."""
    groups = template.param_groups
    want = [[tuple(p.shape) for p in g["params"]] for g in groups]
    taken: list[list[torch.nn.Parameter]] = [[] for _ in groups]
    for p in model.parameters():
        for i, shapes in enumerate(want):
            if len(taken[i]) < len(shapes) and shapes[len(taken[i])] == tuple(p.shape):
                taken[i].append(p)
                break
    cls = type(template).__name__
    if any(len(t) != len(w) for t, w in zip(taken, want, strict=True)):
        held = ", ".join(str(len(w)) for w in want)
        raise MemoptError(f"optimizer=: this {cls} holds parameters ({held} per group) that the builder's model does "
                          f"not have in that order and shape; pass torch.optim.{cls} or a function of the parameters "
                          f"(optimizer=lambda params: torch.optim.{cls}(params, ...)) instead")
    new = [{**{k: v for k, v in g.items() if k != "params"}, "params": t} for g, t in zip(groups, taken, strict=True)]
    try:
        return type(template)(new, **template.defaults)
    except TypeError:
        try:
            return type(template)(new)
        except Exception as exc:
            raise MemoptError(f"optimizer=: could not make another {cls} like this one ({type(exc).__name__}: {exc});"
                              f" pass a function of the parameters, optimizer=lambda params: torch.optim.{cls}(params, "
                              "...)") from exc


#: why max_batch needs the optimizer, and how to give it
NO_OPTIMIZER = ("max_batch needs the optimizer you will train with: its state is part of every peak, and a plan that "
                "moves state applies to that optimizer only. Give " + _OPTIMIZER_FORMS
                + ", or let builder(batch_size) return (model, inputs, loss_fn, optimizer)")


def _unpack(built: Any, make: Callable[[torch.nn.Module], torch.optim.Optimizer] | None, *,
            required: bool = False) -> tuple[torch.nn.Module, tuple, dict, Any, torch.optim.Optimizer]:
    """``(model, args, kwargs, loss_fn, optimizer)`` of a builder's result; the optimizer ``make(model)`` where given,
    else the builder's, else (unless ``required``, then refused) an Adam."""
    if not isinstance(built, (tuple, list)) or len(built) < 3:
        raise MemoptError("builder(batch_size) must return (model, inputs, loss_fn) or (model, inputs, loss_fn, "
                          f"optimizer), with inputs a tuple of positional or a dict of keyword inputs; got "
                          f"{type(built).__name__}")
    model, raw, loss_fn = built[0], built[1], built[2]
    if not isinstance(model, torch.nn.Module):
        raise MemoptError(f"builder(batch_size) must return a torch.nn.Module first, got {type(model).__name__}")
    args, kwargs = ((), dict(raw)) if isinstance(raw, Mapping) else (tuple(raw), {})
    opt = built[3] if len(built) > 3 and isinstance(built[3], torch.optim.Optimizer) else None
    if make is not None:
        opt = make(model)
    if opt is None:
        if required:
            raise MemoptError(NO_OPTIMIZER)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, args, kwargs, loss_fn, opt


def _batch_inputs(built: Any) -> tuple[Any, Any]:
    """``(inputs, loss_fn)`` of a builder's result, for :func:`memopt_nb.profile`'s ``batch_fn``."""
    _, args, kwargs, loss_fn, _ = _unpack(built, None)
    return (kwargs if kwargs else args), loss_fn


class BatchProfiles:
    """Profiles of a builder's model by batch, as :func:`max_batch` and :func:`memopt_nb.evaluate` use them: measured
    (:func:`memopt_nb.profile`) at the batches :meth:`profiled`, every other batch on the line through two of them
    (:meth:`fit`, :func:`~memopt_nb.profiling.fallback.extrapolate`).

    ``builder(batch_size) -> (model, inputs, loss_fn[, optimizer])``, called once per batch profiled (its model is
    let go before the next is built); ``optimizer``: as :func:`max_batch` takes it (default: the builder's, else an
    Adam; with ``require_optimizer``, the builder's or refused); ``options``: more keywords for
    :func:`memopt_nb.profile` (``selective=True``).
    """

    def __init__(self, builder: Callable[[int], Any], optimizer: OptimizerArg = None, *, repeats: int = 1,
                 autocast: torch.dtype | str | None = None, options: Mapping[str, Any] | None = None,
                 require_optimizer: bool = False) -> None:
        self.builder, self.optimizer, self.repeats, self.autocast = builder, optimizer, repeats, autocast
        self._make_optimizer = optimizer_maker(optimizer)  # refuses what is no optimizer before anything is built
        self.require_optimizer = require_optimizer
        #: the class name of the optimizer the profiles were made with
        self.optimizer_class: str | None = None
        self.options = dict(options or {})
        self.profiles: dict[int, Any] = {}
        self.line: list[int] = []
        self._cache: dict[tuple[int, int, int], Any] = {}

    def make(self, b: int) -> tuple:
        """``(model, args, kwargs, loss_fn, optimizer)`` from the builder at batch ``b``."""
        built = _unpack(self.builder(b), self._make_optimizer, required=self.require_optimizer)
        self.optimizer_class = type(built[4]).__name__
        return built

    def profiled(self, b: int) -> Any:
        """The profile measured at batch ``b`` (where the step does not fit, :func:`memopt_nb.profile` extrapolates it
        from smaller batches the builder makes)."""
        if b not in self.profiles:
            gc.collect()  # the previous batch's model is gone before this one is built
            model, args, kwargs, loss_fn, opt = self.make(b)
            smaller = (lambda k: _batch_inputs(self.builder(k))) if not (args and kwargs) else None
            self.profiles[b] = profile(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt,
                                       repeats=self.repeats, autocast=self.autocast, batch_fn=smaller,
                                       **self.options)
        return self.profiles[b]

    def fit(self, lo: int, hi: int, check: int | None = None) -> None:
        """Predict every other batch on the line through the profiles at ``lo`` and ``hi``; with ``check``, the
        profile there must lie on it (else :class:`~memopt_nb.errors.ProfileError`: not linear in the batch)."""
        extrapolate({lo: self.profiles[lo], hi: self.profiles[hi]}, hi,
                    check=(check, self.profiles[check]) if check is not None else None)
        self.line = [lo, hi]
        self._cache.clear()

    def at(self, b: int) -> Any:
        """The profile at batch ``b``: measured where it was profiled, else extrapolated on the line."""
        if b in self.profiles:
            return self.profiles[b]
        if len(self.line) != 2:
            raise MemoptError(f"no profile at batch {b} and no line to extrapolate it on (BatchProfiles.fit)")
        key = (self.line[0], self.line[1], b)
        if key not in self._cache:
            lo, hi = self.line
            self._cache[key] = extrapolate({lo: self.profiles[lo], hi: self.profiles[hi]}, b)
        return self._cache[key]

    def extrapolated(self, b: int) -> bool:
        return b not in self.profiles or self.profiles[b].meta.get("method") == "extrapolated"


@task("max_batch")
def max_batch(builder: Callable[[int], Any], budget: int | str | None = None,
              device: DeviceSpec | str | None = None, optimizer: OptimizerArg = None, *,
              planner: str = "optimal", strategies: Sequence[str] = DEFAULT_STRATEGIES,
              offload_state: bool | str | Iterable[str] = True, step_in_backward: bool = False,
              probe: Sequence[int] = (2, 4, 8), repeats: int = 1, autocast: torch.dtype | str | None = None,
              search_timesteps: int | None = None, seed: int = 0, limit: int = MAX_BATCH_LIMIT,
              verify: bool = True, head: str | None = None) -> MaxBatch:
    """The largest batch any plan fits under ``budget``, its plan and predicted throughput, and the fastest batch.

    Args:
        builder: ``builder(batch_size) -> (model, inputs, loss_fn[, optimizer])`` as :func:`memopt_nb.evaluate`
            takes it (``inputs``: a tuple of positional inputs or a dict of keyword inputs); called only at the
            batches profiled.
        budget: bytes or a size such as ``"2GiB"``; default: on the device the model is on, what it can still give a
            step — its capacity (inside :func:`memopt_nb.limit_memory`, the limit) less what live tensors outside the
            step hold (your other model, a copy of the parameters), said in :attr:`MaxBatch.notes`; on a preset, its
            capacity.
        device: ``None`` — the device the model is built on (profiled there); a preset name or DeviceSpec — plan for
            it from profiles made here.
        optimizer: the optimizer you will train with, whose state is part of every peak and which a plan that moves
            state is made for: a class (``torch.optim.AdamW``), a function of the parameters
            (``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``) or your optimizer itself (its class and its parameter
            groups' settings, the groups matched to each build's parameters by shape); default: the one the builder
            returns. Without either, max_batch refuses before profiling anything rather than plan for an optimizer
            you may not use.
        planner: ``"optimal"`` (the exact MILP optimum, fast) or ``"search"`` (the PPO agents, ``search_timesteps``).
        strategies, offload_state, step_in_backward: the plan space, as for :func:`memopt_nb.solvers.optimal`.
        probe: three small batches to profile; the two largest give the line, the smallest checks it.
        repeats: timed steps per profile. autocast: as :func:`memopt_nb.profile` takes it.
        limit: the largest batch considered.
        head: ``"chunked"`` lets memopt's plans compute the LM head and its loss a chunk of tokens at a time (as
            :func:`memopt_nb.profile` takes it; not bit-identical); plain training and the baselines keep it whole.
        verify: (planning for the device the model is on) build the model at the answer and measure real steps under
            its plan (:attr:`MaxBatch.verified`); where they do not fit the budget, the answer is the largest smaller
            batch that does. Off, nothing but the three probes (and two profiles near plain training's largest batch)
            runs.

    Raises :class:`~memopt_nb.errors.BudgetError` when not even the smallest probe batch fits any plan,
    :class:`~memopt_nb.errors.ProfileError` when the step's bytes are not linear in the batch, and
    :class:`~memopt_nb.errors.MemoptError` when no optimizer is known, or when the builder's step does not grow with
    the batch (a builder that ignores its argument: every batch would seem to fit).

    A model whose own training state does not fit the budget is profiled state-streamed
    (:mod:`memopt_nb.profiling.streamed`). Its peaks are made mostly of state, which barely moves with the batch, so
    where the answer's step does not run inside the budget the batch is not shrunk in proportion to the excess: plans
    are made for the budget less a growing margin (:data:`VERIFY_MARGINS`, at least the measured excess over the
    prediction), each at the largest batch whose smallest peak fits it, and the answer is the largest batch whose step
    ran inside the budget; batch 1 under its smallest-peak plan is the last one tried.
    """
    t0 = time.perf_counter()
    probes = _check_args(planner, probe)
    value = _absolute_budget(budget) if budget is not None else None
    bp = BatchProfiles(builder, optimizer, repeats=repeats, autocast=autocast, require_optimizer=True,
                       options={"head": head} if head else None)
    stage("probe profiles", total=len(probes))
    for b in probes:
        bp.profiled(b)
        advance()
    _check_grows(bp.profiles[probes[0]], bp.profiles[probes[-1]], probes[0], probes[-1])
    bp.fit(probes[1], probes[2], check=probes[0])  # refuses a step that is not linear in the batch
    last = bp.profiles[probes[-1]]
    spec = DeviceSpec.resolve(device, last.device) if device is not None else last.device
    notes: list[str] = []
    if value is None:  # what the device can still give, with what the notebook holds there now
        free = default_budget(last, spec)
        value = free.free_bytes
        notes.append(free.line())
    pl = _Planner(bp.at, spec, value, planner, strategies,
                  {"offload_state": offload_state, "step_in_backward": step_in_backward}, search_timesteps, seed)
    plain_max = _plain_max(bp, pl, probes, limit, notes)
    best_max = _plan_max(pl, limit, notes)
    verified: dict[str, Any] = {}
    if verify and device is None:
        stage("checking the answer under its plan")
        best_max = _verify(bp.make, best_max, pl, autocast, verified, notes)
    stage("predicting throughput per batch")
    candidates = sorted({b for b in _powers(best_max)} | {best_max} | ({plain_max} if plain_max else set()))
    memopt_ans = _answer(planner if planner == "optimal" else "memopt-ppo", candidates, best_max, pl.plan_for, value)
    plain_ans = _answer("none", [b for b in candidates if plain_max and b <= plain_max], plain_max,
                        lambda b: solvers.none(bp.at(b), None, spec), value)
    baseline_ans = _baseline_answer(pl, candidates, best_max)
    throughputs = {a.method: a._tp for a in (memopt_ans, plain_ans, baseline_ans) if hasattr(a, "_tp")}
    for a in (memopt_ans, plain_ans, baseline_ans):
        a.__dict__.pop("_tp", None)
    return MaxBatch(memopt=memopt_ans, plain=plain_ans, baseline=baseline_ans, budget_bytes=value, device=spec.name,
                    probes=probes, profiled=sorted(bp.profiles), throughputs=throughputs,
                    seconds=time.perf_counter() - t0, notes=notes, verified=verified,
                    optimizer=bp.optimizer_class or "", noise=_noise(bp.profiles.values()), _at=bp.at)


def _noise(profiles: Iterable[Any]) -> float:
    """The largest relative spread of the profiled step times (``meta["timing"]["step_spread"]``), at least
    :data:`NOISE_FLOOR` (:data:`CPU_NOISE_FLOOR` for profiles made on the CPU)."""
    profiles = list(profiles)
    floor = CPU_NOISE_FLOOR if any(p.device.kind == "cpu" for p in profiles) else NOISE_FLOOR
    spreads = [float((p.meta.get("timing") or {}).get("step_spread", 0.0)) for p in profiles]
    return max([floor, *spreads])


def _check_args(planner: str, probe: Sequence[int]) -> list[int]:
    if planner not in ("optimal", "search"):
        raise MemoptError(f"planner must be 'optimal' or 'search', got {planner!r}")
    probes = sorted({int(b) for b in probe})
    if len(probes) != 3 or probes[0] < 1:
        raise MemoptError(f"probe must be three different positive batch sizes, e.g. (2, 4, 8); got {tuple(probe)!r}")
    return probes


class _Planner:
    """max_batch's plans by batch: the floor (smallest reachable peak), plain training's peak, and a plan for the
    budget (or a smaller one), each from the profile at that batch."""

    def __init__(self, at: Callable[[int], Any], spec: DeviceSpec, value: int, planner: str,
                 strategies: Sequence[str], space: dict[str, Any], search_timesteps: int | None, seed: int) -> None:
        self.at, self.spec, self.value, self.planner = at, spec, value, planner
        self.strategies, self.space, self.search_timesteps, self.seed = strategies, space, search_timesteps, seed
        self.plans: dict[tuple[int, int], Plan | None] = {}

    def floor(self, b: int) -> int:
        return int(solvers.min_peak(self.at(b), self.spec, self.strategies, **self.space))

    def plain_peak(self, b: int) -> int:  # plain training's peak, also where it is far above the device
        at = self.at(b)
        return int(simulate(at, Plan.uniform(at, "keep", method="none"), self.spec).peak_bytes)

    def plan_for(self, b: int, budget: int | None = None) -> Plan | None:
        """The plan at batch ``b`` for ``budget`` (default: max_batch's), ``None`` where there is none."""
        key = (b, self.value if budget is None else int(budget))
        if key not in self.plans:
            prof = self.at(b)
            try:
                if self.planner == "search":
                    self.plans[key] = search(prof, key[1], self.spec, total_timesteps=self.search_timesteps,
                                             seed=self.seed, strategies=self.strategies, **self.space)
                else:
                    self.plans[key] = solvers.optimal(prof, key[1], self.spec, self.strategies, **self.space)
            except (BudgetError, PlanError):
                self.plans[key] = None
        return self.plans[key]


def _plain_max(bp: BatchProfiles, pl: _Planner, probes: list[int], limit: int, notes: list[str]) -> int | None:
    """Plain training's largest batch, with profiles near it for times that hold there."""
    value = pl.value
    plain_max = _largest(lambda b: pl.plain_peak(b) <= value, 1, limit)
    if plain_max is not None and plain_max >= 2 * probes[-1]:
        hi, mid = plain_max, plain_max // 2
        stage("profiles near plain training's largest batch", total=2)
        try:
            bp.profiled(mid)
            advance()
            bp.profiled(hi)
            advance()
            bp.fit(mid, hi, check=probes[-1])
            plain_max = _largest(lambda b: pl.plain_peak(b) <= value, 1, limit)
        except MemoptError as exc:
            notes.append(f"kept the line through the probe batches: profiling near batch {hi} said: {exc}")
    return plain_max


def _plan_max(pl: _Planner, limit: int, notes: list[str]) -> int:
    """The largest batch whose floor fits the budget and for which the planner finds a plan within it."""
    value = pl.value
    stage("finding the largest batch a plan fits")
    best_max = _largest(lambda b: pl.floor(b) <= value, 1, limit)
    if best_max is None:
        raise BudgetError(f"not even batch 1 fits any plan in {format_bytes(value)} on {pl.spec.name}: the smallest "
                          f"peak there is {format_bytes(pl.floor(1))}. A bigger device, a smaller model, or a wider "
                          "plan space (offload_state=True, strategies=memopt.plan.STRATEGIES) would lower it")
    if best_max >= limit:
        notes.append(f"every batch up to {limit} fits a plan (the largest considered)")
    top = best_max
    while best_max > max(1, top - 8) and not _usable(pl.plan_for(best_max), value):
        best_max -= 1  # at the floor's very edge the planner may find no plan within the budget: the next that does
    if best_max < top:
        notes.append(f"batch {top} is at the smallest peak's edge and no plan there came within the budget; the "
                     f"answer is batch {best_max}")
    return best_max


def _baseline_answer(pl: _Planner, candidates: list[int], best_max: int) -> BatchAnswer:
    """The classic baseline that fits the largest batch (then the fastest), as a :class:`BatchAnswer`."""
    value, spec, at = pl.value, pl.spec, pl.at
    best = BatchAnswer(method="none")
    for name, fn in solvers.CLASSIC_BASELINES.items():
        if name == "none":
            continue

        def make(b: int, fn: Callable[..., Plan] = fn) -> Plan | None:
            try:
                p = fn(at(b), value, spec)
            except (BudgetError, PlanError):
                return None
            return p if p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= value else None

        top = _largest(lambda b, make=make: make(b) is not None, 1, best_max)
        if top is None:
            continue
        ans = _answer(name, sorted({b for b in candidates if b <= top} | {top}), top, make, value)
        if (ans.batch or 0, ans.best_throughput or 0.0) > (best.batch or 0, best.best_throughput or 0.0):
            best = ans
    return best if best.batch is not None else BatchAnswer(method="-")


def _absolute_budget(budget: int | float | str) -> int:
    """``max_batch``'s budget in bytes, read as :func:`memopt_nb.resolve_budget` reads it; a share of the peak
    (``"60%"``, ``0.6``) is refused, since the peak depends on the batch being answered."""
    if is_share(budget):
        raise BudgetError(f"max_batch needs an absolute budget (bytes or a size such as '2GiB'), not {budget!r}: a "
                          "share of the peak depends on the batch being answered")
    return resolve_budget(budget)


def _check_grows(small: Any, large: Any, lo: int, hi: int) -> None:
    """Refuse a builder whose step does not grow with the batch: neither its inputs nor its saved activations are
    larger at batch ``hi`` than at ``lo`` (it ignores its argument, e.g. a closure over a fixed batch). Extrapolated in
    the batch, such a step would fit any batch."""
    def acts(p: Any) -> int:
        return sum(u.saved_bytes for u in p.units)

    if large.input_bytes <= small.input_bytes and acts(large) <= acts(small):
        raise MemoptError(f"builder({hi}) made a step no larger than builder({lo}) (inputs "
                          f"{format_bytes(large.input_bytes)}, saved activations {format_bytes(acts(large))} at both):"
                          " it seems to ignore its batch argument, and then every batch would seem to fit. "
                          "builder(b) must build inputs of b samples, e.g. "
                          "lambda b: (model, (torch.randn(b, 3, 32, 32),), loss_fn, opt)")


#: shares of the budget kept free, in turn, when the answer's step does not run inside the budget under its plan
VERIFY_MARGINS = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5)


def _run(make: Callable[[int], tuple], batch: int, plan: Plan, autocast: Any) -> tuple[int | None, Any]:
    """One real step at ``batch`` under ``plan``: its measured peak (``None``: out of memory) and the measurement."""
    gc.collect()
    model, args, kwargs, loss_fn, opt = make(batch)
    try:
        m = measure(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1,
                    autocast=autocast)
    except torch.OutOfMemoryError:
        return None, None
    finally:
        del model, opt
    return int(m.peak_bytes), m


def _verify(make: Callable[[int], tuple], batch: int, pl: _Planner, autocast: Any, out: dict[str, Any],
            notes: list[str]) -> int:
    """Run the answer: build the model at ``batch`` and measure a real step under its plan. Where it does not fit
    the budget (out of memory, or a measured peak above it), plan for the budget less the next of
    :data:`VERIFY_MARGINS` (at least the share the step measured above its prediction) at the largest smaller batch
    whose floor fits that, and run that; last, batch 1 under its smallest-peak plan. The answer is the first batch
    that ran inside the budget; its plan replaces the one for the budget there."""
    budget, tried, margin, failed = pl.value, [], 0.0, batch + 1
    targets: list[tuple[int, int]] = [(batch, budget)]
    while targets:
        b, target = targets.pop(0)
        plan = pl.plan_for(b, target)
        peak, m = _run(make, b, plan, autocast) if plan is not None else (None, None)
        if plan is not None and peak is not None and peak <= budget:
            out.update({"batch": b, "peak_bytes": peak, "predicted_peak_bytes": plan.predicted_peak_bytes,
                        "step_time": m.step_time, "planned_for_bytes": target})
            pl.plans[(b, budget)] = plan
            if tried:
                notes.extend(tried)
                notes.append(f"batch {b} ran under a plan for {format_bytes(target)}, {format_bytes(peak)} against "
                             f"the budget of {format_bytes(budget)}")
            return b
        failed = min(failed, b)
        if plan is None:
            tried.append(f"batch {b}: no plan for {format_bytes(target)}")
        else:
            tried.append(f"batch {b} under a plan for {format_bytes(target)} (predicted "
                         f"{format_bytes(plan.predicted_peak_bytes or 0)}) measured "
                         + (format_bytes(peak) if peak is not None else "out of memory"))
            if peak is not None and plan.predicted_peak_bytes:  # what the prediction missed, kept free next
                margin = max(margin, (peak - plan.predicted_peak_bytes) / budget + 0.01)
        margin = next((x for x in VERIFY_MARGINS if x > margin), math.inf)
        nxt = _next_try(pl, budget, margin, failed) if math.isfinite(margin) else None
        if nxt is None and failed > 1:  # last: batch 1 under a plan for little more than its smallest peak
            low = pl.floor(1)
            nxt = (1, min(budget, low + (budget - low) // 10))
            margin = math.inf
        if nxt is not None:
            targets.append(nxt)
    notes.extend(tried)
    raise BudgetError(f"no batch down to 1 ran inside {format_bytes(budget)} under its plan: " + "; ".join(tried))


def _next_try(pl: _Planner, budget: int, margin: float, failed: int) -> tuple[int, int] | None:
    """The largest batch below ``failed`` whose floor fits the budget less ``margin``, and that budget."""
    target = int(budget * (1 - margin))
    if failed <= 1:
        return None
    b = _largest(lambda k: pl.floor(k) <= target, 1, failed - 1)
    return (b, target) if b is not None else None


def _usable(p: Plan | None, budget: int) -> bool:
    """Whether a plan answers: predicted within the budget, with a step time."""
    return (p is not None and p.predicted_step_time is not None and p.predicted_peak_bytes is not None
            and p.predicted_peak_bytes <= budget and p.predicted_step_time > 0)


def _powers(top: int) -> list[int]:
    out, b = [], 1
    while b <= top:
        out.append(b)
        b *= 2
    return out


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest ``b`` in ``[low, high]`` with ``fits(b)``, for ``fits`` true up to some batch and false above."""
    if not fits(low):
        return None
    good, b = low, low
    while True:  # doubling
        nxt = min(high, b * 2)
        if nxt == b:
            return b
        if not fits(nxt):
            bad = nxt
            break
        good = b = nxt
    while bad - good > 1:  # bisection
        m = (good + bad) // 2
        if fits(m):
            good = m
        else:
            bad = m
    return good


def _answer(method: str, batches: Sequence[int], top: int | None, make: Callable[[int], Plan | None],
            budget: int) -> BatchAnswer:
    ans = BatchAnswer(method=method)
    if top is None:
        return ans
    tp: dict[int, float] = {}
    plans: dict[int, Plan] = {}
    for b in batches:
        p = make(b)
        if p is None or not _usable(p, budget):
            continue
        plans[b] = p
        tp[b] = b / p.predicted_step_time
    if top in plans:
        ans.batch, ans.plan = top, plans[top]
        ans.step_time, ans.throughput = plans[top].predicted_step_time, tp[top]
    if tp:
        best = max(tp, key=lambda b: (tp[b], b))
        ans.best_batch, ans.best_plan = best, plans[best]
        ans.best_step_time, ans.best_throughput = plans[best].predicted_step_time, tp[best]
    ans.__dict__["_tp"] = {b: round(v, 3) for b, v in sorted(tp.items())}
    if not math.isfinite(ans.best_throughput or 0.0):
        ans.best_throughput = None
    return ans
