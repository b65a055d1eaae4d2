"""One training step as memopt_nb measures it, and a guard that leaves the model as it was."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..core.errors import ProfileError
from .limit import recount, uncounted

__all__ = ["AUTOCAST_DTYPES", "autocast_name", "default_loss", "forward_autocast", "kept_outputs", "keeping_outputs",
           "model_keywords", "output_tensors", "preserved_state", "resolve_autocast", "step_autocast", "training_step"]


Mark = Callable[[Any], None]

#: The names ``autocast=`` takes for each low-precision dtype (or pass the dtype itself).
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                                           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}

#: (device type, dtype) the forward and loss of :func:`training_step` run under, or ``None``: set by
#: :func:`step_autocast` for the duration of a profile or a measurement (a context variable, so each thread has its own)
_AUTOCAST: contextvars.ContextVar[tuple[str, torch.dtype] | None] = contextvars.ContextVar("memopt_autocast",
                                                                                          default=None)


#: the model output the last :func:`training_step` kept, inside :func:`keeping_outputs` (else ``None``)
_KEPT: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("memopt_kept_output", default=None)


@contextlib.contextmanager
def keeping_outputs(enabled: bool = True) -> Iterator[None]:
    """Training steps inside keep each step's model output until the next step's forward has returned, as the loop in
    the transformers documentation does (``outputs = model(**batch); outputs.loss.backward(); ...``: ``outputs``
    lives through backward, the optimizer step and the next forward). Nothing changes where ``enabled`` is false."""
    token = _KEPT.set([] if enabled else None)
    try:
        yield
    finally:
        _KEPT.reset(token)


def kept_outputs() -> list[Any]:
    """The output the last step kept (inside :func:`keeping_outputs`): a meter counts it at the next step's start."""
    return list(_KEPT.get() or [])


def output_tensors(obj: Any, path: str = "output", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for each tensor a model's output holds, nested containers and objects such as a transformers
    cache included (``output.logits``, ``output.past_key_values.layers[0].keys``)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from output_tensors(v, f"{path}.{k}" if isinstance(k, str) and k.isidentifier() else f"{path}[{k!r}]",
                                      depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from output_tensors(v, f"{path}[{i}]", depth + 1)
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from output_tensors(v, f"{path}.{k}", depth + 1)


def resolve_autocast(value: Any, device: torch.device, what: str) -> torch.dtype | None:
    """The dtype of ``autocast=`` (``None``, a dtype, or one of :data:`AUTOCAST_DTYPES`' names) for ``what``
    (``"profile"``, ``"measure"``, ``"evaluate"``) on ``device``: :class:`ProfileError` for another value, or when
    ``what`` was called inside an enabled ``torch.autocast`` — then its backward and optimizer step would run under
    autocast too, which a training loop's do not, and its weight cache would hold the low-precision copies of the
    parameters through backward (the peak would not be the loop's)."""
    if torch.is_autocast_enabled(device.type):
        raise ProfileError(
            f"{what}() was called inside torch.autocast: then its backward and optimizer step run under autocast as "
            f"well, which a training loop's do not (autocast's cache would keep the low-precision copies of the "
            f"weights through backward, and the peak would not be your loop's). Call it outside autocast and pass "
            f"autocast=torch.bfloat16 (or torch.float16): the forward and the loss then run under "
            f"torch.autocast({device.type!r}, dtype=...), backward and the optimizer step outside, as in "
            f"`with torch.autocast(...): loss = loss_fn(model(x))` then `loss.backward()`.")
    if value is None or value is False:
        return None
    dtype = AUTOCAST_DTYPES.get(value.lower()) if isinstance(value, str) else value
    if dtype not in (torch.bfloat16, torch.float16):
        raise ProfileError(f"autocast must be None, torch.bfloat16 or torch.float16 (or one of "
                           f"{', '.join(repr(k) for k in AUTOCAST_DTYPES)}), got {value!r}")
    return dtype


def autocast_name(dtype: torch.dtype | None) -> str | None:
    """How a profile and a plan record an autocast dtype: ``"bfloat16"``, ``"float16"``; ``None`` for none."""
    return str(dtype).removeprefix("torch.") if dtype is not None else None


@contextlib.contextmanager
def step_autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Run the forward and loss of every :func:`training_step` (and every forward a profile makes) inside this block
    under ``torch.autocast(device_type, dtype=dtype)``; ``dtype=None`` changes nothing."""
    token = _AUTOCAST.set((device_type, dtype) if dtype is not None else None)
    try:
        yield
    finally:
        _AUTOCAST.reset(token)


def forward_autocast() -> contextlib.AbstractContextManager:
    """The ``torch.autocast`` a step's forward and loss run under (see :func:`step_autocast`), else a null context.
    Leaving it clears autocast's weight cache, as leaving a training loop's ``with torch.autocast(...)`` does."""
    spec = _AUTOCAST.get()
    return torch.autocast(spec[0], dtype=spec[1]) if spec is not None else contextlib.nullcontext()


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when none is given: the output itself if it is a scalar, else the sum of its elements.

    A stand-in: it has the same backward graph shape as most real losses, so memory and time are representative.
    """
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    tensors = [t for t in _leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ProfileError("the model's output has no floating-point tensor; pass loss_fn=... to say what to train")
    return sum(t.float().sum() for t in tensors)  # type: ignore[return-value]


def _leaves(obj: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(obj)


def model_keywords(model: nn.Module, what: str, reserved: Sequence[str], model_kwargs: Mapping[str, Any] | None,
                   keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword inputs of ``model(...)`` for ``what`` (``"profile"``, ``"measure"``), checked before anything runs.

    ``keywords`` are the keywords ``what`` did not take itself; ``model_kwargs`` is the explicit dict form, for a model
    keyword named like one of ``what``'s own options (``reserved``). Raises :class:`ProfileError` for a keyword given
    both ways, a dict that is not a mapping of names, or a keyword ``model.forward`` does not take (naming
    ``what``'s options, so that a misspelt option such as ``optimiser=`` says what was meant).
    """
    if model_kwargs is None:
        model_kwargs = {}
    if not isinstance(model_kwargs, Mapping) or not all(isinstance(k, str) for k in model_kwargs):
        raise ProfileError(f"model_kwargs must be a dict of keyword inputs of the model, e.g. "
                           f"model_kwargs={{'attention_mask': mask}}, not {type(model_kwargs).__name__}")
    both = sorted(set(model_kwargs) & set(keywords))
    if both:
        raise ProfileError(f"{', '.join(both)} given both as a keyword and in model_kwargs; give each input once")
    merged = {**keywords, **model_kwargs}
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature Python cannot read: let the call decide
        return merged
    takes = [n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        # the model swallows any keyword: refuse only a likely misspelt option (``optimiser=``, ``loss=``)
        for k in keywords:
            close = difflib.get_close_matches(k, reserved, n=1, cutoff=0.6)
            if k not in takes and close:
                raise ProfileError(
                    f"{k}= is not an option of {what}() and {type(model).__name__}.forward() does not name it (it "
                    f"would vanish into its **kwargs); did you mean {close[0]}=? To pass {k} to the model anyway, "
                    f"use model_kwargs={{{k!r}: ...}}"
                )
        return merged
    unknown = [k for k in merged if k not in takes]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(reserved) + takes, n=1)
        hint = f" (did you mean {close[0]}=?)" if close else ""
        raise ProfileError(
            f"{type(model).__name__}.forward() takes no keyword {', '.join(map(repr, unknown))}{hint}; its keyword "
            f"inputs are: {', '.join(takes) or 'none'}. {what}()'s own options are {', '.join(reserved)}; every other "
            f"keyword goes to the model"
        )
    return merged


def training_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor] | None,
                  optimizer: torch.optim.Optimizer | None, mark: Mark | None = None,
                  kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Forward ``model(*inputs, **kwargs)``, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``.

    Returns the detached loss. ``mark(label)`` is called at ``"forward_end"``, ``"loss_end"``, ``"backward_end"``,
    ``"optimizer_end"`` and ``"step_end"`` so a meter can split the step into phases. Inside :func:`step_autocast`
    the forward and the loss run under ``torch.autocast`` (left before ``"loss_end"``).
    """
    mark = mark or (lambda label: None)
    with forward_autocast():  # inside step_autocast(): forward and loss under autocast, backward and step outside
        output = model(*inputs, **(kwargs or {}))
        kept = _KEPT.get()
        if kept is not None:  # the loop's `outputs = model(...)`: the previous step's output goes only now
            kept[:] = [output]
        mark("forward_end")
        loss = loss_fn(output) if loss_fn is not None else default_loss(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ProfileError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                               f"{tuple(getattr(loss, 'shape', ()))}")
        del output
    mark("loss_end")
    loss.backward()
    mark("backward_end")
    if optimizer is not None:
        optimizer.step()
    mark("optimizer_end")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None
    mark("step_end")
    return loss.detach()


def _to_host(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", copy=True)
    return t


@contextlib.contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Run training steps that leave no trace: parameters, buffers, grads, optimizer state and RNG are restored.

    Copies are kept in host memory, so they do not count towards device memory.
    """
    with uncounted():  # host copies: not the emulated device's memory under memopt.limit_memory
        params = {n: _to_host(p) for n, p in model.named_parameters()}
        grads = {n: (_to_host(p.grad) if p.grad is not None else None) for n, p in model.named_parameters()}
        buffers = {n: _to_host(b) for n, b in model.named_buffers()}
        opt_state = tree_map(_to_host, optimizer.state_dict()) if optimizer is not None else None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    training = {m: m.training for m in model.modules()}
    try:
        yield
    finally:
        with torch.no_grad(), uncounted():
            for n, p in model.named_parameters():
                p.copy_(params[n])
                g = grads[n]
                p.grad = None if g is None else g.to(p.device)
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
            if optimizer is not None:
                optimizer.load_state_dict(opt_state)
                if not opt_state["state"]:
                    optimizer.state.clear()
        recount(model, optimizer)  # what the model and optimizer hold now is the device's again
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, flag in training.items():
            m.training = flag
