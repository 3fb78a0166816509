"""The `skillpool` console script: a thin dispatcher over the commands that live in their packages."""
