"""Benchmarks: each prints its workload, the hardware, the peer it is compared with, and the result."""
