"""The bottom layer.

Errors, the environment variables, durable writes, test faults, process identities, the state dir
and its layout, the workload registry, the namespace init and its contract; imports nothing else of
criuctl.
"""
