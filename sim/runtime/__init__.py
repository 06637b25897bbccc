"""Runtimes: the clocks, the wall-clock and virtual-time event loops, the socket-less transport,
and memoized pure work for runs whose CPU is free."""
