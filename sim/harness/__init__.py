"""The harness: the measuring client, the rollout loop, tools, workloads, experiments (a config
in, a result out), run folders and sweeps."""
