"""GPU mechanisms.

The CUDA driver's checkpoint API, its suspend steps, NVML facts, a tree's GPU state around CRIU;
imports criuctl.format and below.
"""
