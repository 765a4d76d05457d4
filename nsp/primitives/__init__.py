"""JAX-facing operations: the fused near-storage update kernel and Top-K gradient compression."""
