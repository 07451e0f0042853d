"""Refit straight into a vLLM engine's layout against gather-convert-send, on a live local gloo world.

A training shard in Megatron-Core's layout refits into a vLLM engine's own tensors (``qkv_proj``,
``gate_up_proj``, FusedMoE's ``w13_weight`` ...), two ways, on the same world, sources and destinations:

* ``shardcore``: ``plan_refit(..., layouts={1: model.layout("vllm")})`` once (outside the clock, as a kept
  plan), then ``execute_refit``: each engine rank receives only the elements it holds, straight from the
  training ranks that hold them, into its own tensors.
* ``gather-convert-send``, the way Megatron-Bridge and verl do it, tensor by tensor in the manifest's order:
  the training ranks holding a tensor all-gather it over their tp group (``dist.all_gather``, then one global
  tensor assembled from the parts), convert it to the Hugging Face tensors (``linear_qkv``'s interleaved
  query groups -> ``q_proj``, ``k_proj``, ``v_proj``; ``linear_fc1`` [gate; up] -> ``gate_proj``, ``up_proj``;
  the vocabulary's padding dropped), and send each Hugging Face tensor whole to every engine rank holding a
  part of it (the gathering ranks take turns), which receives it into a buffer and slices its part into its
  own tensors as vLLM's weight loaders do (``qkv_proj`` = [its q heads; its kv heads], ``gate_up_proj`` =
  [its gate rows; its up rows], ``o_proj`` / ``down_proj`` split on dim 1, vocab-parallel embeddings padded
  to 64, ``w13_weight`` per expert [gate; up] of its expt_tp rank). An expert is whole on its ep rank
  (expt_tp=1), which sends it without an all-gather over ep, and each pipeline stage sends its own tensors
  without a broadcast over pp: both steps verl and Megatron-Bridge's export take, so the baseline here moves
  fewer bytes than theirs. The element correspondences (which rows of ``linear_qkv`` are ``k_proj``, which rows
  of ``q_proj`` an engine rank packs where) are read from shardcore's weight maps (``HFModel.to_hf`` and
  ``HFModel.vllm``, the boxes the peers' code hard-codes), applied to whole tensors link by link; where a
  rank's part of a Megatron tensor lies comes from ``holdings``, and an engine rank's holdings from
  ``engine_placement``. The planner is not used: no plan, no pieces, no schedule.

Measured per method, in one run: wire bytes (tensor bytes a rank receives from another rank, all ranks; for
the baseline, of them the all-gather's), the busiest rank's bytes (sent or received), the largest extra memory
a rank allocates during the refit (shardcore: ``TransferStats.peak_buffer_bytes``, its staging; the baseline:
the gathered parts, the assembled global tensor and the converted Hugging Face tensors alive at once on a
training rank, the receive buffer on an engine rank; views of a tensor already held count nothing), and the
time (slowest rank, barrier to barrier, best of ``--repeat``; the methods alternate which goes first, and
destinations are written before the clock). After the last round every engine rank's tensors must be equal,
bitwise, between the methods and to the source's known tensors put through the weight map
(``layout_check.through_map``, which uses neither the planner nor the executor); the run fails otherwise.

Usage: python benchmarks/bench_refit_engine_layout.py [--repeat 3] [--threads 1] [--case llama qwen3_moe]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from bench_refit import known_sources

LLAMA = {
    "model_type": "llama", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}  # fmt: skip
"""Llama-3-like: GQA (4 query heads per kv head), SwiGLU, untied embeddings; 0.35 GB bf16."""
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "num_experts": 32, "num_experts_per_tok": 4, "vocab_size": 32000, "torch_dtype": "bfloat16",
}  # fmt: skip
"""Qwen3-MoE-like: GQA, q/k norms, 32 experts per layer, a router; 0.28 GB bf16."""
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("Llama-3-like (GQA)", LLAMA, "tp=2,pp=2,role=train + tp=2,dp=2"),
    "qwen3_moe": ("Qwen3-MoE-like", QWEN3_MOE, "tp=2,pp=2,ep=2,expt_tp=1,role=train + tp=2,expt_tp=2,dp=2"),
}
"""Per case: its label, its Hugging Face config, and the world's shards (8 ranks: training, then the engine)."""


@dataclass(frozen=True)
class Step:
    """The baseline's work on one Megatron tensor: who all-gathers it (one rank: no gather), who sends (in
    turns), and each Hugging Face tensor it becomes with the engine ranks that receive it whole."""

    name: str
    gatherers: tuple[int, ...]
    senders: tuple[int, ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]


class Ledger:
    """The baseline's bytes on one rank: what it sent and received, of that the all-gather's, and the most
    extra bytes it held at once (``hold`` / ``release`` around each allocation)."""

    def __init__(self) -> None:
        self.sent = self.received = self.gathered = self.live = self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class GatherConvertSend:
    """The peers' refit (see the module doc), set up once per world: its steps, tp groups and engine holdings."""

    def __init__(self, model: Any, layout: Any, rank: int) -> None:
        import torch.distributed as dist

        from shardcore.refit.holdings import holders, tp_size
        from shardcore.refit.vllm_packing import engine_placement

        self.model, self.rank = model, rank
        self.manifest = manifest = model.manifest
        self.source, engine = layout.shards[0], layout.shards[1]
        self.packing = model.vllm(engine.spec.tp, engine.spec.expt_tp)[1]
        placement = engine_placement(self.packing.targets, engine, split=True, label="engine")
        names = self.packing.targets.tensors
        held = {r: {names[h.position].name: h for h in placement.held(r)} for r in engine.ranks}
        self.held = held.get(rank, {})
        self.hf_links: dict[str, dict[str, list[Any]]] = {}
        steps, groups = [], set()
        for spec in manifest:
            by_target = self.hf_links[spec.name] = {}
            for link in model.to_hf.out_of(spec.name):
                by_target.setdefault(link.target, []).append(link)
            tp = tp_size(spec, self.source)
            gatherers = tuple(holders(spec, self.source, manifest, part)[0] for part in range(tp))
            senders = gatherers if tp > 1 else holders(spec, self.source, manifest, 0)
            outputs = []
            for target in by_target:
                fed = {link.target for link in self.packing.out_of(target)}
                outputs.append((target, tuple(r for r in engine.ranks if fed & held[r].keys())))
            steps.append(Step(spec.name, gatherers, senders, tuple(outputs)))
            if tp > 1:
                groups.add(gatherers)
        self.steps = steps
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted(groups)}  # every rank, same order

    def run(self, sources: dict[str, Any], destinations: dict[str, Any]) -> Ledger:
        """This rank's part of one refit: ``sources`` are its Megatron tensors, ``destinations`` its engine's."""
        import torch
        import torch.distributed as dist

        ledger = Ledger()
        for step in self.steps:
            if self.rank in step.senders:
                full = self._gather(step, sources[step.name], ledger)
                converted = self._convert(step.name, full, ledger)
                works: list[Any] = []  # isend's Work (typed Optional: None off its group)
                for target, receivers in step.outputs:
                    for turn, receiver in enumerate(receivers):
                        if step.senders[turn % len(step.senders)] == self.rank:
                            works.append(dist.isend(converted[target], receiver))
                            ledger.sent += converted[target].nbytes
                for work in works:
                    work.wait()
                ledger.release(ledger.live)  # the gathered parts, the global tensor, the converted ones
            for target, receivers in step.outputs:
                if self.rank in receivers:
                    spec = self.model.hf_manifest.tensor(target)
                    buffer = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
                    ledger.hold(buffer.nbytes)
                    sender = step.senders[receivers.index(self.rank) % len(step.senders)]
                    dist.recv(buffer, sender)
                    ledger.received += buffer.nbytes
                    self._load(target, buffer, destinations)
                    ledger.release(buffer.nbytes)
        return ledger

    def _gather(self, step: Step, local: Any, ledger: Ledger) -> Any:
        """The global Megatron tensor from the tp group's parts, placed where each part lies (``holdings``)."""
        import torch
        import torch.distributed as dist

        from shardcore.refit.holdings import holdings

        if len(step.gatherers) == 1:
            return local
        spec = self.manifest.tensor(step.name)
        parts = [torch.empty_like(local) for _ in step.gatherers]
        ledger.hold(sum(part.nbytes for part in parts))
        dist.all_gather(parts, local.contiguous(), group=self.groups[step.gatherers])
        moved = local.nbytes * (len(parts) - 1)  # each member's part to every other member
        ledger.sent += moved
        ledger.received += moved
        ledger.gathered += moved
        full = torch.empty(spec.shape, dtype=local.dtype)
        ledger.hold(full.nbytes)
        for member, part in zip(step.gatherers, parts):
            for box, offset in holdings(spec, self.source, member, self.manifest):
                full[tuple(slice(a, b) for a, b in box)] = part[
                    tuple(slice(o, o + b - a) for o, (a, b) in zip(offset, box))
                ]
        return full

    def _convert(self, name: str, full: Any, ledger: Ledger) -> dict[str, Any]:
        """The Hugging Face tensors Megatron tensor ``name`` is: a view where one contiguous box is the whole
        tensor (``gate_proj`` of ``linear_fc1``), else a new tensor filled box by box (``k_proj``)."""
        import torch

        from shardcore.refit.weightmap import whole

        out = {}
        for target, links in self.hf_links[name].items():
            shape = self.model.hf_manifest.tensor(target).shape
            origins = [full[tuple(slice(a, b) for a, b in link.origin)] for link in links]
            if len(links) == 1 and links[0].box == whole(shape) and origins[0].is_contiguous():
                out[target] = origins[0].reshape(shape)
                continue
            out[target] = torch.empty(shape, dtype=full.dtype)
            ledger.hold(out[target].nbytes)
            for link, origin in zip(links, origins):
                box = out[target][tuple(slice(a, b) for a, b in link.box)]
                box.copy_(origin.reshape(box.shape))
        return out

    def _load(self, name: str, tensor: Any, destinations: dict[str, Any]) -> None:
        """An engine rank's weight loader: its part of Hugging Face tensor ``name``, copied into its tensors."""
        from shardcore.refit.boxes import meets, moved, overlap
        from shardcore.refit.weightmap import translate

        for link in self.packing.out_of(name):
            held = self.held.get(link.target)
            for piece in held.slices if held is not None else ():
                if meets(piece.box, link.box):
                    shared = overlap(piece.box, link.box)
                    start = moved(piece.offset, piece.box, shared)
                    local = destinations[link.target][tuple(slice(s, s + b - a) for s, (a, b) in zip(start, shared))]
                    origin = translate(shared, link.box, link.origin)
                    local.copy_(tensor[tuple(slice(a, b) for a, b in origin)].reshape(local.shape))


def _filled(plan: Any, rank: int) -> dict[str, Any]:
    """This rank's engine tensors, every element ``FILL`` (what the reference leaves in vLLM's vocabulary
    padding), written before the clock as a model's parameters are (``bench_refit.empty_destinations`` makes
    the manifest's tensors; these are the engine's own)."""
    import torch

    from shardcore.engine.live.layout_check import FILL

    return {
        name: torch.full(shape, FILL, dtype=getattr(torch, plan.destination_tensor(name).destination_dtype))
        for name, shape in plan.for_rank(rank).destination_shapes.items()
    }


def bench_rank(rank: int, world: int, config: dict[str, Any], spec: str, repeat: int, threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from shardcore import execute_refit
    from shardcore.engine.live.layout_check import through_map
    from shardcore.engine.live.refit_check import KnownWeights, mismatches
    from shardcore.plan.layout import plan_layout
    from shardcore.refit.families import manifest_from_hf_config
    from shardcore.refit.planner import plan_refit

    layout = plan_layout(world, spec)
    started = time.perf_counter()
    model = manifest_from_hf_config(config)
    plan = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})
    planned = time.perf_counter() - started
    baseline = GatherConvertSend(model, layout, rank)
    sources = known_sources(plan, rank)
    seconds: dict[str, list[float]] = {"shardcore": [], "baseline": []}
    out: dict[str, Any] = {"rank": rank, "plan_s": planned}
    results: dict[str, dict[str, Any]] = {}
    for round_ in range(repeat):
        for method in ("shardcore", "baseline") if round_ % 2 == 0 else ("baseline", "shardcore"):
            destinations = _filled(plan, rank)
            dist.barrier()
            started = time.perf_counter()
            if method == "shardcore":
                stats = execute_refit(plan, sources, destinations, timeout=600)
            else:
                ledger = baseline.run(sources, destinations)
            dist.barrier()
            seconds[method].append(time.perf_counter() - started)
            results[method] = destinations
    out["shardcore"] = {
        "seconds": seconds["shardcore"],
        "sent": stats.wire_bytes_sent,
        "received": stats.wire_bytes_received,
        "gathered": 0,
        "peak": stats.peak_buffer_bytes,
    }
    out["baseline"] = {
        "seconds": seconds["baseline"],
        "sent": ledger.sent,
        "received": ledger.received,
        "gathered": ledger.gathered,
        "peak": ledger.peak,
    }
    weights, mapped = KnownWeights(plan.manifest), through_map(plan, rank)
    differ = [
        f"{method}: {text}" for method in seconds for text in mismatches(plan, rank, results[method], weights, mapped)
    ]
    differ += [
        f"rank {rank}: {name}: shardcore and gather-convert-send differ"
        for name, ours in results["shardcore"].items()
        if not torch.equal(ours.view(torch.uint8), results["baseline"][name].view(torch.uint8))
    ]
    if differ:
        raise AssertionError("; ".join(differ[:5]))
    out["checked"] = len(results["shardcore"])
    return out


def main() -> None:
    from shardcore.plan.layout import plan_layout
    from shardcore.plan.spec import parse_shards
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torch.set_num_threads)")
    args = parser.parse_args()
    print(f"{args.threads} thread(s) per rank, best of {args.repeat}; MiB = 2**20 bytes, GB = 1e9")
    columns = [
        "model", "shards", "method", "wire GB", "of it all-gather GB", "busiest rank GB",
        "peak extra MiB, training rank", "peak extra MiB, engine rank", "seconds", "wire x", "peak x",
        "time x", "engine tensors bitwise equal (both ways, reference)",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---:|" * (len(columns) - 3))
    for case in args.case:
        label, config, spec = CASES[case]
        world = sum(shard.world_size for shard in parse_shards(spec))
        started = time.perf_counter()
        results = run_world(world, bench_rank, config, spec, args.repeat, args.threads, timeout=1200, pg_timeout=600)
        engine = plan_layout(world, spec).shards[1].ranks
        rows = {}
        for method in ("shardcore", "baseline"):
            per = [r[method] for r in results]
            rows[method] = {
                "wire": sum(p["received"] for p in per),
                "gathered": sum(p["gathered"] for p in per),
                "busiest": max(max(p["sent"], p["received"]) for p in per),
                "train": max(p["peak"] for rank, p in enumerate(per) if rank not in engine),
                "engine": max(p["peak"] for rank, p in enumerate(per) if rank in engine),
                "seconds": min(max(column) for column in zip(*(p["seconds"] for p in per))),
            }
        ours = rows["shardcore"]
        checked = sum(r["checked"] for r in results)
        for method, name in (("shardcore", "shardcore (direct)"), ("baseline", "gather-convert-send")):
            row = rows[method]
            peak, our_peak = max(row["train"], row["engine"]), max(ours["train"], ours["engine"])
            print(
                f"| {label} | `{spec}` | {name} | {row['wire'] / 1e9:.3f} | {row['gathered'] / 1e9:.3f} | "
                f"{row['busiest'] / 1e9:.3f} | {row['train'] / 2**20:.1f} | {row['engine'] / 2**20:.1f} | "
                f"{row['seconds']:.3f} | {row['wire'] / ours['wire']:.2f}x | "
                f"{peak / our_peak if our_peak else float('inf'):.1f}x | {row['seconds'] / ours['seconds']:.2f}x | "
                f"{checked} |",
                flush=True,
            )
        plan_s, world_s = max(r["plan_s"] for r in results), time.perf_counter() - started
        print(f"<!-- {label}: plan (once, outside the clock) {plan_s:.2f} s; world {world_s:.0f} s -->")


if __name__ == "__main__":
    main()
