"""The checks to run when a GPU is lent: shardfn on CUDA against plain PyTorch, then the 1B benchmark.

    python benchmarks/device_check.py                         # one GPU: about 5 minutes on an H200
    python benchmarks/device_check.py --device cpu --no-bench  # a dry run of the same checks on CPU

1. Parity on the device, one rank (NCCL when on CUDA): a small GPT trained STEPS steps by shardfn and
   by plain PyTorch (same initial weights, same batches, torch.optim.AdamW) for every case in CASES
   (compiled steps too, on the device only);
   prints the worst relative error of the loss over the steps and of the parameters at the end, and
   fails (exit 1) past the case's tolerance. bf16 cases compare with the plain model under autocast.
2. Peak memory on the device (CUDA: the allocator's peak; CPU: not measured) of each case.
3. `benchmarks/gpu_bench.py` (a ~1B GPT in bf16: shardfn, FSDP2, plain PyTorch; TFLOP/s and
   peak memory) with BENCH_STEPS timed steps, unless --no-bench.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch.nn import functional as F

# -- settings -----------------------------------------------------------------------------------
STEPS = 4
BATCH, T = 8, 64
CFG = dict(vocab=512, block_size=T, n_layer=4, n_head=4, d=128)
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
CASES = [  # (label, train_step keyword arguments, bf16, tolerance)
    ("fp32 full_shard", {}, False, 1e-5),
    ("fp32 shard_grad_op", {"strategy": "shard_grad_op"}, False, 1e-5),
    ("fp32 no_shard", {"strategy": "no_shard"}, False, 1e-5),
    ("fp32 remat", {"remat": True}, False, 1e-5),
    ("fp32 clip + accumulate x2", {"max_grad_norm": 0.5, "accumulation_steps": 2}, False, 1e-5),
    ("fp32 offload='cpu'", {"offload": "cpu"}, False, 1e-5),
    ("bf16 full_shard", {"mp": True}, True, 3e-2),
    ("bf16 offload='cpu'", {"mp": True, "offload": "cpu"}, True, 3e-2),
    ("fp32 compile=True", {"compile": True}, False, 1e-5),
    ("bf16 compile=True", {"mp": True, "compile": True}, True, 3e-2),
]
# Compiled on the device only: a CPU dry run would spend minutes in Inductor's C++ compiles, and
# tests/test_compile.py checks compiled units on CPU against the eager step.
DEVICE_ONLY = {"fp32 compile=True", "bf16 compile=True"}
BENCH_STEPS = 6


def _batches(device: str):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CFG["vocab"], (BATCH, T), generator=g)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).norm().item() / max(b.norm().item(), 1e-12)


def check(label: str, kwargs: dict, bf16: bool, device: str) -> dict:
    """One case: shardfn against plain PyTorch on `device`; errors and peak memory."""
    import shardfn as sf
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig(**CFG))
    ref = copy.deepcopy(model)
    batches = _batches(device)

    # Plain PyTorch: the whole batch at once (accumulation splits it; the mean loss is the same).
    opt = torch.optim.AdamW(ref.parameters(), **OPT)
    clip = kwargs.get("max_grad_norm")
    ref_losses = []
    for x, y in batches:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            logits = ref(x)
        loss = _loss(logits, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())

    kwargs = dict(kwargs)
    if kwargs.pop("mp", False):
        kwargs["mixed_precision"] = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")

    def loss_fn(p, batch):
        x, y = batch
        return _loss(apply(p, x), y)

    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), **kwargs)
    host_est = sf.estimate_memory(step, params, batch=batches[0]).host / 2**20
    pinned0 = torch.cuda.host_memory_stats().get("active_bytes.current", 0) if device == "cuda" else 0
    state = step.init(params)
    del params
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, t0 = [], time.perf_counter()
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    # offload: the pinned shard and gradient buffers (each rounded up to a power of two by torch's
    # pinned allocator), which the estimate's host figure must cover with the optimizer state
    pinned = (torch.cuda.host_memory_stats().get("active_bytes.current", 0) - pinned0) / 2**20 if device == "cuda" else 0.0
    full = sf.to_state_dict(sf.gather(state.params))
    ref_params = dict(ref.named_parameters())
    param_err = max(_rel(full[k], ref_params[k]) for k in ref_params)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return dict(label=label, loss_err=loss_err, param_err=param_err, peak_mb=peak, seconds=seconds,
                devices=sorted({str(full[k].device) for k in ref_params}), host_est_mb=host_est, pinned_mb=pinned)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-bench", action="store_true", help="skip gpu_bench.py")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("a CPU dry run needs a machine without CUDA (the mesh follows the hardware)")
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print("| case | max loss rel. err | param rel. err | peak MiB | host MiB: estimate, pinned measured | seconds | ok |")
    print("|---|---:|---:|---:|---:|---:|---|")
    failed = []
    for label, kwargs, bf16, tol in CASES:
        if label in DEVICE_ONLY and args.device == "cpu":
            print(f"| {label} | | | | | | skipped on CPU (tests/test_compile.py) |", flush=True)
            continue
        r = check(label, kwargs, bf16, args.device)
        # bf16: the whole-model parameter error is loose (two bf16 paths round differently).
        ok = r["loss_err"] < tol and r["param_err"] < (tol if not bf16 else 0.1)
        ok = ok and r["host_est_mb"] >= r["pinned_mb"]  # the estimate's host memory covers what was pinned
        failed += [] if ok else [label]
        print(f"| {label} | {r['loss_err']:.1e} | {r['param_err']:.1e} | {r['peak_mb']:.0f} | "
              f"{r['host_est_mb']:.1f}, {r['pinned_mb']:.1f} | {r['seconds']:.2f} | {'yes' if ok else 'NO'} |", flush=True)
    if not args.no_bench and args.device == "cuda":
        import torch.distributed as dist

        import gpu_bench

        dist.destroy_process_group()
        sys.argv = [sys.argv[0], "--steps", str(BENCH_STEPS)]
        gpu_bench.main()
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
