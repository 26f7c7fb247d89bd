"""The rollout machinery under the engine, as AReaL 1.0.4's `areal.infra`: the HTTP client of the inference servers
(`remote_inf_engine`), the executor that runs workflow episodes on the engine's event loop (`workflow_executor`)
and the staleness bound that decides when an episode may start (`staleness_manager`). Launchers and schedulers,
which AReaL also keeps here, are kit-only conveniences in `areal_lite.kit`.
"""
