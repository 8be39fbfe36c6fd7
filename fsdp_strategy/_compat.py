"""The private torch names this package uses, each with why no public API does the job.

Everything else in the package uses public torch and Lightning APIs. When one of these changes in a torch
release, this is the one file to adapt.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "disabled_torch_function_impl",
    "forget_composable_state",
    "make_wrapper_subclass",
    "op_arguments",
    "tensor_version",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]

# A tensor subclass that handles every op in __torch_dispatch__ sets this as its __torch_function__, as
# torch's own DTensor and FakeTensor do (torch >= 1.13); there is no public spelling.
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

# pytree flattens (args, kwargs) of a dispatched op; torch.utils._pytree is how torch's own tensor
# subclasses do it (torch >= 2.0). Its public twin torch.utils.pytree exists only from torch 2.5 on and
# does not cover every version this package supports.
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402


def make_wrapper_subclass(cls: type, like: torch.Tensor, *, device: torch.device) -> Any:
    """A tensor of type ``cls`` with ``like``'s geometry and dtype on ``device``, and no memory.

    ``Tensor._make_wrapper_subclass`` is how DTensor and FakeTensor are built (torch >= 1.13); the public
    ``Tensor._make_subclass`` needs real data, which is what a deferred parameter must not allocate.
    """
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.shape,
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        device=device,
        requires_grad=False,
    )


def op_arguments(op: Any) -> list[Any]:
    """The arguments of an aten op's schema, with their names, ``is_out`` and ``alias_info.is_write``.

    ``OpOverload._schema`` is how torch's own tensor subclasses and FakeTensor find which arguments an op
    writes (torch >= 1.12); there is no public accessor.
    """
    return op._schema.arguments


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor``'s memory has seen.

    ``Tensor._version`` is the counter autograd uses to refuse modified saved tensors (torch >= 0.4);
    there is no public accessor. The strategy uses it the same way: a tensor a deferred parameter copies
    from must not change before the copy is replayed.
    """
    return tensor._version


def forget_composable_state(module: nn.Module) -> None:
    """Lets ``fully_shard`` apply again to a module whose FSDP state was removed.

    torch keeps a global ``WeakKeyDictionary`` from each module to its composable-API state
    (``torch.distributed._composable_state._module_state_mapping``, torch >= 2.1) and refuses to shard a
    module found there ("Inserting ... more than once"). After ``fit`` the strategy gives the user back
    the plain module (see :mod:`fsdp_strategy.gather`); ``trainer.test(model)`` then shards it again.
    """
    from torch.distributed import _composable_state

    _composable_state._module_state_mapping.pop(module, None)
