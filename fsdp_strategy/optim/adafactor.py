"""``torch.optim.Adafactor``'s and ``transformers.optimization.Adafactor``'s steps on row shards, equal to their
steps on whole parameters.

Adafactor reads more than each element: a matrix's column statistics sum over its rows, which the ranks share
out, and the parameter's and the update's RMS sum over all of it. Each parameter's step is a generator that reads
top to bottom as the original does on a whole parameter and yields twice the partial sums it needs from every
rank: first those of the parameter and the gradient, then that of the update. :func:`_run` brings every parameter
of every group to each yield before summing, so that one step issues two all-reduces (one per shard group) for
all parameters together. Only a matrix's columns span ranks; a parameter of three or more dims is factored over
its last two, whole on each rank, and only its norms need the other ranks.

State entries keep the optimizers' own keys and global shapes: an entry split by rows is a DTensor laid out as its
parameter, one every rank needs whole (a matrix's column statistics) a plain tensor, the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy.optim.rows import RowShards, all_reduce_sums, row_shards

__all__ = ["check_torch", "check_transformers", "torch_step", "transformers_step"]

TORCH, TRANSFORMERS = "torch.optim.Adafactor", "transformers.optimization.Adafactor"

# A parameter's step: yields its partial sums (float64), is sent back their totals over the ranks.
_Step = Generator[list[Tensor], list[Tensor], None]


def check_torch(optimizer: Optimizer) -> None:
    """Every parameter laid out by rows (raises :class:`~.rows.UnsupportedLayout` naming the fix otherwise)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            row_shards(param, optimizer=TORCH)


def check_transformers(optimizer: Optimizer) -> None:
    """As :func:`check_torch`; fp16/bf16 parameters run as transformers runs them, in fp32 copies."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            row_shards(param, optimizer=TRANSFORMERS)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _squared(norm: Tensor) -> Tensor:
    # A norm's square in float64 is exact, and its square root gives the norm back: on one rank the totals are the
    # original's own norms, bit for bit.
    return norm.double().square()


def _rows(state: dict[str, Any], key: str, shards: RowShards, param: Tensor) -> Tensor:
    """This rank's rows of an entry split by rows; one loaded whole (a checkpoint of another world size) is cut and
    kept laid out as ``param`` again."""
    entry = state[key]
    if isinstance(entry, DTensor):
        return entry.to_local()
    if not isinstance(param, DTensor):
        return entry
    local = shards.local(entry).to(device=_local(param).device).clone()
    state[key] = shards.as_like(local, param)
    return local


def _placed(entry: DTensor, shards: RowShards) -> Tensor:
    """A whole entry that arrived split by rows (a checkpoint shards any entry of its parameter's shape, as a one-row
    matrix's column statistics are): this rank's rows in zeros of the whole, which the first all-reduce sums whole."""
    whole = torch.zeros(entry.shape, dtype=torch.float64, device=entry.to_local().device)
    shards.local(whole).copy_(entry.to_local())
    return whole


def _run(steps: list[tuple[RowShards, _Step]]) -> None:
    """Runs the parameters' steps side by side, the partial sums of each yield summed over their shard group in one
    all-reduce per group, in the same order on every rank."""
    pending = [(shards, step, next(step)) for shards, step in steps]
    while pending:
        by_group: dict[int, list[int]] = {}
        for i, (shards, _, _) in enumerate(pending):
            by_group.setdefault(id(shards.group), []).append(i)
        totals: list[list[Tensor]] = [[] for _ in pending]
        for indices in by_group.values():
            summed = all_reduce_sums([t for i in indices for t in pending[i][2]], pending[indices[0]][0].group)
            for i in indices:
                totals[i], summed = summed[: len(pending[i][2])], summed[len(pending[i][2]) :]
        still = []
        for (shards, step, _), total in zip(pending, totals):
            try:
                still.append((shards, step, step.send(total)))
            except StopIteration:
                pass
        pending = still


def _no_grad_run(steps: Callable[[], list]) -> None:
    with torch.no_grad():
        _run(steps())


# --- torch.optim.Adafactor (torch.optim._adafactor._single_tensor_adafactor) ---------------------------------------


def torch_step(optimizer: Optimizer) -> None:
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    _no_grad_run(lambda: _torch_steps(optimizer))


def _torch_steps(optimizer: Optimizer) -> list[tuple[RowShards, _Step]]:
    steps = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        lr = lr.squeeze() if isinstance(lr, Tensor) and lr.dim() != 0 else lr  # as torch's _to_scalar
        eps1 = group["eps"][0]
        for param in group["params"]:
            if param.grad is None:
                continue
            if torch.is_complex(param):
                raise RuntimeError("Adafactor does not support complex parameters")
            if param.grad.is_sparse:
                raise RuntimeError("Adafactor does not support sparse gradients")
            # torch fills in eps1 from the first parameter of the group and keeps it for the others.
            eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
            shards = row_shards(param, optimizer=TORCH)
            steps.append((shards, _torch_param(optimizer.state[param], param, shards, group, lr, eps1)))
    return steps


def _init_torch(state: dict[str, Any], param: Tensor, shards: RowShards, grad: Tensor) -> None:
    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    if param.dim() > 1:
        state["row_var"] = shards.as_like(grad.new_zeros((*grad.shape[:-1], 1)), param)
        col_var = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
        state["col_var"] = col_var if param.dim() == 2 else shards.as_like(col_var, param)
    else:
        state["variance"] = shards.as_like(torch.zeros_like(grad, memory_format=torch.preserve_format), param)


def _torch_param(state: dict, param: Tensor, shards: RowShards, group: dict, lr: Any, eps1: float) -> _Step:
    local, grad = _local(param), _local(param.grad)
    grad = -grad if group["maximize"] else grad
    if not state:
        _init_torch(state, param, shards, grad)
    matrix, rows = param.dim() == 2, param.shape[-2] if param.dim() > 1 else 1
    state["step"] += 1
    step = state["step"].item()
    one_minus_beta2 = step ** group["beta2_decay"]
    rho = min(lr, 1 / (step**0.5))

    partials = [_squared(local.norm(2))]  # the RMS of the parameter before weight decay
    if param.dim() > 1:
        row_var = _rows(state, "row_var", shards, param)
        col_var = state["col_var"] if matrix else _rows(state, "col_var", shards, param)
        row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2)
        if matrix:  # the column sums and the rows' mean of row_var run over every rank's rows
            partials += [_squared(torch.norm(grad, dim=-2, keepdim=True)), row_var.sum(-2, True, dtype=torch.float64)]
            if isinstance(col_var, DTensor):
                partials.append(_placed(col_var, shards))
        else:
            col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(rows), one_minus_beta2)
    else:
        variance = _rows(state, "variance", shards, param)
        variance.lerp_(grad * grad, one_minus_beta2)
    totals = yield partials

    alpha = max(group["eps"][1], math.sqrt(totals[0].item()) / (param.numel() ** 0.5)) * rho
    if group["weight_decay"] != 0:
        local.mul_(1 - lr * group["weight_decay"])
    if matrix:
        if len(totals) == 4:
            col_var = state["col_var"] = totals[3].to(col_var.dtype)
        col_var.lerp_(totals[1].to(col_var.dtype).div_(rows), one_minus_beta2)
        row_mean = totals[2].div(rows).to(row_var.dtype)
    elif param.dim() > 1:
        row_mean = row_var.mean(dim=-2, keepdim=True)

    def update() -> Tensor:
        # Computed twice rather than kept across the yield, where every parameter's would be held at once.
        if param.dim() > 1:
            estimate = row_var @ col_var
            estimate.div_(row_mean.clamp(min=eps1))
        else:
            estimate = variance.clone()
        return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)

    totals = yield [_squared(update().norm(2))]
    denom = max(1.0, math.sqrt(totals[0].item()) / ((param.numel() ** 0.5) * group["d"]))
    local.add_(update(), alpha=-alpha / denom)


# --- transformers.optimization.Adafactor -----------------------------------------------------------------------


def transformers_step(optimizer: Optimizer) -> None:
    _no_grad_run(lambda: _transformers_steps(optimizer))


def _transformers_steps(optimizer: Optimizer) -> list[tuple[RowShards, _Step]]:
    steps = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("Adafactor does not support sparse gradients.")
            shards = row_shards(param, optimizer=TRANSFORMERS)
            steps.append((shards, _transformers_param(optimizer, optimizer.state[param], param, shards, group)))
    return steps


_LOW = (torch.float16, torch.bfloat16)


def _init_transformers(state: dict, param: Tensor, shards: RowShards, grad: Tensor, first_moment: bool) -> None:
    state["step"] = 0
    if first_moment:
        state["exp_avg"] = shards.as_like(torch.zeros_like(grad), param)
    if param.dim() >= 2:
        state["exp_avg_sq_row"] = shards.as_like(grad.new_zeros(grad.shape[:-1]), param)
        col = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
        state["exp_avg_sq_col"] = col if param.dim() == 2 else shards.as_like(col, param)
    else:
        state["exp_avg_sq"] = shards.as_like(torch.zeros_like(grad), param)
    state["RMS"] = 0


def _transformers_param(optimizer: Any, state: dict, param: Tensor, shards: RowShards, group: dict) -> _Step:
    local, grad = _local(param), _local(param.grad)
    grad = grad.float() if grad.dtype in _LOW else grad  # transformers steps fp16/bf16 in fp32 copies
    factored, first_moment = optimizer._get_options(group, param.shape)
    matrix, rows = param.dim() == 2, param.shape[-2] if param.dim() > 1 else 1
    if not state:
        _init_transformers(state, param, shards, grad, first_moment)

    def entry(key: str) -> Tensor:
        # A matrix's column statistics ([C]) are never of its shape: a checkpoint loads them whole.
        value = state[key] if matrix and key == "exp_avg_sq_col" else _rows(state, key, shards, param)
        if value.dtype != grad.dtype:  # transformers keeps the state in the gradient's dtype
            value = value.to(grad.dtype)
            state[key] = shards.as_like(value, param) if isinstance(state[key], DTensor) else value
        return value

    exp_avg = entry("exp_avg") if first_moment else None
    p32 = local.float() if local.dtype in _LOW else local
    state["step"] += 1
    beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])

    partials = [_squared(p32.norm(2))]  # the parameter's RMS, which the learning rate reads
    squared = (grad**2) + group["eps"][0]
    if factored:
        row, col = entry("exp_avg_sq_row"), entry("exp_avg_sq_col")
        row.mul_(beta2t).add_(squared.mean(dim=-1), alpha=(1.0 - beta2t))
        if matrix:  # the column means and the rows' mean of the row statistics run over every rank's rows
            partials += [squared.sum(dim=-2, dtype=torch.float64), row.sum(-1, True, dtype=torch.float64)]
        else:
            col.mul_(beta2t).add_(squared.mean(dim=-2), alpha=(1.0 - beta2t))
    else:
        exp_avg_sq = entry("exp_avg_sq")
        exp_avg_sq.mul_(beta2t).add_(squared, alpha=(1.0 - beta2t))
    del squared  # not held across the yield, where every parameter's would be at once
    totals = yield partials

    state["RMS"] = totals[0].sqrt().to(p32.dtype) / (param.numel() ** 0.5)
    lr = optimizer._get_lr(group, state)
    if matrix:
        col.mul_(beta2t).add_(totals[1].div(rows).to(col.dtype), alpha=(1.0 - beta2t))
        row_mean = totals[2].div(rows).to(row.dtype)
    elif factored:
        row_mean = row.mean(dim=-1, keepdim=True)

    def update() -> Tensor:
        # Computed twice rather than kept across the yield, where every parameter's would be held at once.
        if not factored:
            return exp_avg_sq.rsqrt().mul_(grad)
        row_factor = (row / row_mean).rsqrt_().unsqueeze(-1)
        return torch.mul(row_factor, col.unsqueeze(-2).rsqrt()).mul_(grad)

    totals = yield [_squared(update().norm(2))]
    rms = totals[0].sqrt().to(grad.dtype) / (param.numel() ** 0.5)
    step = update()
    step.div_((rms / group["clip_threshold"]).clamp_(min=1.0))
    step.mul_(lr)
    if first_moment:
        exp_avg.mul_(group["beta1"]).add_(step, alpha=(1 - group["beta1"]))
        step = exp_avg
    if group["weight_decay"] != 0:
        p32.add_(p32, alpha=(-group["weight_decay"] * lr))
    p32.add_(-step)
    if p32 is not local:
        local.copy_(p32)


def _scalar_dtype() -> torch.dtype:
    # The dtype torch's optimizers keep their step counters in: float64 only under a float64 default.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
