"""Elastic re-layout, planned before restart: after ranks are lost (or added), the best new layouts.

Pure Python, no torch. ``replan(layout, manifest, lost=...)`` returns a ``ReplanResult`` whose
``options`` are ranked ``ReplanOption``s, each with:

- the new ``layout`` (same roles and names, every shard a valid layout the model splits over and whose
  weights fit the memory) and its ``renumbering`` (survivors keep their order: new rank = old rank minus
  the lost and released ranks below it; added ranks come last, or in the lost ranks' places: ``replace``);
- ``moves``: the ranks that change shard or weights (``RankMove``);
- ``fates``: per new shard and group name, the groups whose processes are an old group's (the
  communicator can be kept) and those rebuilt (``GroupFate``);
- ``missing``: every part of a tensor no survivor holds, with the lost ranks that held it
  (``MissingCopy``: the proof that it must come from a checkpoint);
- ``restore_sources(shard)``: per tensor the new shard's moving ranks need, every surviving copy
  (``SurvivingCopy``: old shard, slice, global boxes, holders as new ranks).

``restore_plan(option)`` is the restore refit itself: one ``RefitPlan`` over the new world from every
survivor's old tensors to the new tensors of every rank that needs weights (``LostWeightsError`` when a
part has no surviving copy); ``shardcore.engine.form_survivor_world`` forms the world it runs in.

``ReplanRequest``: a replan by value (spec, world, loss, model, constraints), picklable: ``.result()``, and
``.option(n)`` with its restore planned; what ``shardcore replan`` and ``replan --check`` build from.

``Renumbering`` maps old ranks to new ones (added ranks may replace lost ones in place: ``replaced``);
``holdings_key`` says when two ranks hold the same weights. A train shard's memory counts its gradients and
optimizer state: ``DEFAULT_TRAIN_BYTES_PER_PARAM`` (16, mixed-precision Adam), ``replan(train_bytes_per_param=)``.
"""

from __future__ import annotations

from .copies import Copies, MissingCopy, RestoreSources, SurvivingCopy
from .fate import GroupFate, RankMove, holdings_key
from .options import DEFAULT_TRAIN_BYTES_PER_PARAM, Proposal
from .renumbering import Renumbering, format_ranks, named_ranks
from .replan import ReplanOption, ReplanResult, replan
from .request import ReplanRequest
from .restore import restore_plan

__all__ = [
    "DEFAULT_TRAIN_BYTES_PER_PARAM",
    "Copies",
    "GroupFate",
    "MissingCopy",
    "Proposal",
    "RankMove",
    "Renumbering",
    "ReplanOption",
    "ReplanRequest",
    "ReplanResult",
    "RestoreSources",
    "SurvivingCopy",
    "format_ranks",
    "holdings_key",
    "named_ranks",
    "replan",
    "restore_plan",
]
