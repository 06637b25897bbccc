"""Analysis: metric definitions, intervals, and the tables and text the README and notebooks
show."""
