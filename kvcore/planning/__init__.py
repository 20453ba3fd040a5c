"""Everything that decides a transfer's path, in one package.

- :mod:`~kvcore.planning.serve_rule`: whether kvcore serves an engine's call at all, or
  passes it to the engine's own copy, from the measured evidence behind each row.
- :mod:`~kvcore.planning.path_policy` and :mod:`~kvcore.planning.path_choice`: the paths
  and the thresholds between them, and the choice for one request's runs.
- :mod:`~kvcore.planning.transfer_sides`, :mod:`~kvcore.planning.pair_checks` and
  :mod:`~kvcore.planning.layers`: what the buffers allow (dense rows, devices, dtypes),
  for one pair and for every layer's pair of a call.
- :mod:`~kvcore.planning.plans`: a request's :class:`~kvcore.planning.plans.TransferPlan`
  (indices checked, runs found, path chosen), with :mod:`~kvcore.planning.host_run` and
  :mod:`~kvcore.planning.staged_chunks` for the host rows' runs and their chunks.
- :mod:`~kvcore.planning.submissions`: a plan spread over a call's buffer pairs, in one
  submission where the pairs allow it.

:mod:`kvcore.mover` executes what these decide; nothing here runs a copy. Nothing is
re-exported here: import each name from its module.
"""
