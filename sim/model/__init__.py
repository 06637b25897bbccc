"""The model stand-in: the token-generating accelerator, its KV and prefix cache, and the policy
that decides what the simulated model says."""
