"""The node daemon (`criuctl agent`).

Its server and routes, both sides' state machines, durable records, the handoff processes and their
leases, the bundle transfer; imports criuctl.local and below (Kubernetes is handed in by the CLI).
"""
