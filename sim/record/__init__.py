"""`python -m sim record`: a recording reverse proxy for the Responses API (docs/calibration.md)."""
