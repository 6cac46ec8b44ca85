"""`sf.estimate_memory` against the measured peak, for every option of the train step.

For each model (the benchmark MLP and GPT, a tiny Hugging Face Llama), world size (1, 2, 4 gloo
ranks on this CPU) and option (every strategy; remat; bf16 mixed precision; two accumulation
steps), every rank estimates its step first (from meta-device parameters, before anything is
allocated), then builds the model under `sf.meta_device()` and measures init and two steps with
`shardfn._peak.PeakMeter` (live tensor bytes from the profiler's allocator events, and RSS growth;
Note [measured peak]). The measured peak is the larger of the two steps' (the first runs without
the slot plan, the second with it). Printed: estimate, measured, their ratio, and for that step
the rise of live bytes over its start beside the RSS growth (the second witness); the rank whose
ratio is farthest from 1 is kept. A Markdown table for
`benchmarks/README.md` with `--markdown`.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/memory.py [--worlds 1 2 4] [--models mlp gpt llama] [--markdown]

`--tp 2` runs the same on a (dp, tp) mesh instead (FSDP x tensor parallel, `sf.rules.GPT` /
`sf.rules.LLAMA`; the MLP has no ready rules): (dp=1, tp=2) at 2 ranks, (dp=2, tp=2) at 4, the
options that mesh takes (full_shard, shard_grad_op; remat, bf16, accumulation).
"""

from __future__ import annotations

import argparse
import sys
import time

CASES = [
    ("full_shard", {}),
    ("shard_grad_op", {}),
    ("no_shard", {}),
    ("hybrid_shard", {}),
    ("full_shard", {"remat": True}),
    ("shard_grad_op", {"remat": True}),
    ("full_shard", {"bf16": True}),
    ("no_shard", {"bf16": True}),
    ("full_shard", {"accumulation_steps": 2}),
    ("full_shard", {"accumulation_steps": 2, "accumulation": "local"}),
    ("full_shard", {"remat": True, "bf16": True, "accumulation_steps": 2}),
]


def build(name: str):
    """A model built on the meta device, its apply and params, loss_fn and a batch (per rank)."""
    import torch
    from torch.nn import functional as F

    import shardfn as sf
    from shardfn.models import GPT, MLP, GPTConfig

    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        with sf.meta_device():
            model = MLP(d=512, n_layer=4)
        units, B = r"blocks\.\d+", 8
        batch = (torch.randn(B, 512, generator=g), torch.randn(B, 512, generator=g))

        def loss_fn(params, b):
            return F.mse_loss(apply(params, b[0]), b[1])
    elif name == "gpt":
        with sf.meta_device():
            model = GPT(GPTConfig(vocab=512, block_size=64, n_layer=2, n_head=2, d=64))
        units, B = r"blocks\.\d+", 4
        batch = (torch.randint(0, 512, (B, 64), generator=g), torch.randint(0, 512, (B, 64), generator=g))

        def loss_fn(params, b):
            return F.cross_entropy(apply(params, b[0]).flatten(0, 1), b[1].flatten())
    elif name == "llama":
        import transformers as tf

        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa")
        with sf.meta_device():
            model = tf.LlamaForCausalLM(cfg)
        units, B = r"model\.layers\.\d+", 4
        batch = (torch.randint(0, 512, (B, 32), generator=g), torch.randint(0, 512, (B, 32), generator=g))

        def loss_fn(params, b):
            return apply(params, input_ids=b[0], labels=b[1], use_cache=False).loss
    else:
        raise ValueError(name)
    apply, params = sf.functionalize(model, units=units)
    return apply, params, loss_fn, batch


def rank_case(name: str, strategy: str, opts: dict, tp: int = 1) -> dict:
    """On every rank: estimate, then measure init and two steps; bytes."""
    import torch
    import torch.distributed as dist

    import shardfn as sf
    from shardfn._peak import step_peak

    world = dist.get_world_size() if dist.is_initialized() else 1
    opts = dict(opts)
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if opts.pop("bf16", False) else None
    apply, params, loss_fn, batch = build(name)
    if tp > 1:  # every rank builds the same batch: ranks that differ only in tp hold the same one
        mesh = sf.mesh(dp=world // tp, tp=tp)
        opts["specs"] = sf.specs(params, mesh, rules={"gpt": sf.rules.GPT, "llama": sf.rules.LLAMA}[name], default=sf.P("dp"))
    elif strategy == "hybrid_shard":
        mesh = sf.mesh(replicate=2, shard=world // 2)
    else:
        mesh = sf.mesh(dp=-1)
    step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, strategy=strategy, mixed_precision=mp, **opts)
    t0 = time.perf_counter()
    est = sf.estimate_memory(step, params, batch=batch)
    t_est = time.perf_counter() - t0
    s = step_peak(step, params, batch)
    return {"estimate": est.peak, "measured": s.peak, "rss_growth": s.rss_growth, "rise": s.peak - s.start,
            "where": f"{est.phase} {est.unit}".strip(), "estimate_s": t_est}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "llama"])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: a (world / tp, tp) mesh")
    args = ap.parse_args()
    if args.tp > 1 and "mlp" in args.models:
        args.models = [m for m in args.models if m != "mlp"]  # no ready rules
    sys.path.insert(0, __file__.rpartition("/")[0])
    import warnings

    warnings.filterwarnings("ignore")
    from shardfn._pool import RankPool

    rows = []
    for world in args.worlds:
        pool = RankPool(world, timeout=600, pg_timeout=300)
        try:
            for name in args.models:
                for strategy, opts in CASES:
                    if strategy == "hybrid_shard" and world % 2:
                        continue
                    if args.tp > 1 and (strategy not in ("full_shard", "shard_grad_op") or world % args.tp):
                        continue  # what a (dp, tp) mesh takes
                    res = pool.run(rank_case, name, strategy, opts, args.tp)
                    worst = max(res, key=lambda r: abs(r["estimate"] / r["measured"] - 1))
                    label = strategy + "".join(f" {k}={v}" for k, v in opts.items())
                    if args.tp > 1:
                        label = f"(dp={world // args.tp}, tp={args.tp}) " + label
                    ratio = worst["estimate"] / worst["measured"]
                    rows.append((name, world, label, worst["estimate"], worst["measured"], ratio, worst["rise"], worst["rss_growth"], worst["where"]))
                    print(f"{name:6} W={world} {label:52} est {worst['estimate'] / 2**20:8.2f} MiB  measured {worst['measured'] / 2**20:8.2f} MiB"
                          f"  ratio {ratio:.3f}  rise {worst['rise'] / 2**20:6.2f} / rss {(worst['rss_growth'] or 0) / 2**20:6.2f} MiB  ({worst['where']})",
                          flush=True)
        finally:
            pool.close(kill=True)
    if args.markdown:
        print("\n| model | world | options | estimate (MiB) | measured (MiB) | ratio | rise in the step: live bytes / RSS (MiB) | peak at |")
        print("|---|---|---|---|---|---|---|---|")
        for name, world, label, e, m, r, rise, rss, where in rows:
            print(f"| {name} | {world} | {label} | {e / 2**20:.2f} | {m / 2**20:.2f} | {r:.3f} | {rise / 2**20:.2f} / {(rss or 0) / 2**20:.2f} | {where} |")
    worst = max(rows, key=lambda r: abs(r[5] - 1))
    print(f"\nworst ratio {worst[5]:.3f} ({worst[0]}, world {worst[1]}, {worst[2]}) over {len(rows)} cases")


if __name__ == "__main__":
    main()
