"""Training a Flax GPT with nsp: configuration, data, the jitted step and the loop (``nsp train``)."""
