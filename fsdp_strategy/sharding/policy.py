"""Which submodules become their own sharded unit (or activation-checkpointed region).

A policy is given in one of a few plain forms, normalized once (:func:`normalize_policy`) and
resolved against a concrete model later (:func:`select_modules`):

- ``"auto"``: the model's repeated blocks: a Hugging Face model's ``_no_split_modules``, else the
  children of each ``nn.ModuleList``/``nn.Sequential`` that share a class (outermost ones only);
- class names (``["Block"]``, YAML-friendly) and/or module classes (``{Block}``);
- a predicate ``(qualified_name, module) -> bool``;
- an ``int``: the smallest number of parameters that makes a unit, counted bottom-up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from fsdp_strategy.sharding.class_names import module_class

__all__ = ["ModulePolicy", "PolicyInput", "class_name", "normalize_policy", "select_modules"]

PolicyInput = str | int | Iterable[str | type[nn.Module]] | Callable[[str, nn.Module], bool] | None

_ACCEPTED = (
    '"auto", a list of module class names (e.g. ["Block"]), a set of nn.Module classes, a callable'
    " (name, module) -> bool, a positive int (minimum parameters per unit), or None"
)


@dataclass(frozen=True)
class ModulePolicy:
    """A normalized module-selection policy. ``option`` names the user's argument for error messages."""

    option: str
    auto: bool = False
    class_names: frozenset[str] = frozenset()
    classes: tuple[type[nn.Module], ...] = ()
    predicate: Callable[[str, nn.Module], bool] | None = None
    min_params: int | None = None

    def describe(self) -> str:
        if self.auto:
            return '"auto"'
        if self.predicate is not None:
            return repr(self.predicate)
        if self.min_params is not None:
            return f"{self.min_params} (minimum parameters)"
        return repr(sorted(self.class_names | {cls.__name__ for cls in self.classes}))


def normalize_policy(value: PolicyInput, *, option: str) -> ModulePolicy | None:
    """Validates a user-given policy and returns its normalized form (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"`{option}` must be {_ACCEPTED}; got the bool {value!r}.")
    if isinstance(value, str):
        if value == "auto":
            return ModulePolicy(option=option, auto=True)
        if not value.strip():
            raise ValueError(f"`{option}` must be {_ACCEPTED}; got the empty string.")
        return ModulePolicy(option=option, class_names=frozenset({value}))
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"`{option}` as a minimum parameter count must be a positive int; got {value}.")
        return ModulePolicy(option=option, min_params=value)
    if isinstance(value, type):
        if issubclass(value, nn.Module):
            return ModulePolicy(option=option, classes=(value,))
        raise TypeError(f"`{option}` must be {_ACCEPTED}; got the class {value.__name__}, which is not an nn.Module.")
    if callable(value):
        return ModulePolicy(option=option, predicate=value)
    if isinstance(value, Iterable):
        items = list(value)
        if not items:
            raise ValueError(f"`{option}` must name at least one module class; got an empty {type(value).__name__}.")
        names = [item for item in items if isinstance(item, str)]
        classes = [item for item in items if isinstance(item, type) and issubclass(item, nn.Module)]
        others = [item for item in items if item not in names and item not in classes]
        if others:
            raise TypeError(
                f"`{option}` entries must be class names (str) or nn.Module subclasses; got {others[0]!r}"
                f" of type {type(others[0]).__name__}."
            )
        return ModulePolicy(option=option, class_names=frozenset(names), classes=tuple(classes))
    raise TypeError(f"`{option}` must be {_ACCEPTED}; got {value!r} of type {type(value).__name__}.")


def select_modules(model: nn.Module, policy: ModulePolicy) -> list[tuple[str, nn.Module]]:
    """The submodules of ``model`` that ``policy`` selects, children before parents, root excluded.

    Raises:
        ValueError: a class name is not found in the model, or an explicit policy selects nothing.
    """
    named = list(model.named_modules())[1:]
    if policy.auto:
        return _post_order(_auto_blocks(model, named))
    if policy.class_names:
        present = {class_name(module) for _, module in named}
        missing = sorted(policy.class_names - present)
        if missing:
            raise ValueError(
                f"`{policy.option}` names module classes that are not in the model: {missing}. The model's"
                f" module classes are: {sorted(present)}."
            )
    if policy.min_params is not None:
        selected = _by_size(model, policy.min_params)
    elif policy.predicate is not None:
        selected = _post_order([(name, module) for name, module in named if policy.predicate(name, module)])
    else:
        selected = [
            (name, module)
            for name, module in named
            if class_name(module) in policy.class_names or isinstance(module, policy.classes)
        ]
        selected = _post_order(selected)
    if not selected:
        raise ValueError(f"`{policy.option}={policy.describe()}` matches no submodule of {class_name(model)}.")
    return selected


def _post_order(selected: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # named_modules() is pre-order, so reversing it puts every module after its descendants:
    # fully_shard must see inner units before the modules that contain them.
    return list(reversed(selected))


def _auto_blocks(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    no_split = {
        name for _, module in [("", model), *named] for name in getattr(module, "_no_split_modules", None) or ()
    }
    blocks = [(name, module) for name, module in named if class_name(module) in no_split]
    if blocks:
        return blocks
    candidates = []
    for prefix, container in [("", model), *named]:
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(name, child) for name, child in container.named_children() if _has_parameters(child)]
        counts = Counter(type(child) for _, child in children)
        candidates += [
            (f"{prefix}.{name}" if prefix else name, child) for name, child in children if counts[type(child)] >= 2
        ]
    # Keep the outermost repeated blocks: a transformer's layers, not the heads inside each layer.
    names = [name for name, _ in candidates]
    return [(name, module) for name, module in candidates if not any(name.startswith(o + ".") for o in names)]


def _by_size(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    selected: list[tuple[str, nn.Module]] = []

    def unassigned(name: str, module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            count += unassigned(f"{name}.{child_name}" if name else child_name, child)
        if name and count >= min_params:
            selected.append((name, module))
            return 0
        return count

    unassigned("", model)
    return selected


def class_name(module: nn.Module) -> str:
    """The module's own class name, also after ``fully_shard`` swapped in its ``FSDP<Name>`` subclass."""
    return (module_class(type(module)) or type(module)).__name__


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
