"""The steps of an SGLang reload whose host time :mod:`benchmarks.sglang.host_cost`'s
profile splits out, each as ``module:function`` where its caller looks it up."""

from __future__ import annotations

# Each step is named on the module its caller reads it from at call time: the hooks import
# the load path's steps by name, the load path reads its own, and both reach call_plans'
# through that module.
_HOOKS = "kvcore_sglang.transfers"
_LOADS = "kvcore_sglang.layer_loads"
_PLANS = "kvcore_sglang.call_plans"
PHASES: tuple[str, ...] = (
    f"{_HOOKS}:continued",
    f"{_HOOKS}:later_layer_served",
    f"{_HOOKS}:call_rule",
    f"{_HOOKS}:load_layer",
    f"{_LOADS}:_start_load",
    f"{_PLANS}:call_indices",
    f"{_LOADS}:host_runs_pass",
    f"{_LOADS}:_serve_layer",
    f"{_LOADS}:_layer_buffers",
    f"{_LOADS}:_kept_layer_job",
    f"{_PLANS}:first_plan",
    f"{_PLANS}:plan_device_indexed_for",
    f"{_PLANS}:plan_for",
    "kvcore.planning.device_indexed:span_and_runs_of",
    "kvcore.planning.plans:_gather_if_host_rules_out_dma",
    "kvcore.planning.plans:segment_values",
    "kvcore.planning.plans:decided",
    "kvcore.planning.device_indexed:decided",
    "kvcore.planning.plans:TransferPlan.without_buffers",
    f"{_LOADS}:_moved_host_rows",
    "kvcore.mover:Mover.prepare_layers",
    "kvcore.kernels.reference:prepare_stage_in",
    "kvcore.kernels.index_upload:IndexUploader.keep",
    "kvcore.mover:Mover.execute_prepared",
    "kvcore.mover:Mover._stage_in",
    "kvcore.staging:_Lease.__enter__",
    "kvcore.staging:_Lease.__exit__",
    "kvcore.kernels.reference:stage_in_prepared",
    "kvcore.kernels.reference:chunk_views",
    "kvcore.kernels.reference:listed_runs_to_staging",
    "torch:Tensor.copy_",
    "torch:Tensor.index_copy_",
    "kvcore.kernels.cuda:_DeviceRows.ready",
    "kvcore.kernels.cuda:_CudaIndexedOps._launch",
    "kvcore.kernels.triton_layers:LayeredLaunch.__call__",
    "kvcore.mover:Mover._record_layers",
)
