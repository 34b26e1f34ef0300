"""The migration client.

One move, a job's move, job discovery, the node list and a client for one agent; imports
criuctl.agent and below, never the server's routes at run time.
"""
