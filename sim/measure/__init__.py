"""`python -m sim measure`: seeded rollouts against any Responses endpoint, through the recorder."""
