"""Network mechanisms around a dump.

CRIU's network lock, cuts and redirects, TCP repair, a tree's endpoints, re-addressing; imports
criuctl.format and below.
"""
