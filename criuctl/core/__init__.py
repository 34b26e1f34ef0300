"""The bottom layer.

Errors, durable writes, test faults, process identities, the state dir and the workload registry,
the namespace init and its contract; imports nothing else of criuctl.
"""
