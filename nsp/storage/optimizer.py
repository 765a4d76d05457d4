"""Which update a store runs: ``nsp.spec.OptimizerSpec``, recorded in ``nsp_store.json`` (re-exported here, where
the stores' users have always found it)."""

from nsp.spec import OptimizerSpec

__all__ = ["OptimizerSpec"]
