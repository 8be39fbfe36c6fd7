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
    "reduce_root_gradients_after",
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


def forget_composable_state(module: nn.Module) -> None:
    """Lets ``fully_shard`` apply again to a module whose FSDP state was removed.

    torch keeps a global ``WeakKeyDictionary`` from each module to its composable-API state
    (``torch.distributed._composable_state._module_state_mapping``, torch >= 2.1) and refuses to shard a
    module found there ("Inserting ... more than once"). After ``fit`` the strategy gives the user back
    the plain module (see :mod:`fsdp_strategy.gather`); ``trainer.test(model)`` then shards it again.
    """
    from torch.distributed import _composable_state

    _composable_state._module_state_mapping.pop(module, None)


def reduce_root_gradients_after(model: nn.Module, loss: torch.Tensor) -> None:
    """Makes the backward of ``loss`` reduce-scatter the gradients of the root unit ``model``'s own parameters.

    FSDP2 reduces gradients in a callback that the pre-backward hook of an FSDP forward's output queues.
    Under manual optimization a loss need not be such an output (a critic trained on detached features,
    whose layers all belong to the root): nothing queues the callback, and the root's gradients would stay
    in its unsharded parameters, unreduced. The root's own pre-backward hook (``FSDPState._pre_backward``,
    torch >= 2.4), registered on the loss, does what the root's forward output would have done; FSDP queues
    its callback once per backward. No public API exists (torch 2.13).
    """
    state = model._get_fsdp_state()  # type: ignore[operator]
    loss.register_hook(state._pre_backward)
