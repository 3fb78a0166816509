"""Where skill versions live: the folder and S3 backends, the node's disk cache, durable writes, skill names, and
the publish protocol (a version is visible whole or not at all).

Nothing outside this package knows the on-disk layout of a skill.
"""
