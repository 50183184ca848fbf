"""In-model tools, called inside a model while it is traced: remat, pipeline.

One concept per module; each module's public names are re-exported here and from
``shardax``.
"""
