"""Tests of the caching-allocator simulator, its configuration parser and snapshot replays."""
