"""A fast fleet model for capacity questions (docs/capacity.md): sessions arriving at a fleet of
accelerator replicas with a KV budget, a prefix cache, hold policies for paused append responses,
and a router; a discrete-event simulation in plain Python."""
