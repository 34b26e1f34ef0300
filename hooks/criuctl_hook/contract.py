"""Names shared by criuctl (supervisor, agent) and the in-process hook. Constants only, no I/O."""

# Set by `criuctl run` in the workload's environment.
ENV_WORKLOAD = "CRIUCTL_WORKLOAD"  # the workload's name
ENV_HOOKS_DIR = "CRIUCTL_HOOKS_DIR"  # the hooks/ directory put on PYTHONPATH
# Set by the hook in the first Python process that loads it.
ENV_HOOKED_PID = "CRIUCTL_HOOKED_PID"
