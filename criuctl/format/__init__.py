"""The bundle format on disk.

Manifest, signing, seal and verify, the image tail, CRIU image readers; imports criuctl.engine and
criuctl.core.
"""
