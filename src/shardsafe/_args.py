"""Checks of public arguments: a wrong type is a ``TypeError`` naming the function and the argument,
raised before any work, instead of an ``AttributeError`` from deep inside."""

from __future__ import annotations

from typing import Any

__all__ = ["check_arg", "check_bool"]


def check_bool(func: str, name: str, value: Any) -> None:
    """``value`` must be ``True`` or ``False`` (not ``"no"``, not ``0``)."""
    if type(value) is not bool:
        raise TypeError(f"{func}: argument {name!r} must be True or False, got {_what(value)}")


def check_arg(func: str, name: str, value: Any, expected: type | tuple[type, ...], *, optional: bool = False) -> None:
    """``value`` must be an instance of ``expected`` (or None when ``optional``)."""
    if (optional and value is None) or isinstance(value, expected):
        return
    types = expected if isinstance(expected, tuple) else (expected,)
    wanted = " or ".join(_name(t) for t in types) + (" or None" if optional else "")
    raise TypeError(f"{func}: argument {name!r} must be a {wanted}, got {_what(value)}{_hint(value, types)}")


def _name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"


def _what(value: Any) -> str:
    text = repr(value) if isinstance(value, (str, int, float)) else ""
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{kind} {text[:40]}" if text else kind


def _hint(value: Any, expected: tuple[type, ...]) -> str:
    import torch

    wants_module = any(issubclass(t, torch.nn.Module) for t in expected)
    if wants_module and isinstance(value, dict):
        return " (a state dict? pass the module itself: its tensors are filled in place)"
    if wants_module and isinstance(value, torch.optim.Optimizer):
        return " (an optimizer? the model comes first, then the optimizer)"
    if any(issubclass(t, torch.optim.Optimizer) for t in expected) and isinstance(value, torch.nn.Module):
        return " (a model? this argument takes the optimizer)"
    return ""
