"""Local workflows on one node.

Run (supervisor), the step boundary, freeze/dump/thaw, restore, the training-state snapshot; imports
criuctl.container and below.
"""
