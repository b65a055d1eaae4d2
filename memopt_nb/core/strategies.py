"""The strategies and placements a plan may use, each declared once: everything else derives from this table.

An activation strategy (:class:`Strategy`) says what happens to a unit's activations between its forward and its
backward; a placement (:class:`Place`) where one piece of a unit's training state (its optimizer state, gradients,
parameters) lives between uses. From :data:`REGISTRY` and :data:`PLACES` come the plan's vocabulary
(:data:`STRATEGIES`, :data:`STATE_CHOICES`, ...), the integer codes the simulator and the planners use
(:func:`code_of`, :data:`NAMES`), the planners' option columns, the runtime's mechanism table and the letters and
colours of the plots. A new strategy is one declaration here, its cost rule in the simulator (where its flags do not
already say it), its mechanism in the runtime, and their tests.

Codes are consecutive in declaration order: a strategy with ``variants`` (``selective``'s save-sets) takes one code per
variant, ``code + j`` for ``variants[j]``. A plan stores names, never codes, so codes may change between versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import PlanError

__all__ = ["CODES", "DEFAULT_STRATEGIES", "DISTANCES", "GRAD_PLACES", "LETTERS", "NAMES", "OFFLOADING",
           "OPTIMIZER_PLACES", "PARAM_PLACES", "PLACES", "PLACE_OF", "Place", "RECOMPUTING", "REGISTRY", "SAVE_SETS",
           "STATE_CHOICES", "STATE_PIECES", "STRATEGIES", "Strategy", "WINDOWS", "by_code", "by_name", "code_of",
           "save_set_of"]

#: Offload windows the planners choose from (a timed strategy's first timing parameter).
WINDOWS = (0, 1, 2)
#: Prefetch distances the planners choose from (a timed strategy's second timing parameter).
DISTANCES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Strategy:
    """One activation strategy.

    Attributes:
        name: as plans and ``strategies=`` spell it.
        letter: one letter for compact plan strings (the demo, plots).
        saves: what it saves and what it costs, in a few words for a user.
        recomputes: its unit runs under checkpointing and is recomputed in backward.
        offloads: it hands tensors to the swap engine: its unit's saved tensors, or, when it also ``recomputes``, the
            inputs its checkpoint keeps.
        timed: the planners choose its timing: an offload window from :data:`WINDOWS` and a prefetch distance from
            :data:`DISTANCES` (see :mod:`memopt_nb.core.plan`); otherwise it always carries ``timing``.
        timing: the ``(offload window, prefetch distance)`` it carries when not ``timed`` (a plan's decision for an
            offloading one is given it); for a timed one, where nothing chose one (the floor's search).
        variants: the named forms it comes in, one code each (``selective``: its save-sets).
        default: searched unless ``strategies=`` says otherwise (the others are opt-in).
        exact: training under it gives the same losses, gradients and optimizer state bit for bit as without a plan.
        code: its (first) integer code; set by the registry from the declaration order.
    """

    name: str
    letter: str
    saves: str
    recomputes: bool = False
    offloads: bool = False
    timed: bool = False
    timing: tuple[int, int] = (1, 1)
    variants: tuple[str, ...] = ()
    default: bool = False
    exact: bool = True
    code: int = field(default=-1, compare=False)

    @property
    def codes(self) -> range:
        """Every code of this strategy (one per variant; one if it has none)."""
        return range(self.code, self.code + max(1, len(self.variants)))

    @property
    def keeps_inputs(self) -> bool:
        """Recomputed with the inputs its checkpoint keeps left on the device (plain recompute, selective)."""
        return self.recomputes and not self.offloads


_DECLARED = (
    Strategy("keep", "K", "nothing: autograd keeps the unit's saved tensors until its backward", default=True),
    Strategy("recompute", "R", "the unit's saved tensors; costs its forward again in backward (checkpointing)",
             recomputes=True, default=True),
    Strategy("swap", "S", "the unit's saved tensors, copied to the host and back; costs copy time that may overlap",
             offloads=True, timed=True, default=True),
    Strategy("recompute_offload", "O", "the saved tensors and the inputs the recomputation needs (copied to the "
             "host); costs a recomputation and the copies", recomputes=True, offloads=True, timed=True),
    Strategy("selective", "P", "the saved tensors but the outputs of the ops its save-set keeps; costs recomputing "
             "the rest", recomputes=True, variants=("matmuls", "alternate", "attention")),
)


def _numbered(declared: tuple[Strategy, ...]) -> tuple[Strategy, ...]:
    out, code = [], 0
    for s in declared:
        out.append(replace(s, code=code))
        code += max(1, len(s.variants))
    return tuple(out)


#: Every activation strategy, in declaration order, with its code.
REGISTRY: tuple[Strategy, ...] = _numbered(_DECLARED)
_BY_NAME = {s.name: s for s in REGISTRY}
_BY_CODE = tuple((s, j) for s in REGISTRY for j in range(max(1, len(s.variants))))

#: Every activation strategy a plan may use.
STRATEGIES: tuple[str, ...] = tuple(s.name for s in REGISTRY)
#: The strategies planners search unless given ``strategies=``.
DEFAULT_STRATEGIES: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.default)
#: The strategies that offload to the host (those ``timed`` take ``offload_window`` and ``prefetch_distance``).
OFFLOADING: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.offloads)
#: The strategies whose units run under checkpointing and are recomputed in backward.
RECOMPUTING: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.recomputes)
#: The save-sets a ``selective`` unit may use (which ops' outputs it keeps; the rest is recomputed in backward): every
#: matmul, convolution and attention kernel; torchtitan's op-SAC rule (attention and every other matmul); attention
#: kernels only. A profile made with ``selective=True`` says which of them each unit offers and what each costs.
SAVE_SETS: tuple[str, ...] = _BY_NAME["selective"].variants
#: Strategy name -> its (first) code.
CODES: dict[str, int] = {s.name: s.code for s in REGISTRY}
#: Code -> strategy name (every code of a strategy with variants names it).
NAMES: dict[int, str] = {code: s.name for code, (s, _) in enumerate(_BY_CODE)}
#: Strategy name -> its letter.
LETTERS: dict[str, str] = {s.name: s.letter for s in REGISTRY}


def by_name(name: str) -> Strategy:
    """The strategy called ``name``; :class:`~memopt_nb.core.errors.PlanError` naming the others if there is none."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise PlanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}") from None


def by_code(code: int) -> tuple[Strategy, int]:
    """The strategy of ``code`` and the index of its variant (0 for one without variants)."""
    code = int(code)
    if not 0 <= code < len(_BY_CODE):
        raise PlanError(f"strategy code {code} is not a strategy: codes are 0..{len(_BY_CODE) - 1} ("
                        + ", ".join(f"{c} {n}" for c, n in NAMES.items()) + ")")
    return _BY_CODE[code]


def code_of(strategy: str, variant: str = "") -> int:
    """The code of ``strategy`` (with its variant, e.g. a save-set for ``"selective"``: its code + the variant's
    index)."""
    s = by_name(strategy)
    if s.variants:
        if variant not in s.variants:
            raise PlanError(f"a {s.name} unit needs a save-set, one of {', '.join(s.variants)}; got {variant!r}")
        return s.code + s.variants.index(variant)
    return s.code


def save_set_of(code: int) -> str:
    """The variant (save-set) a strategy code stands for (``""`` for a strategy without variants)."""
    s, j = by_code(code)
    return s.variants[j] if s.variants else ""


@dataclass(frozen=True)
class Place:
    """Where one piece of a unit's training state may live.

    Attributes:
        name: as plans spell it (``Decision.optimizer``, ``.grads``, ``.params``).
        pieces: the pieces of state (:data:`STATE_PIECES`) that may live there.
        saves: what it saves and what it costs, in a few words for a user.
        moves: the piece leaves the device between uses (a plan may use it only where ``offload_state=`` names the
            piece).
        opt_in: the planners' keyword argument that must be true for a plan to use it (it changes what the training
            loop may do); ``""``: none.
    """

    name: str
    pieces: tuple[str, ...]
    saves: str
    moves: bool = False
    opt_in: str = ""


#: The pieces ``offload_state=`` names.
STATE_PIECES = ("optimizer", "grads", "params")
#: Every placement, in declaration order (``"resident"`` first).
PLACES: tuple[Place, ...] = (
    Place("resident", STATE_PIECES, "nothing: the piece stays on the device"),
    Place("offload", STATE_PIECES, "the piece, on the host between uses; costs the copies", moves=True),
    Place("stream", ("optimizer",), "the optimizer state, brought back one parameter at a time for the step",
          moves=True),
    Place("step", ("grads",), "the gradients, stepped in backward and freed", opt_in="step_in_backward"),
)
#: Where a unit's optimizer state may live.
OPTIMIZER_PLACES: tuple[str, ...] = tuple(p.name for p in PLACES if "optimizer" in p.pieces)
#: Where a unit's gradients may live (``"step"``: stepped in backward, then freed).
GRAD_PLACES: tuple[str, ...] = tuple(p.name for p in PLACES if "grads" in p.pieces)
#: Where a unit's parameters may live.
PARAM_PLACES: tuple[str, ...] = tuple(p.name for p in PLACES if "params" in p.pieces)
#: Every ``(optimizer, grads, params)`` placement, all-resident first (index 0); planners encode placements as indices.
STATE_CHOICES: tuple[tuple[str, str, str], ...] = tuple(
    (o, g, p) for o in OPTIMIZER_PLACES for g in GRAD_PLACES for p in PARAM_PLACES)
#: Placement name -> its declaration.
PLACE_OF: dict[str, Place] = {p.name: p for p in PLACES}
