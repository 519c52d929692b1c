"""bloomtrain against DeepSpeed itself: the same HF `BloomForCausalLM` (same initial weights, batch,
AdamW settings, clip and seed), trained under DeepSpeed ZeRO-1, 2 and 3 and under bloomtrain's
ZeRO engine at the same stage, on 2 gloo ranks on the CPU. Reports step time and peak memory per
rank and their ratios, and the largest difference between the two sides' losses (which also
checks that the two setups are the same).

DeepSpeed: `deepspeed.initialize` on the HF model with `{"optimizer": {"type": "AdamW", "params":
{...}}, "zero_optimization": {"stage": S}, "gradient_clipping": 1.0}` and weight decay on
matrices only (Megatron's and HF Trainer's groups): its default optimizer for that config, the
FusedAdam op (on the CPU accelerator a C++ op, built on first use: g++ and ninja), as its users
get it (`torch_adam: true` would give torch's single-tensor loop, about 4x slower); its CPU accelerator
(`DS_ACCELERATOR=cpu`), gloo, shared-memory collectives off (they JIT-build a C++ extension).
bloomtrain: the HF model's weights copied into bloomtrain's model, `parallelize` at the same
stage, the ZeroAdamW step (reduce, clip, AdamW, refresh) as the Trainer calls it.
Attention: HF's BLOOM runs its default eager attention (softmax of the scores plus the ALiBi bias),
bloomtrain the kernel its `train.attention: auto` resolves to on the CPU (the Trainer's rule,
bloomtrain.model.attention.resolve_attention): SDPA with the bias as a float mask in fp32, and in
bf16 at sequences up to 128 the same eager math as HF's (SDPA's CPU kernel is slower there); the
kernel is part of what is measured, as a user of either gets it.
Both in `--precision` (fp32 by default: the losses then agree to ~1e-6; with bf16 both sides
accumulate and reduce gradients in fp32, as BLOOM did: DeepSpeed's ZeRO-1 is then BLOOM's
BF16_Optimizer, its ZeRO-2/3 take `grad_accum_dtype` and `communication_data_type` fp32).

Step: `--gas` micro-batches of `--micro-batch` x `--seq` tokens per rank, the loss of each
divided by gas, then the optimizer step.

Timing: both sides live in the same two processes (one intra-op thread each, as the ranks share
the cores); after `--warmup` steps per side, `--rounds` rounds alternate the sides, each timing
`--steps` steps one by one between barriers; the median per side is reported.

Peak memory: in fresh processes per side and stage, each importing the same modules (torch,
transformers, deepspeed, bloomtrain), joining the process group and building and stepping both
sides once at a toy size first (what they import lazily), the growth of the resident set's
high-water mark (VmHWM, /proc/self/status) over the resident set before the
model is built, through building the side and `--mem-steps` steps. The same measure on both
sides: everything the side allocates (model, gradients, optimizer states, buffers, activations,
communication staging), whatever allocator it goes through.

Prints a table and ends with one JSON line. Measures; asserts nothing.

    python bench/vs_deepspeed.py                      # ZeRO-1, 2, 3
    python bench/vs_deepspeed.py --stages 3 --hidden 512 --precision bf16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import alternate_rounds, timed_on_all_ranks  # noqa: E402

from bloomtrain.parallel import comm  # noqa: E402
from tests.dist import spawn_ranks  # noqa: E402

OPT = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
ENV = {"DS_ACCELERATOR": "cpu"}


# ---- shared -----------------------------------------------------------------------------------

def _hwm_and_rss() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, kb = line.split()[:2]
            out[key] = int(kb) * 1024
    return out["VmHWM:"], out["VmRSS:"]


def _reset_hwm() -> None:
    """Reset the resident high-water mark to the current resident set (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")



def _hf_model(args):
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(args.seed)
    cfg = BloomConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layer=args.layers,
                      n_head=args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                      initializer_range=0.02, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return BloomForCausalLM(cfg)  # eager attention: HF's BLOOM default, the only path it checks


def _batches(rank: int, args) -> list[torch.Tensor]:
    """This rank's micro-batches of one step, int64 [micro, seq + 1] each; the same every step."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
            for _ in range(args.gas)]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ---- the two sides ----------------------------------------------------------------------------

def deepspeed_side(stage: int, batches, args):
    import deepspeed
    model = _hf_model(args)
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # the tied LM head: once
                continue
            seen.add(id(p))
            norm = isinstance(module, torch.nn.LayerNorm)
            (no_decay if norm or pname == "bias" else decay).append(p)
    dp = torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": args.gas,
              "train_batch_size": args.micro_batch * args.gas * dp,
              "gradient_clipping": CLIP, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW",
                            "params": {**OPT, "betas": list(OPT["betas"])}},
              "zero_optimization": {"stage": stage},
              "bf16": {"enabled": args.precision == "bf16"}}
    if args.precision == "bf16":
        # BLOOM-style bf16, as bloomtrain runs it: gradients accumulated and reduced in fp32
        # (ZeRO-1: BLOOM's BF16_Optimizer; ZeRO-2/3: fp32 accumulation and communication).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if stage > 1:
            config["communication_data_type"] = "fp32"
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config,
        model_parameters=[{"params": decay, "weight_decay": OPT["weight_decay"]},
                          {"params": no_decay, "weight_decay": 0.0}])
    losses = []

    def step():
        total = 0.0
        for ids in batches:
            loss = _loss(engine(input_ids=ids[:, :-1]).logits, ids)
            engine.backward(loss)  # divides by gas
            engine.step()          # steps at the gas boundary
            total += loss.item()
        losses.append(total / len(batches))
    return step, losses


def bloomtrain_side(stage: int, batches, args):
    from bloomtrain.config import Config
    from bloomtrain.checkpoint.hf.convert import shape_from_hf_config
    from bloomtrain.model.attention import resolve_attention
    from bloomtrain.model import BloomForCausalLM
    from tests import helpers

    hf = _hf_model(args)
    shape = shape_from_hf_config(hf.config.to_dict())
    cfg = Config.from_dict({
        "model": {"preset": None, "hidden_size": shape.hidden_size,
                  "num_layers": shape.num_layers, "num_heads": shape.num_heads,
                  "vocab_size": shape.vocab_size},
        "parallel": {"zero_stage": stage},
        "optim": {"lr": OPT["lr"], "beta1": OPT["betas"][0], "beta2": OPT["betas"][1],
                  "eps": OPT["eps"], "weight_decay": OPT["weight_decay"], "clip_grad": CLIP},
        "train": {"train_iters": 1, "precision": args.precision, "seed": args.seed}})
    model = BloomForCausalLM(shape)  # on the CPU: parallelize copies these values
    model.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"},
                          strict=False)
    del hf
    from bloomtrain.parallel.parallelize import parallelize
    parts = parallelize(model, helpers.topology(cfg), cfg, device="cpu",
                        attention=resolve_attention("auto", 0.0, "cpu", args.precision, args.seq))
    chunk, opt = parts.chunks[0], parts.optimizer
    losses = []

    def step():
        total = 0.0
        for ids in batches:
            loss = chunk(ids[:, :-1], labels=ids[:, 1:])
            (loss / len(batches)).backward()
            total += loss.item()
        helpers.step(opt, OPT["lr"])
        losses.append(total / len(batches))
    return step, losses


SIDES = {"deepspeed": deepspeed_side, "bloomtrain": bloomtrain_side}


def _init_deepspeed():
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # joins the existing process group
    import transformers  # noqa: F401  (both sides import the same modules before measuring)
    import bloomtrain.parallel.parallelize  # noqa: F401
    return deepspeed


def time_rank(rank, world, stage, args):
    """Both sides in this process, alternated; step times and losses per side."""
    _init_deepspeed()
    batches = _batches(rank, args)
    sides = {name: make(stage, batches, args) for name, make in SIDES.items()}
    times = alternate_rounds({n: s[0] for n, s in sides.items()}, timed_on_all_ranks, args.warmup,
                             args.rounds, args.steps)
    return {n: {"step_times_s": times[n], "losses": sides[n][1]} for n in sides}


def memory_rank(rank, world, stage, side, args):
    """The growth of this process's resident high-water mark through building `side` and
    `--mem-steps` steps, from a fresh process that has imported everything already."""
    _init_deepspeed()
    # Both sides built and stepped once at a toy size first: each imports modules lazily as it
    # builds and steps (DeepSpeed's FusedAdam alone brings sympy and networkx, 75 MiB), and
    # those imports, not ZeRO's states, were 35-39% of each side's figure, more of DeepSpeed's.
    toy = argparse.Namespace(**{**vars(args), "hidden": 32, "layers": 1, "heads": 4,
                                "vocab": 256, "seq": 8, "micro_batch": 1})
    for warm in SIDES.values():
        toy_step, _ = warm(stage, _batches(rank, toy), toy)
        toy_step()
        del toy_step
    batches = _batches(rank, args)
    gc.collect()
    comm.barrier(comm.world_group(), "bench")
    _reset_hwm()
    _, base = _hwm_and_rss()
    step, losses = SIDES[side](stage, batches, args)
    for _ in range(args.mem_steps):
        step()
    peak, _ = _hwm_and_rss()
    return {"peak_bytes": peak - base, "losses": losses}


# ---- driver -----------------------------------------------------------------------------------

def run_stage(stage: int, args) -> dict:
    timed = spawn_ranks(args.world, time_rank, stage, args, env=ENV, timeout=3600)
    out = {}
    for side in SIDES:
        step_times = [max(ts) for ts in zip(*(r[side]["step_times_s"] for r in timed))]
        mem = spawn_ranks(args.world, memory_rank, stage, side, args, env=ENV, timeout=3600)
        out[side] = {"step_time_s": statistics.median(step_times), "step_times_s": step_times,
                     "peak_memory_bytes_per_rank": [m["peak_bytes"] for m in mem],
                     "losses": [r[side]["losses"] for r in timed]}
    diffs = [abs(a - b) for ra, rb in zip(out["bloomtrain"]["losses"], out["deepspeed"]["losses"])
             for a, b in zip(ra, rb)]
    ours, theirs = out["bloomtrain"], out["deepspeed"]
    out["max_loss_diff"] = max(diffs)
    out["step_time_bloomtrain_over_deepspeed"] = ours["step_time_s"] / theirs["step_time_s"]
    out["peak_memory_bloomtrain_over_deepspeed"] = (max(ours["peak_memory_bytes_per_rank"])
                                                   / max(theirs["peak_memory_bytes_per_rank"]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mem-steps", type=int, default=2)
    args = ap.parse_args()
    try:
        import deepspeed
    except ImportError:
        sys.exit("vs_deepspeed needs DeepSpeed: pip install 'bloomtrain[bench]' "
                 "(DS_BUILD_OPS=0 on a CPU machine)")
    import transformers
    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                "transformers": transformers.__version__}
    psi = _hf_model(args).num_parameters()
    print(f"BloomForCausalLM L={args.layers} h={args.hidden} heads={args.heads} "
          f"V={args.vocab}: {psi:,} parameters; {args.world} gloo ranks, {args.gas} x "
          f"{args.micro_batch} x {args.seq} tokens per rank per step, {args.precision}; {versions}")
    results = {}
    for stage in args.stages:
        r = results[stage] = run_stage(stage, args)
        print(f"ZeRO-{stage}: step time (median of {len(r['bloomtrain']['step_times_s'])}) "
              f"bloomtrain {r['bloomtrain']['step_time_s']:.3f} s, DeepSpeed "
              f"{r['deepspeed']['step_time_s']:.3f} s -> "
              f"{r['step_time_bloomtrain_over_deepspeed']:.2f}x; peak memory per rank "
              f"bloomtrain {[b / 2**20 for b in r['bloomtrain']['peak_memory_bytes_per_rank']]} "
              f"MiB, DeepSpeed {[b / 2**20 for b in r['deepspeed']['peak_memory_bytes_per_rank']]}"
              f" MiB -> {r['peak_memory_bloomtrain_over_deepspeed']:.2f}x; max loss diff "
              f"{r['max_loss_diff']:.2e}", flush=True)
    print("| stage | bloomtrain s/step | DeepSpeed s/step | time ratio | bloomtrain peak MiB | "
          "DeepSpeed peak MiB | memory ratio | max loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for stage, r in results.items():
        b, d = r["bloomtrain"], r["deepspeed"]
        print(f"| {stage} | {b['step_time_s']:.3f} | {d['step_time_s']:.3f} | "
              f"{r['step_time_bloomtrain_over_deepspeed']:.2f} | "
              f"{max(b['peak_memory_bytes_per_rank']) / 2**20:.1f} | "
              f"{max(d['peak_memory_bytes_per_rank']) / 2**20:.1f} | "
              f"{r['peak_memory_bloomtrain_over_deepspeed']:.2f} | {r['max_loss_diff']:.1e} |")
    print(json.dumps({
        "bench": "vs_deepspeed", "psi": psi, "world": args.world, "precision": args.precision,
        "versions": versions, "stages": {f"zero{s}": r for s, r in results.items()},
        "step_time_bloomtrain_over_deepspeed": {
            f"zero{s}": r["step_time_bloomtrain_over_deepspeed"] for s, r in results.items()},
        "peak_memory_bloomtrain_over_deepspeed": {
            f"zero{s}": r["peak_memory_bloomtrain_over_deepspeed"] for s, r in results.items()},
        "max_loss_diff": {f"zero{s}": r["max_loss_diff"] for s, r in results.items()}}))


if __name__ == "__main__":
    os.environ.update(ENV)
    main()
