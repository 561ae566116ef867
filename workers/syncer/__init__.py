"""The syncer side: a shard's receive path, its rounds, merge and outer step, the commit to the
store and the broadcast, and the process around them (docs/ARCHITECTURE.md)."""
