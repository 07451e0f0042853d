"""Megatron's inference recipe, as data: each ``ProcessGroupCollection`` field and the dims of the
``HyperCommGrid`` it is created over (``build_inference_pg_collection`` in megatron-core 0.19's
``megatron/core/inference/shards.py``, which 0.16.1 lacks).

The parity tests and the drop-in benchmark build Megatron's own groups from it, to compare with
shardcore's; it imports nothing, so the benchmark can use it without the test harness.
"""

from __future__ import annotations

DECODER_FIELDS: dict[str, str | list[str]] = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "dp": "dp",
    "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"],
    "dp_cp": ["cp", "dp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
}
"""Field -> dims on the decoder grid (tp, cp, dp, pp)."""

EXPERT_FIELDS: dict[str, str | list[str]] = {
    "ep": "ep",
    "expt_tp": "tp",
    "expt_dp": "dp",
    "tp_ep": ["tp", "ep"],
    "tp_ep_pp": ["tp", "ep", "pp"],
}
"""Field -> dims on the expert grid (tp, ep, dp, pp): Megatron reuses the names tp and dp there."""
