"""Per-rank memory against world size for a 7B-parameter Llama: estimated, simulated, FSDP2, DDP.

- Estimated: `sf.estimate_memory` for each strategy (fp32 parameters, AdamW, one sequence of `--seq`
  tokens per rank) at world sizes 1 to 1024, each computed inside `sf.simulate(world=N)` (the
  step's mesh spans N ranks; nothing is allocated). `hybrid_shard` shards over 8 ranks (a node)
  and replicates across nodes.
- Simulated (`--simulate`): rank 0 of an N-rank job runs init and two real `full_shard` steps in a
  fresh process on a fake process group (`sf.simulate`), the model built under `sf.meta_device()`;
  its peak is measured with `shardfn._peak.PeakMeter` (live tensor bytes). Each takes minutes on
  this CPU (the full model's compute runs for one short sequence).
- FSDP2 (`--fsdp2`): the same, with `fully_shard` on every decoder layer and the root, the model
  built on the meta device and `to_empty` (values do not matter), `torch.optim.AdamW(fused=True)`.
- DDP: by formula, not simulated (a replica holds 16 bytes per parameter with AdamW: weights,
  gradients, two moments) plus the activations of shardfn's `no_shard` estimate; it does not
  depend on the world size and does not fit this machine.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/scale.py [--simulate 64 256 1024] [--fsdp2 64 256 1024] [--plot benchmarks/scale.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORLDS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]
NODE = 8


def llama_config(seq: int):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, max_position_embeddings=max(seq, 64), tie_word_embeddings=False,
                          attn_implementation="sdpa")


def _step_and_params(strategy: str, seq: int, recorded: bool):
    import torch
    import transformers as tf

    import shardfn as sf

    cfg = llama_config(seq)
    with (sf.meta_device() if recorded else torch.device("meta")):
        model = tf.LlamaForCausalLM(cfg)
    apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")

    def loss_fn(p, b):
        return apply(p, input_ids=b[0], labels=b[1], use_cache=False).loss

    world = torch.distributed.get_world_size()
    if strategy == "hybrid_shard":
        mesh = sf.mesh(replicate=max(1, world // NODE), shard=min(world, NODE))
    else:
        mesh = sf.mesh(dp=-1)
    step = sf.train_step(loss_fn, sf.optim.adamw(1e-4), mesh, strategy=strategy, check_memory=False)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32000, (1, seq), generator=g), torch.randint(0, 32000, (1, seq), generator=g))
    return step, params, batch


def _estimate(strategy: str, seq: int) -> dict:
    step, params, batch = _step_and_params(strategy, seq, recorded=False)
    est = __import__("shardfn").estimate_memory(step, params, batch=batch)
    return {"peak": est.peak, "where": f"{est.phase} {est.unit}".strip(), "at_peak": est.at_peak}


def _simulated(seq: int) -> dict:
    from shardfn._peak import step_peak

    import shardfn as sf

    step, params, batch = _step_and_params("full_shard", seq, recorded=True)
    est = sf.estimate_memory(step, params, batch=batch)
    t0 = time.perf_counter()
    top = step_peak(step, params, batch)
    return {"estimate": est.peak, "measured": top.peak, "rss_growth": top.rss_growth, "seconds": time.perf_counter() - t0}


def _fsdp2(seq: int) -> dict:
    import torch
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardfn._peak import PeakMeter

    world = torch.distributed.get_world_size()
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(llama_config(seq))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32000, (1, seq), generator=g), torch.randint(0, 32000, (1, seq), generator=g)
    meter = PeakMeter()
    t0 = time.perf_counter()
    with meter:
        model.to_empty(device="cpu")
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # a buffer: values do not matter here
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for i in range(2):
            with meter.section(f"step{i}"):
                loss = model(input_ids=x, labels=y, use_cache=False).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
    return {"measured": max(meter["step0"].peak, meter["step1"].peak), "seconds": time.perf_counter() - t0}


def child(kind: str, world: int, seq: int) -> None:
    """One simulated rank in this (fresh) process; prints its figures as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    import shardfn as sf

    fn = {"simulated": _simulated, "fsdp2": _fsdp2}[kind]
    print("RESULT " + json.dumps(sf.simulate(fn, seq, world=world)), flush=True)


def _run_child(kind: str, world: int, seq: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(world), str(seq)], capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} at world {world} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=16, help="tokens per rank (one sequence)")
    ap.add_argument("--long-seq", type=int, default=2048, help="also estimate at this many tokens per rank (0: no)")
    ap.add_argument("--simulate", type=int, nargs="*", default=[], help="world sizes to simulate shardfn's full_shard at")
    ap.add_argument("--fsdp2", type=int, nargs="*", default=[], help="world sizes to simulate FSDP2 at")
    ap.add_argument("--plot", default=None, help="write a plot here (PNG)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    import warnings

    warnings.filterwarnings("ignore")
    import shardfn as sf

    gib = 1 << 30
    n_params = 6_738_415_616  # Llama-2-7B's parameters (this configuration)
    results: dict = {"estimate": {}, "estimate_long": {}, "simulated": {}, "fsdp2": {}}
    for seq, key in [(args.seq, "estimate")] + ([(args.long_seq, "estimate_long")] if args.long_seq else []):
        for strategy in STRATEGIES:
            for w in WORLDS:
                if strategy == "hybrid_shard" and w < NODE:
                    continue
                t0 = time.perf_counter()
                r = sf.simulate(_estimate, strategy, seq, world=w)
                results[key].setdefault(strategy, {})[w] = r
                print(f"estimate {strategy:13} seq {seq:5} world {w:5}: {r['peak'] / gib:8.2f} GiB ({r['where']}, {time.perf_counter() - t0:.1f} s)",
                      flush=True)
    for kind, worlds in (("simulated", args.simulate), ("fsdp2", args.fsdp2)):
        for w in worlds:
            try:
                r = results[kind][w] = _run_child(kind, w, args.seq)
            except RuntimeError as e:
                print(e, flush=True)
                continue
            vs = f", estimate {r['estimate'] / gib:.3f} GiB, ratio {r['estimate'] / r['measured']:.3f}" if "estimate" in r else ""
            print(f"{kind} world {w}: measured {r['measured'] / gib:.3f} GiB{vs} ({r['seconds']:.0f} s)", flush=True)
    act = results["estimate"]["no_shard"][1]["at_peak"]["activations"]
    ddp = 16 * n_params + act
    print(f"DDP (formula: 16 B/param + activations): {ddp / gib:.2f} GiB at every world size")

    print("\n| world | " + " | ".join(STRATEGIES) + " | shardfn full_shard simulated | FSDP2 simulated | DDP (formula) |")
    print("|---|" + "---|" * (len(STRATEGIES) + 3))
    for w in WORLDS:
        cells = []
        for s in STRATEGIES:
            r = results["estimate"].get(s, {}).get(w)
            cells.append(f"{r['peak'] / gib:.2f}" if r else "")
        sim = results["simulated"].get(w)
        fs = results["fsdp2"].get(w)
        cells.append(f"{sim['measured'] / gib:.2f} (estimate/measured {sim['estimate'] / sim['measured']:.3f})" if sim else "")
        cells.append(f"{fs['measured'] / gib:.2f}" if fs else "")
        cells.append(f"{ddp / gib:.1f}")
        print(f"| {w} | " + " | ".join(cells) + " |")
    if args.long_seq:
        print(f"\nEstimated at {args.long_seq} tokens per rank (GiB):\n")
        print("| world | " + " | ".join(STRATEGIES) + " |")
        print("|---|" + "---|" * len(STRATEGIES))
        for w in WORLDS:
            cells = [f"{results['estimate_long'][s][w]['peak'] / gib:.2f}" if w in results["estimate_long"].get(s, {}) else "" for s in STRATEGIES]
            print(f"| {w} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in STRATEGIES:
            pts = sorted(results["estimate"][s].items())
            ax.plot([w for w, _ in pts], [r["peak"] / gib for _, r in pts], marker=".", label=f"shardfn {s} (estimate)")
        if results["simulated"]:
            pts = sorted(results["simulated"].items())
            ax.plot([w for w, _ in pts], [r["measured"] / gib for _, r in pts], "ko", mfc="none", ms=9, label="shardfn full_shard (simulated rank)")
        if results["fsdp2"]:
            pts = sorted(results["fsdp2"].items())
            ax.plot([w for w, _ in pts], [r["measured"] / gib for _, r in pts], "r^", ms=8, label="FSDP2 (simulated rank)")
        ax.axhline(ddp / gib, color="gray", ls="--", label="DDP (formula)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("peak memory per rank (GiB)")
        ax.set_title(f"Llama 7B, fp32 + AdamW, {args.seq} tokens per rank")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
