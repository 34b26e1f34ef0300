"""criuctl on Kubernetes: pods as workloads, `criuctl migrate POD NODE`, the admission webhook.

The top layer but one (only `cli` sits above): it talks to the API server through the official
`kubernetes` client and to node agents through `criuctl.client.agents`; nothing below imports it.
"""
