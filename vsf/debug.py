"""Debugging helpers: what each rank holds, and pictures of layouts."""

from vsf.sharding.inspect import AddressableShard, shards, visualize_sharding

__all__ = ["AddressableShard", "shards", "visualize_sharding"]
