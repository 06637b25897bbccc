"""The harness: experiments (a config in, a result out), capacity, fidelity, prediction and
validation jobs, run folders, the README's results table, and sweeps."""
