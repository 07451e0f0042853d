"""Megatron-Core's own refit against shardcore's Megatron plugin, side by side on one live gloo world.

Both sides refit the same megatron-core ``GPTModel``s (bf16, hidden 1024, ffn 4096 SwiGLU, 16 heads,
vocab 32768: the benchmarks' transformer, ~0.28 GB at 4 layers and ~0.55 GB at 12) over the same
shardcore-built ProcessGroupCollections, on 8 ranks, one intra-op thread each:

* Megatron: ``megatron.core.resharding.swap_model_weights(src, dst, "gloo")`` (megatron-core 0.19.x),
  whose plan is cached by parallel sizes after its first call;
* shardcore: ``shardcore_megatron.refit.refit(src, dst, shards, src=..., dst=...)``, the one-call
  path, whose plan is kept across calls (``kept_plans``), and the same call with the kept plans
  cleared before each call (planning anew every call, as the one-call path did before).

Layouts: tp=2,pp=2,dp=2 to tp=1,dp=8 and to tp=4,dp=2 over the same 8 ranks (collocated), and
tp=2,pp=2 on ranks 0-3 to tp=1,dp=4 and to tp=4 on ranks 4-7 (disjoint).

Per layout, in one run: seconds per refit (slowest rank, barrier to barrier; "first" = a call with
no plan kept, so it plans; "kept" = the median of ``--repeat`` calls with the plan kept), planning
and metadata cost per rank (each side's own planning call timed on every rank, the slowest shown,
and the bytes each rank contributes to the metadata all-gather), wire bytes (tensor bytes sent to
another rank, all ranks), and peak memory (the largest growth of a rank's resident set during a kept
call, sampled every millisecond). Every call's destination is checked: no element keeps the value it
was filled with before the call, and both sides' destinations are equal bitwise, rank by rank.

What had to be stubbed for Megatron's refit to run on CPU (in this benchmark's processes only):
``megatron.core.resharding.execution`` and ``...copy_services.gloo_copy_service`` call
``torch.cuda.Stream/stream/current_stream/Event/synchronize/empty_cache`` and allocate their staging
buffers with ``pin_memory=True``; those two modules see a ``torch`` whose ``cuda`` calls do nothing
and whose ``empty`` ignores ``pin_memory``. Nothing else of megatron-core is changed. On CPU the gloo
copy service's GPU-to-host staging copies become host-to-host copies: it still stages every message
(one buffer per send and per receive, all alive until the exchange ends), as it does on a GPU.

Needs megatron-core 0.19.x on Python 3.12 (tox env ``megatron019``):
    .tox/megatron019/bin/python benchmarks/bench_refit_megatron.py [--layers 4 12] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import pickle
import statistics
import threading
import time
import types
import warnings
import zlib
from typing import Any

WORLD = 8
CASES = (
    ("collocated", "tp=2,pp=2,dp=2", "tp=1,dp=8"),
    ("collocated", "tp=2,pp=2,dp=2", "tp=4,dp=2"),
    ("disjoint", "tp=2,pp=2", "tp=1,dp=4"),
    ("disjoint", "tp=2,pp=2", "tp=4"),
)
MARK = -7.0
"""What a destination holds before each call: a refit that left an element unwritten shows."""


class _NoCuda:
    """``torch.cuda`` as megatron-core's resharding execution uses it, on a process with no GPU: streams,
    events and synchronization that do nothing (every copy on CPU is done when it returns)."""

    class Stream:
        def __init__(self, *_: Any, **__: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def wait_event(self, _: Any) -> None:
            pass

        def wait_stream(self, _: Any) -> None:
            pass

    class Event:
        def record(self, *_: Any) -> None:
            pass

    @staticmethod
    def stream(_: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream() -> _NoCuda.Stream:
        return _NoCuda.Stream()

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _stub_cuda_in_resharding() -> None:
    """The two megatron-core modules that need a GPU see a torch whose cuda calls do nothing (see above)."""
    import torch
    from megatron.core.resharding import execution
    from megatron.core.resharding.copy_services import gloo_copy_service

    class CpuTorch(types.ModuleType):
        cuda = _NoCuda

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
            return torch.empty(*args, **kwargs)

    for module in (execution, gloo_copy_service):
        module.torch = CpuTorch("torch")  # type: ignore[attr-defined]


class _PeakRss:
    """The largest growth of this process's resident set while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.growth = 0
        self._stop = threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _sample(self, before: int) -> None:
        while not self._stop.wait(0.001):
            self.growth = max(self.growth, self._rss() - before)

    def __enter__(self) -> _PeakRss:
        self._thread = threading.Thread(target=self._sample, args=(self._rss(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def _config(spec: Any, layers: int, hidden: int) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=16,
        ffn_hidden_size=4 * hidden,
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
    )


def _gpt(shard: Any, layers: int, hidden: int) -> Any:
    """This rank's stage of the GPT over its shard's ProcessGroupCollection (weights not initialized)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    groups = shard.handle
    stage = groups.pp.rank()
    return GPTModel(
        _config(shard.spec, layers, hidden),
        get_gpt_layer_local_spec(),
        vocab_size=32768,
        max_sequence_length=4096,
        pre_process=stage == 0,
        post_process=stage == shard.spec.pp - 1,
        pg_collection=groups,
    )


def _fill_source(gpt: Any, shard: Any) -> None:
    """Each local tensor from a seed of its global name and tp rank: the dp replicas hold the same values."""
    import torch

    from shardcore_megatron.refit import refit_tensors

    tp = shard.handle.tp.rank()
    with torch.no_grad():
        for tensor in refit_tensors(gpt):
            split = getattr(tensor.tensor, "tensor_model_parallel", False)
            seed = zlib.crc32(f"{tensor.name}/{tp if split else 0}".encode())
            values = torch.empty(tensor.tensor.shape).normal_(generator=torch.Generator().manual_seed(seed))
            tensor.tensor.copy_(values)


def _mark(gpt: Any) -> None:
    import torch

    with torch.no_grad():
        for parameter in gpt.parameters():
            parameter.fill_(MARK)


def _digests(gpt: Any) -> dict[str, str]:
    """sha256 of each local destination tensor's bytes; raises if an element kept the mark."""
    import torch

    out = {}
    for name, parameter in gpt.named_parameters():
        if bool((parameter == MARK).any()):
            raise RuntimeError(f"{name}: the refit left elements unwritten")
        out[name] = hashlib.sha256(parameter.detach().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _timed(call: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    call()
    dist.barrier()
    return time.perf_counter() - started


class _Megatron:
    """Megatron-Core's side: ``swap_model_weights(src, dst, "gloo")``, its plan cached after the first call."""

    def __init__(self, src: Any, dst: Any, rank: int) -> None:
        self.src, self.dst, self.rank = src, dst, rank

    def planning(self) -> dict[str, Any]:
        """Its planning call timed on this rank, the metadata this rank all-gathers, its wire bytes."""
        import torch.distributed as dist
        from megatron.core.resharding import build_local_reshard_plan, planner

        metadata = tuple(
            planner._extract_module_metadata(model, self.rank, None, 0, {}) if model is not None else []
            for model in (self.src, self.dst)
        )
        dist.barrier()
        started = time.perf_counter()
        plan = build_local_reshard_plan(self.src, self.dst, num_experts=None)
        seconds = time.perf_counter() - started
        return {"plan_s": seconds, "metadata_bytes": len(pickle.dumps(metadata)), "wire": self._wire(plan)}

    def _wire(self, plan: Any) -> int:
        """Tensor bytes this rank sends to other ranks under Megatron's plan."""
        from megatron.core.resharding.utils import get_refit_tensor_dict

        params = get_refit_tensor_dict(self.src) if self.src is not None else {}
        return sum(
            params[op.param_name][op.my_slice].numel() * params[op.param_name].element_size()
            for op in plan.send_ops
            if op.peer_rank != self.rank and op.param_name in params
        )

    def forget(self) -> None:
        from megatron.core.resharding import refit

        refit.clear_plan_cache()

    def call(self) -> None:
        import torch
        from megatron.core.resharding import swap_model_weights

        with torch.no_grad():
            swap_model_weights(self.src, self.dst, "gloo")


class _Shardcore:
    """shardcore's side: the Megatron plugin's one-call ``refit``, its plan kept across calls."""

    def __init__(self, src: Any, dst: Any, shards: Any, source: Any, target: Any) -> None:
        self.src, self.dst, self.shards, self.source, self.target = src, dst, shards, source, target
        self.wire = 0

    def planning(self) -> dict[str, Any]:
        """Its planning (records, the all-gather, the manifest, ``plan_refit``) timed on this rank."""
        import torch.distributed as dist

        from shardcore.refit import plan_refit
        from shardcore_megatron import refit as plugin

        layout = plugin._layout(self.shards)
        plans = (plugin._shard_plan(layout, self.source), plugin._shard_plan(layout, self.target))
        records = plugin._local_records(self.src, self.dst, *plans, dist.get_rank())
        dist.barrier()
        started = time.perf_counter()
        plan_refit(layout, plans[0], [plans[1]], plugin.read_manifest(self.src, self.dst, *plans))
        return {"plan_s": time.perf_counter() - started, "metadata_bytes": len(pickle.dumps(records))}

    def forget(self) -> None:
        from shardcore_megatron import refit as plugin

        plugin.kept_plans.clear()

    def call(self) -> None:
        from shardcore_megatron import refit as plugin

        stats = plugin.refit(self.src, self.dst, self.shards, src=self.source, dst=self.target, timeout=600)
        self.wire = stats.bytes_sent


def _measure(side: Any, dst: Any, forget: bool = False) -> tuple[float, int]:
    """One call of ``side`` (its plans forgotten first where ``forget``): seconds, barrier to barrier, and the
    largest growth of this rank's resident set during it; the destination marked before, checked after."""
    if forget:
        side.forget()
    if dst is not None:
        _mark(dst)
    with _PeakRss() as rss:
        seconds = _timed(side.call)
    return seconds, rss.growth


def _compare(src: Any, dst: Any, shards: Any, source: Any, target: Any, rank: int, repeat: int) -> dict[str, Any]:
    """Both sides on one layout: planning, a first call each (plans forgotten), then ``repeat`` rounds that
    alternate Megatron kept, shardcore kept, shardcore replanning (so a change of load hits all three)."""
    megatron, shardcore = _Megatron(src, dst, rank), _Shardcore(src, dst, shards, source, target)
    out: dict[str, Any] = {"megatron": megatron.planning(), "shardcore": shardcore.planning()}
    digests = {}
    for name, side in (("megatron", megatron), ("shardcore", shardcore)):
        out[name]["first"] = _measure(side, dst, forget=True)[0]
        digests[name] = _digests(dst) if dst is not None else {}
    if digests["megatron"] != digests["shardcore"]:
        raise RuntimeError(f"rank {rank}: Megatron's and shardcore's destinations differ")
    rounds: dict[str, list[tuple[float, int]]] = {"megatron": [], "shardcore": [], "replan": []}
    for _ in range(repeat):
        rounds["megatron"].append(_measure(megatron, dst))
        rounds["shardcore"].append(_measure(shardcore, dst))
        rounds["replan"].append(_measure(shardcore, dst, forget=True))
    if dst is not None and _digests(dst) != digests["shardcore"]:
        raise RuntimeError(f"rank {rank}: a replanning call left other destinations")
    for name in ("megatron", "shardcore"):
        out[name]["kept"] = statistics.median(seconds for seconds, _ in rounds[name])
        out[name]["rss"] = max(growth for _, growth in rounds[name])
    out["shardcore"]["replan"] = statistics.median(seconds for seconds, _ in rounds["replan"])
    out["shardcore"]["wire"] = shardcore.wire
    megatron.forget()
    shardcore.forget()
    return out


def bench_rank(rank: int, world: int, layer_counts: list[int], repeat: int, hidden: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from shardcore import build_shards, destroy_shards

    _stub_cuda_in_resharding()
    rows = []
    for layers in layer_counts:
        for kind, source_spec, target_spec in CASES:
            if kind == "collocated":
                src_shards, dst_shards = (
                    build_shards(world, spec, backend="megatron") for spec in (source_spec, target_spec)
                )
                source, target, shards = src_shards[0], dst_shards[0], src_shards
            else:
                src_shards = dst_shards = build_shards(world, f"{source_spec} + {target_spec}", backend="megatron")
                source, target, shards = src_shards[0], src_shards[1], src_shards
            src = _gpt(source, layers, hidden) if source.is_member else None
            dst = _gpt(target, layers, hidden) if target.is_member else None
            if src is not None:
                _fill_source(src, source)
            row = _compare(src, dst, shards, source, target, rank, repeat)
            rows.append({"layers": layers, "case": (kind, source_spec, target_spec)} | row)
            del src, dst
            for built in {id(src_shards): src_shards, id(dst_shards): dst_shards}.values():
                destroy_shards(built)
            gc.collect()
    return rows


def _row(per_rank: list[dict[str, Any]]) -> str:
    layers, (kind, source, target) = per_rank[0]["layers"], per_rank[0]["case"]

    def worst(side: str, key: str) -> float:
        return max(r[side][key] for r in per_rank)

    def total(side: str, key: str) -> int:
        return sum(r[side][key] for r in per_rank)

    m_first, m_kept = worst("megatron", "first"), worst("megatron", "kept")
    s_first, s_kept, s_replan = worst("shardcore", "first"), worst("shardcore", "kept"), worst("shardcore", "replan")
    return (
        f"| {layers} | {kind} | `{source}` -> `{target}` | {m_first:.3f} | {m_kept:.3f} | {s_first:.3f} | "
        f"{s_kept:.3f} | {s_replan:.3f} | {m_kept / s_kept:.2f}x | {m_first / s_first:.2f}x | "
        f"{worst('megatron', 'plan_s') * 1e3:.0f} | {worst('shardcore', 'plan_s') * 1e3:.0f} | "
        f"{worst('megatron', 'metadata_bytes') / 1024:.0f} | {worst('shardcore', 'metadata_bytes') / 1024:.0f} | "
        f"{total('megatron', 'wire') / 1e9:.3f} | {total('shardcore', 'wire') / 1e9:.3f} | "
        f"{worst('megatron', 'rss') / 2**20:.0f} | {worst('shardcore', 'rss') / 2**20:.0f} | yes |"
    )


def main() -> None:
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--repeat", type=int, default=5, help="kept calls per side and layout (the median is shown)")
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    import megatron.core
    import torch

    print(
        f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {WORLD} ranks on gloo, 1 thread each, "
        f"hidden {args.hidden}, median of {args.repeat} kept calls"
    )
    print(
        "| layers | ranks | layouts | Megatron first s | Megatron kept s | shardcore first s | shardcore one-call s | "
        "shardcore replanning s | Megatron kept / shardcore one-call | first / first | Megatron plan ms/rank | "
        "shardcore plan ms/rank | Megatron metadata KiB/rank | shardcore metadata KiB/rank | Megatron wire GB | "
        "shardcore wire GB | Megatron RSS growth MiB | shardcore RSS growth MiB | bitwise equal |"
    )
    print("|---:|---|---|" + "---:|" * 15 + "---|")
    results = run_world(WORLD, bench_rank, args.layers, args.repeat, args.hidden, timeout=3600, pg_timeout=1200)
    for index in range(len(results[0])):
        print(_row([rank_rows[index] for rank_rows in results]))


if __name__ == "__main__":
    main()
