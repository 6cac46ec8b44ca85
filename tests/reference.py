"""Test models and the single-process reference every sharded path is checked against."""

from __future__ import annotations

import contextlib
import copy
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import shardfn as sf
from shardfn.models import GPT, GPTConfig

# Dims that neither 2 nor 3 divide (35, 53, 5, 7), a leaf with fewer rows than ranks (2 < 3), a tied
# embedding/head, and buffers (a position index, and a float scale that buffer_dtype casts).
GPT_CFG = GPTConfig(vocab=53, block_size=8, n_layer=3, n_head=5, d=35)
GPT_UNITS = r"blocks\.\d+"
MLP_UNITS = r"\d+"


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(GPT_CFG)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2), nn.Tanh(), nn.Linear(2, 3))
    raise ValueError(kind)


def units_of(kind: str) -> str:
    return GPT_UNITS if kind == "gpt" else MLP_UNITS


def global_batch(kind: str, step: int, world: int, per_rank: int = 2):
    g = torch.Generator().manual_seed(1000 + step)
    n = per_rank * world
    if kind == "gpt":
        x = torch.randint(0, GPT_CFG.vocab, (n, GPT_CFG.block_size), generator=g)
        y = torch.randint(0, GPT_CFG.vocab, (n, GPT_CFG.block_size), generator=g)
    else:
        x = torch.randn(n, 7, generator=g)
        y = torch.randn(n, 3, generator=g)
    return x, y


def local_batch(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank] for t in batch)


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()  # the loss in fp32, also when the model computes in bf16
    if kind == "gpt":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def make_loss_fn(kind: str, apply):
    def loss_fn(params, batch):
        x, y = batch
        return loss_of(kind, apply(params, x), y)

    return loss_fn


OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (absolute when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


class Reference:
    """The unsharded model, `torch.optim.AdamW`, the global batch: what a sharded step must equal.

    Args:
        frozen: regex over parameter names that are not trained.
        no_decay: regex over parameter names without weight decay (a second param group).
        bf16: emulate mixed precision: compute in a bf16 copy of the weights, keep fp32 master
            weights and optimizer state, reduce (here: nothing to reduce) in fp32.
    """

    def __init__(self, model: nn.Module, kind: str, max_grad_norm: float | None = None, frozen: str | None = None,
                 no_decay: str | None = None, bf16: bool = False):
        import re

        self.model, self.kind = copy.deepcopy(model), kind
        self.bf16 = bf16
        named = dict(self.model.named_parameters())
        if frozen:
            for n, p in named.items():
                if re.fullmatch(frozen, n):
                    p.requires_grad_(False)
        trained = {n: p for n, p in named.items() if p.requires_grad}
        if no_decay:
            groups = [
                {"params": [p for n, p in trained.items() if not re.fullmatch(no_decay, n)]},
                {"params": [p for n, p in trained.items() if re.fullmatch(no_decay, n)], "weight_decay": 0.0},
            ]
        else:
            groups = [{"params": list(trained.values())}]
        self.opt = torch.optim.AdamW(groups, **OPT)
        self.max_grad_norm = max_grad_norm

    def step(self, batch) -> tuple[float, float]:
        x, y = batch
        self.opt.zero_grad()
        if self.bf16:
            low = copy.deepcopy(self.model).to(torch.bfloat16)
            xin = x.to(torch.bfloat16) if x.is_floating_point() else x
            out = low(xin)
            loss = loss_of(self.kind, out, y)
            loss.backward()
            for p, q in zip(self.model.parameters(), low.parameters()):
                if p.requires_grad:
                    p.grad = q.grad.float()
        else:
            loss = loss_of(self.kind, self.model(x), y)
            loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        self.opt.step()
        return loss.item(), norm.item()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters(remove_duplicate=True))


def compare_params(sharded_params, apply, ref: Reference, per_leaf: bool = True) -> float:
    """Max relative error over every parameter, gathering the sharded tree.

    With `per_leaf=False`, the relative error of all parameters as one vector: for bf16 runs, where
    Adam turns rounding noise in near-zero gradients (a bias) into full-size steps on that leaf.
    """
    full = sf.to_state_dict(sf.gather(sharded_params), apply)
    assert list(full) == list(ref.model.state_dict()), (list(full), list(ref.model.state_dict()))  # tied names, buffers
    want = ref.state_dict()
    if per_leaf:
        return max(rel_err(full[n], want[n]) for n in want)
    return rel_err(torch.cat([full[n].reshape(-1) for n in want]), torch.cat([want[n].reshape(-1) for n in want]))


def world_info():
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def backward_on_another_thread():
    """Every `torch.autograd.backward` runs on a thread of its own, as CUDA's autograd runs the
    backward on its device threads: unit hooks, reductions and remat's recompute run there."""
    real = torch.autograd.backward

    def backward(*args, **kwargs):
        failed = []

        def run():
            try:
                real(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                failed.append(e)

        t = threading.Thread(target=run, name="autograd-device-thread")
        t.start()
        t.join()
        if failed:
            raise failed[0]

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = real
