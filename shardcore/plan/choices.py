"""Every valid shard spec for a number of ranks: the one place that enumerates layouts.

A spec is a valid Megatron layout of R ranks when tp*cp*pp*dp = R, expt_tp*ep*pp divides R (so the
expert grid tiles the same window) and, under the ``tp-cp-pp-dp`` order with pp > 1, the decoder and
expert pipeline groups coincide (expt_tp*ep = tp*cp). Layout search (``shardcore.refit.search``) and
elastic re-layout (``shardcore.replan``) both draw their candidates from here; which of them a model
can use (its split dims, layers and experts) is the manifest's business, not the plan's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

from ..errors import LayoutError
from .arguments import MAX_WORLD_SIZE, check_count, shown
from .layout import DEFAULT_ORDER, pipelines_differ, resolve_order
from .spec import INT_KEYS, ShardSpec

AXES: tuple[str, ...] = INT_KEYS
"""The parallel axes a search may vary: tp, pp, cp, dp, ep, expt_tp."""


def divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending, in O(sqrt(number))."""
    small, large = [], []
    factor = 1
    while factor * factor <= number:
        if number % factor == 0:
            small.append(factor)
            if factor * factor != number:
                large.append(number // factor)
        factor += 1
    return small + large[::-1]


def check_axes(axes: object) -> dict[str, int]:
    """``axes`` as {axis: largest size allowed}: a collection of AXES names (each up to MAX_WORLD_SIZE) or a
    mapping of them to their largest size (``{"tp": 8, "dp": 64}``).

    Raises:
        LayoutError: not axis names, an unknown name or a bad size, naming the accepted ones.
    """
    if isinstance(axes, Mapping):
        limits = dict(axes)
    else:
        names = [axes] if isinstance(axes, str) else axes
        if not isinstance(names, Collection):
            raise LayoutError(f"axes={shown(axes)}: expected axis names from {', '.join(AXES)}")
        limits = dict.fromkeys(names, MAX_WORLD_SIZE)
    for name, limit in limits.items():
        if not isinstance(name, str) or name not in AXES:
            raise LayoutError(f"unknown axis {shown(name)}: choose from {', '.join(AXES)}")
        check_count(f"largest {name}", limit)
    return limits


def valid_specs(
    ranks: int,
    *,
    order: str = DEFAULT_ORDER,
    axes: Collection[str] | Mapping[str, int] = AXES,
    role: str | None = None,
    name: str | None = None,
) -> Iterator[ShardSpec]:
    """Every spec of exactly ``ranks`` ranks that ``plan_layout`` accepts under ``order``.

    Axes left out of ``axes`` stay at their default (1, and expt_tp = tp); a mapping also bounds each
    axis's size. Specs come in a fixed order: by tp, cp, pp, expt_tp, ep (each ascending).

    Args:
        ranks: the shard's size, 1 to MAX_WORLD_SIZE.
        order: the rank order the layout will use (``Order`` or Megatron's aliases).
        axes: the axes that may be larger than 1 (expt_tp: that may differ from tp), or a mapping of
            them to their largest size (see ``check_axes``).
        role / name: given to every spec.

    Raises:
        LayoutError: a bad count, order or axis.
    """
    check_count("ranks", ranks)
    resolved = resolve_order(order)
    limits = check_axes(axes)

    def sizes(axis: str, number: int) -> list[int]:
        return [size for size in divisors(number) if size <= limits[axis]] if axis in limits else [1]

    for tp in sizes("tp", ranks):
        for cp in sizes("cp", ranks // tp):
            for pp in sizes("pp", ranks // (tp * cp)):
                dp = ranks // (tp * cp * pp)
                if dp > limits.get("dp", 1):
                    continue
                stage = tp * cp * dp
                for expt_tp in sizes("expt_tp", stage) if "expt_tp" in limits else [tp]:
                    for ep in sizes("ep", stage // expt_tp):
                        if pipelines_differ(resolved, tp, cp, pp, expt_tp, ep):
                            continue
                        yield ShardSpec(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, expt_tp=expt_tp, role=role, name=name)


__all__ = ["AXES", "check_axes", "divisors", "valid_specs"]
