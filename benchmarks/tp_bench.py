"""FSDP x tensor parallel on 4 CPU ranks, mesh (dp=2, tp=2): shardfn against torchtitan-style FSDP2 + TP.

Launch (from the repository root; about 2 minutes on the 2-core CPU machine):

    .venv/bin/python benchmarks/tp_bench.py
    .venv/bin/python benchmarks/tp_bench.py --layers 2 --hidden 64 --rounds 1 --steps 3   # a quick look
    .venv/bin/python benchmarks/tp_bench.py --parity 5      # + bf16 against fp32, for both

Both train the same tiny Hugging Face Llama from the same initial weights on the same batches (batch i
of dp rank r is the same for both; tp ranks get their dp rank's batch), AdamW (lr 1e-3, weight decay 0.01):

  shardfn      sf.functionalize(model, units=r"model\\.layers\\.\\d+"), specs from sf.rules.LLAMA,
               sf.train_step(loss_fn, sf.optim.adamw(...), sf.mesh(dp=2, tp=2))
  fsdp2_tp     torchtitan's recipe: parallelize_module with ColwiseParallel (q/k/v, gate/up),
               RowwiseParallel (o, down), a vocabulary-parallel embedding (RowwiseParallel) and head
               (ColwiseParallel, logits left sharded, loss under loss_parallel()), then fully_shard
               on each layer and the root over dp; torch.optim.AdamW(foreach=True)

  shardfn_compile, fsdp2_tp_compile   the same with compiled blocks: compile=True (from the second
               step; Note [compiled units]), and torchtitan's torch.compile of each block after its
               tensor parallelism and before FSDP (--backend: inductor by default)

Per implementation: step time (a dist.barrier() before each step, the max over ranks, the median over
the timed steps of all rounds; rounds alternate the implementations), the peak growth of resident
memory over the timed steps (VmHWM after - VmHWM at a reset), the collectives of one step and the
size of the tensors they move (the whole gathered or reduced tensor; counted by a dispatch mode that
sees every c10d and functional collective; shardfn's engine sends point to point on gloo, which that mode does not see, so
its own counters are shown as "engine ..."; they count bytes sent, ring-style), and the losses side
by side (the first must agree; the optimizers differ in rounding after that).
Figures are noisy on a shared 2-core machine: the counts and bytes matter more.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _config(a):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=a.seq, attention_dropout=0.0,
        tie_word_embeddings=False, attn_implementation="eager",
    )


def _batch(step: int, a, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, a.vocab, (a.batch * a.dp, a.seq), generator=g).chunk(a.dp)[dp_rank]


class _Comms:
    """Counts collectives and the bytes handed to them (every c10d and functional collective)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts, nbytes = {}, {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                name = str(func)
                if "c10d" in name and any(k in name for k in ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "alltoall", "send", "recv")):
                    key = name.split("::")[-1].split(".")[-2 if name.count(".") > 1 else -1]
                    flat = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                    counts[key] = counts.get(key, 0) + 1
                    # c10d's all-gather and reduce-scatter take (output, input): count the larger
                    # (the whole gathered or the whole reduced tensor); all-reduce its one tensor.
                    size = max((t.numel() * t.element_size() for t in flat[:2]), default=0)
                    nbytes[key] = nbytes.get(key, 0) + size
                return func(*args, **(kwargs or {}))

        self.mode, self.counts, self.bytes = Mode(), counts, nbytes


def _build(impl: str, a, bf16: bool = False):
    """A step function `step(ids) -> loss` for `impl` on the (dp, tp) mesh (and `params()`, the
    full parameters by name); `bf16`: compute in bf16, reduce in fp32, fp32 master weights."""
    import shardfn as sf
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(a)).float().train()
    mesh = sf.mesh(dp=a.dp, tp=a.tp)
    if impl in ("shardfn", "shardfn_compile"):
        apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")
        specs = sf.specs(params, mesh, rules=sf.rules.LLAMA)

        def loss_fn(p, ids):
            return apply(p, input_ids=ids, labels=ids, use_cache=False).loss

        mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        compile = {"backend": a.backend} if impl == "shardfn_compile" else False
        train = sf.train_step(loss_fn, sf.optim.adamw(1e-3, weight_decay=0.01), mesh, specs=specs, mixed_precision=mp,
                              compile=compile)
        box = {"state": train.init(params)}

        def step(ids):
            box["state"], metrics = train(box["state"], ids)
            return metrics["loss"]

        step.params = lambda: sf.to_state_dict(sf.gather(box["state"].params), apply)
        return step
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for i, layer in enumerate(model.model.layers):
        parallelize_module(layer, tp, plan)
        if impl == "fsdp2_tp_compile":  # torchtitan's order: tensor parallel, compile each block, then FSDP
            layer = model.model.layers[i] = torch.compile(layer, backend=a.backend)
        fully_shard(layer, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        out = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
        torch.distributed.all_reduce(out)  # the mean over dp ranks, as shardfn reports it
        return out / torch.distributed.get_world_size()

    step.params = lambda: {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return step


_STEPS = {}


def rank_setup(impl: str, a) -> dict:
    """Builds `impl`, runs the warm-up steps, then one step under the collective counter."""
    import torch.distributed as dist

    mesh_rank = dist.get_rank()
    dp_rank = mesh_rank // a.tp
    from shardfn import _collectives as C

    step = _STEPS[impl] = _build(impl, a)
    first, warm_s = [], []
    for s in range(a.warmup):  # the compiled implementations compile here
        t = time.perf_counter()
        first.append(float(step(_batch(s, a, dp_rank))))
        warm_s.append(time.perf_counter() - t)
    comms = _Comms()
    C.STATS.reset()
    # Compiled code under a dispatch mode runs eager, and dynamo keeps skipping it after: the compiled
    # implementations' collectives are not counted.
    with comms.mode if not impl.endswith("_compile") else contextlib.nullcontext():
        loss = step(_batch(a.warmup, a, dp_rank))
    # shardfn's engine sends point to point on gloo, past the dispatch mode: its own counters.
    engine = {k: (C.STATS.calls[k], C.STATS.bytes_sent[k]) for k in C.STATS.calls} if impl.startswith("shardfn") else {}
    return dict(counts=comms.counts, bytes=comms.bytes, engine=engine, losses=[*first, float(loss)], warm_s=warm_s)


def rank_time(impl: str, a, first: int) -> dict:
    """`a.steps` timed steps of `impl` (a barrier before each), and the peak growth of resident memory."""
    import torch.distributed as dist

    from _proc import status_kb

    dp_rank = dist.get_rank() // a.tp
    step = _STEPS[impl]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_kb("VmHWM")
    times, losses = [], []
    for s in range(first, first + a.steps):
        ids = _batch(s, a, dp_rank)
        dist.barrier()
        t = time.perf_counter()
        losses.append(float(step(ids)))
        times.append(time.perf_counter() - t)
    return dict(times=times, losses=losses, peak_kb=status_kb("VmHWM") - base)


def rank_parity(a, impls: list[str]) -> dict:
    """Each implementation in fp32 and in bf16 (fp32 reductions) for `a.parity` steps: the relative
    distance of its parameters (all as one vector) from shardfn's fp32 run."""
    import torch.distributed as dist

    dp_rank = dist.get_rank() // a.tp
    final = {}
    for impl in impls:
        for bf16 in (False, True):
            step = _build(impl, a, bf16)
            for s in range(a.parity):
                step(_batch(s, a, dp_rank))
            final[(impl, bf16)] = step.params()
    ref = final[("shardfn", False)]
    names = list(ref)
    flat = {k: torch.cat([v[n].double().reshape(-1) for n in names]) for k, v in final.items()}
    base = flat[("shardfn", False)]
    return {f"{impl} {'bf16' if bf16 else 'fp32'}": ((x - base).norm() / base.norm()).item() for (impl, bf16), x in flat.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="examples per dp rank")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--impls", default="shardfn,fsdp2_tp", help="of shardfn, shardfn_compile, fsdp2_tp, fsdp2_tp_compile")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend for the *_compile implementations")
    p.add_argument("--parity", type=int, default=0, help="also: N steps in fp32 and bf16 of each, compared")
    a = p.parse_args()
    a.dp, a.tp = 2, 2
    impls = a.impls.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardfn._pool import RankPool

    pool = RankPool(a.dp * a.tp, timeout=900, pg_timeout=300)
    try:
        setup = {impl: pool.run(rank_setup, impl, a) for impl in impls}
        runs = {impl: [] for impl in impls}
        first = a.warmup + 1
        for r in range(a.rounds):
            for impl in impls:
                runs[impl].append(pool.run(rank_time, impl, a, first + r * a.steps))
        parity = pool.run(rank_parity, a, impls)[0] if a.parity else None
    finally:
        pool.close(kill=True)
    print(f"Llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, seq {a.seq}, batch {a.batch} per dp rank; "
          f"mesh (dp={a.dp}, tp={a.tp}), gloo, {a.rounds} rounds x {a.steps} steps\n")
    print("| impl | step ms (median) | peak growth MiB (max rank) | collectives per step (rank 0) | bytes per step (rank 0) |")
    print("|---|---|---|---|---|")
    for impl in impls:
        steps = [max(ts) for run in runs[impl] for ts in zip(*(rk["times"] for rk in run))]
        peak = max(rk["peak_kb"] for run in runs[impl] for rk in run) / 1024
        c, b = dict(setup[impl][0]["counts"]), dict(setup[impl][0]["bytes"])
        for k, (n, nbytes) in setup[impl][0]["engine"].items():
            c[f"engine {k}"], b[f"engine {k}"] = n, nbytes
        calls = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        sent = ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sorted(b.items()))
        print(f"| {impl} | {1000 * statistics.median(steps):.1f} | {peak:.1f} | {calls} | {sent} |")
    if parity:
        print(f"\nparameters after {a.parity} steps, relative distance from shardfn fp32 (all leaves as one vector):")
        for k, v in parity.items():
            print(f"  {k:14s} {v:.3e}")
    print("\nwarm-up steps, s (rank 0; a compiled implementation compiles in them):")
    for impl in impls:
        print(f"  {impl:16s}", " ".join(f"{x:.1f}" for x in setup[impl][0]["warm_s"]))
    print("\nlosses (rank 0: warm-up and counted steps, then the timed steps of round 0):")
    for impl in impls:
        print(f"  {impl:10s}", " ".join(f"{x:.6f}" for x in setup[impl][0]["losses"]), "|",
              " ".join(f"{x:.6f}" for x in runs[impl][0][0]["losses"]))


if __name__ == "__main__":
    main()
