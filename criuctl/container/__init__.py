"""Containers as workloads.

The runtimes, the dump plan, the inject dir, placeholders, the writable layer, mounts and volumes;
imports criuctl.net, criuctl.gpu and below.
"""
