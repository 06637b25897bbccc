"""Rollouts as values: a rollout's seeded specification (`spec`), what a run of it produced
(`result`: turn and rollout results, the API modes' names), the workload profiles that draw
specs (`workload`) and recorded traces replayed as specs (`replay`). Pure: no I/O."""
