"""The CRIU engine.

Options, pure request builders and the RPC conversation with `criu swrk`; imports only criuctl.core.
"""
