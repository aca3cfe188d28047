"""The offline side: correctness gate, timing, sandboxed workers, the Optuna tuner, search-quality
replay. The runtime (api, dispatch, codegen) never imports this package."""
