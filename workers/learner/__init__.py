"""The learner side: a learner process's training loop, its network thread, what it sends and
reports, how it adopts new versions, and its checkpoints (docs/ARCHITECTURE.md)."""
